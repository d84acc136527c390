"""The scripts stay lessons a reader can follow and copy from. These tests prove that

1. `diff train_single_gpu.py train_ddp_basic.py`, chapter 2's lesson, holds at most 61 changed
   lines counting both sides (its docstring's launch commands and the 4-line guard against
   TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo among them), and most of the trainer is shared line for
   line;
2. every block of lines the DDP script adds or changes (outside its docstring, which holds the
   launch commands) opens with a short `# DDP k` tag on its first line; the tags 1..9 are all
   there, and the README's table of changes has a row for each;
3. the LM trainer numbers its DDP lines 1..16 in its own reading order, each with a row in the
   README's chapter 3 (which says which of chapter 2's changes it is); no GPT script has a tag
   without a number (`# DDP:`), and each says in its docstring how its tags are numbered;
4. in every GPT script and chapter 2, every family's tags first appear in reading order (1, 2,
   3...; imports aside, main() and the docstring included), and main()'s code (its comments
   aside, each saying what its own chapter does) is the same in chapters 3, 7, 8 and 10 but for
   chapter 3's --check-sync (chapter 9 adds its schedule; chapter 11's is chapter 9's);
5. no line of a training script is over 100 characters and no function takes more than 6
   parameters; in the classifiers main() comes before the steps it calls; the GPT trainers read
   top-down: main() first, then its core steps in the order it first calls them (each helper
   below a function that uses it, a record class right above its builder), then the model, then
   the steps beyond the core (--debug's windows, the benchmark, the report), then one marked line,
   then the plumbing with the guards; each GPT script's docstring keys its own family's tags
   alone, every one of them, and says in one line where the other tags come from (controls: an
   unkeyed number and an inherited row are caught); it has a Terms paragraph and one See also
   line, and no other comment, docstring or help string names a docs page or another chapter
   (a control: planted names are found);
   chapter 3's words name none of the later chapters' machinery (a control: a planted comment
   is caught); no GPT script is longer, its docstring's key aside,
   than it was before the key (1,202 / 1,314 / 1,384 / 1,550 / 1,438), but for the lines SIZE
   names (chapter 10's ring among them); no attribute is hung on the argparse namespace;
6. the LM's training loop holds no fault switch (faults are injected from tests/, by a probe);
7. the twins' lessons: the lesson section (main(), its steps and the steps beyond the core, up to
   the marked line; the model aside, which the whole-file budgets count) of chapter 7 differs from
   chapter 3's by at most 229 lines (the meta-device build, DCP checkpoints, the export), chapter
   8's from chapter 7's by at most 216 (the mesh, the TP plan, the norm), chapter 9's from chapter
   7's by at most 249 (the stage, the schedule, the tied weight, forward-only pipelines, the
   interleaved stages), chapter
   10's from chapter 7's by at most 265 (the mesh, the split, the gather, the ring), chapter 11's
   from chapter 9's by at most 289 (the 4-D mesh, TP's plans, CP's Context, the norm); the whole
   files, past their docstrings, by at most 628, 304, 510, 390 and 519 lines (the plumbing stays
   shared, but for chapters 8, 10 and 11's warnings of a group across nodes, --grad-sync, and the
   sweep's refusals of bad input: chapter 3's number rules, which chapter 7 has before it,
   run.json's checks, chapters 10 and 11's context beyond the data);
8. every block of code a twin adds or changes holds its tag (`# FSDP k`, k = 1..8; `# TP k`,
   1..8; `# PP k`, 1..8; `# CP k`, 1..7; `# 4D k`, 1..10; in reading order) on one of its lines,
   the line that makes the call; a block that only rewords comments is words, not code (the
   control: an untagged line of code is caught, a reworded comment is not); the README's chapter
   has a row (F1.., T1.., P1.., C1.., D1..) for each.
The README's count of each twin's changed lines is lesson_diff's count now.
"""
import ast
import difflib
import io
import re
import tokenize

import pytest
from helpers import REPO

TAG = re.compile(r"# DDP (\d+)\b")
PLUMBING = re.compile(r"^# =+ the plumbing$")
SCRIPTS = ["train_single_gpu.py", "train_ddp_basic.py", "train_ddp_minigpt.py",
           "train_fsdp_minigpt.py", "train_tp_minigpt.py", "train_pp_minigpt.py",
           "train_cp_minigpt.py", "train_4d_minigpt.py", "train_moe_minigpt.py"]
CHANGES = 9  # chapter 2's
LM_CHANGES = 16  # chapter 3's, in its own reading order
FSDP_TAG, FSDP_CHANGES = re.compile(r"# FSDP (\d+)\b"), 8
TP_TAG, TP_CHANGES = re.compile(r"# TP (\d+)\b"), 8
PP_TAG, PP_CHANGES = re.compile(r"# PP (\d+)\b"), 8
CP_TAG, CP_CHANGES = re.compile(r"# CP (\d+)\b"), 7
FOURD_TAG, FOURD_CHANGES = re.compile(r"# 4D (\d+)\b"), 10
EP_TAG, EP_CHANGES = re.compile(r"# EP (\d+)\b"), 8
SIZE = {"train_ddp_minigpt.py": 1351, "train_fsdp_minigpt.py": 1432 + 81 + 50,  # lines, at
        "train_tp_minigpt.py": 1598 + 81 + 50, "train_pp_minigpt.py": 1683 + 81 + 47,  # most,
        "train_cp_minigpt.py": 1687 + 81 + 50 + 2,  # besides the docstring's own key (how to
        "train_4d_minigpt.py": 1965 + 81 + 49, "train_moe_minigpt.py": 1798 + 81 + 51}  # read the
# file, and its tags): the sizes before the key; 5 each: another model refused; chapters 7-12:
# 81 each for a step saved under a partial name and renamed once complete, the one rule of a complete
# step, the removal that takes .metadata first, and a run that writes only into its own --save
# (checked before training, and not for a --benchmark, which writes nothing); 18 more for the
# trainer's own folders, numbered as numbers, a partial folder never resumed, a step of --save
# resumed by name held to its seed, and a step past --max-steps refused; 47 to 51 each for chapter 3's reader of a one-file checkpoint (its
# form, its config, each weight's shape, its vocabulary), which --sample shares with chapter 3;
# chapters 7-12, every bad input in one line: 10 each for the number rules (chapter 3's positive(),
# --compile-backend's choices, --dist-timeout and --seed in range, the seed folded into 64 bits),
# and 3 more in chapter 12 for a capacity above its experts; chapter 12: 12 for --ep refused once
# from rank 0 before the group (13 for the guard, less the 3 of grid's check; 2 for expert
# parallelism without experts); chapters 7-12: 48 each for run.json read key by key (27), --sample's
# config held against its weights (12) and DCP's tracebacks kept out of the log (9), and 4 more in
# chapter 12 for a checkpoint's mixture that cannot be; chapters 10 and 11: 16 for a --block-size
# beyond the data refused before the context is made; chapter 10: 2 for the split line counting
# what a block sends (K, V twice and their gradients)
# chapter 10: 1,438, a line for its global-count loss, 11 for its guard for cp across nodes, 1 for
# the masks it builds before compile traces it, 2 for the last block kept whole (as in 7-9), 127
# for --cp-rotate ring (the ring's autograd function, its pass, its tiles of attention), 3 for the
# torch it needs, 1 for FSDP over the grid's two dims flattened, 2 for the split line counting
# what a block sends (K, V twice and their gradients, on the ring too);
# chapter 8: 11 for its guard for tp across nodes (and 2 for the last block, as chapter 7's), 9: 2;
# chapters 7, 8 and 10: 18, 16 and 18 for --grad-sync (accumulate sharded, or whole: its flag, its
# line of what it holds and sends); chapter 8: 30 for --check-sync over a tp row's copies, 9 for
# its flattened mesh, the export's scoped warning and recomputation's all-reduces counted;
# chapters 7 and 10: 1 for random streams restored only at the layout that saved them;
# chapter 11: 12 for a mesh the world cannot hold refused before the group, 3 for the stages'
# extra blocks on the later stages (9 too), 4 for the node guard naming what crosses, -6 in grid();
# chapters 10 and 11: 4 for CP's checkpoint left off where the block is recomputed whole; chapters
# 9 and 11: 2 for the words that the schedule holds whole gradients through a step, 2 for the
# help of --reshard-after-forward saying what it frees under the schedule; chapter 11: 7 for
# --pp 1 without a schedule (each micro-batch reduce-scattered, as chapter 7's --grad-sync every);
# chapter 8: 84 for sequence parallelism and loss parallel (the two plans, the dropout stream,
# sampling from logits split by vocabulary, the traffic line's two forms, the flag and its guard);
# chapter 7: 10 for its Terms paragraph, 2 for its debug guard's and --reshard's words (the
# other chapters' Terms stand after their reading order, which this count leaves out);
# chapter 12: 1,637 at its first version (chapter 7's 1,369 with the mixture of experts: router,
# balance loss, all-to-all dispatch, 135 lines; the mesh, the norm, the flags, the log);
# chapter 11: 1,788 at its first version (chapter 9's 1,552 with chapter 8's plans and chapter 10's
# Context and gather, without the ring);
# chapter 3: 10 for the numbers refused as the flags are read (a finite positive(), the ranges of
# --dist-timeout and --seed, the compile backends, a seed past 32 bits folded into 64), 105 for
# one reader of a checkpoint that checks every key and type a resume or --sample reads, 29 for a
# --save that rank 0 could not write, refused before the group is joined


def lines(name):
    return (REPO / name).read_text().splitlines()


def changed_blocks(parent="train_single_gpu.py", child="train_ddp_basic.py"):
    """[(first line number, [lines])] of every block the child script adds or changes, and the
    count of changed lines on both sides of the diff."""
    single, ddp = lines(parent), lines(child)
    blocks, count = [], 0
    matcher = difflib.SequenceMatcher(None, single, ddp, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            count += (i2 - i1) + (j2 - j1)
            if j2 > j1:
                blocks.append((j1 + 1, ddp[j1:j2]))
    return blocks, count


def test_the_chapter_2_diff_is_small_and_leaves_the_shared_lines_alone():
    _, count = changed_blocks()
    assert count <= 61, f"{count} changed lines"  # 54, then 7 for the Terms and the wrap's why
    assert len(lines("train_ddp_basic.py")) - count > 250  # most of the trainer is shared


def test_every_ddp_block_opens_with_its_tag_and_the_readme_has_every_row():
    docstring_end = lines("train_ddp_basic.py").index('"""', 1)
    untagged = [f"line {start}: {block[0]}" for start, block in changed_blocks()[0]
                if start > docstring_end + 1 and not TAG.search(next(x for x in block if x.strip()))]
    assert not untagged, "DDP blocks without a tag on their first line:\n" + "\n".join(untagged)
    numbers = {int(k) for line in lines("train_ddp_basic.py") for k in TAG.findall(line)}
    assert numbers == set(range(1, CHANGES + 1))
    readme = (REPO / "README.md").read_text()
    for k in range(1, CHANGES + 1):
        assert re.search(rf"^\| {k} \|", readme, re.M), f"README's table of changes has no row {k}"


def test_the_lm_trainer_numbers_its_ddp_lines_and_the_readme_has_every_row():
    numbers = {int(k) for line in lines("train_ddp_minigpt.py") for k in TAG.findall(line)}
    assert numbers == set(range(1, LM_CHANGES + 1)), sorted(numbers)
    section = (REPO / "README.md").read_text().split("## Chapter 3")[1].split("## Chapter 4")[0]
    for k in range(1, LM_CHANGES + 1):  # two rows of the table to a line
        assert re.search(rf"^.*\| {k} \| [^|]+\|", section, re.M), f"chapter 3 has no row {k}"
    for name in SCRIPTS[2:]:
        code = lines(name)[lines(name).index('"""', 1):]  # after the docstring's commands
        unnumbered = [line.strip() for line in code
                      if re.search(r"# (DDP|FSDP|TP|PP|CP|4D|EP)(:|$| [^\d])", line)]
        assert not unnumbered, f"{name}: tags without a number: {unnumbered}"
        assert "reading order" in (REPO / name).read_text().split('"""')[1], name


def test_no_long_line_no_wide_function_and_main_before_the_steps():
    for name in SCRIPTS:
        long = [f"{name}:{i}" for i, line in enumerate(lines(name), 1) if len(line) > 100]
        assert not long, f"lines over 100 characters: {long}"
        tree = ast.parse((REPO / name).read_text())
        wide = [f"{n.name} ({len(n.args.args) - (n.args.args[0].arg == 'self')})"
                for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                and len(n.args.args) + len(n.args.kwonlyargs) - (
                    bool(n.args.args) and n.args.args[0].arg == "self") > 6]
        assert not wide, f"{name}: functions of more than 6 parameters: {wide}"
    for name in SCRIPTS[:2]:  # the classifiers: main() before the steps it calls
        where = {n.name: n.lineno for n in ast.parse((REPO / name).read_text()).body
                 if isinstance(n, ast.FunctionDef)}
        assert where["main"] < min(where[s] for s in ("train_one_epoch", "evaluate", "save_once"))


SECTIONS = [re.compile(r"^# -+ the distributed lesson: main\(\)"), re.compile(r"^# -+ the model: "),
            re.compile(r"^# -+ beyond the core: "), PLUMBING]
CORE = ["init_distributed", "make_run", "build_data", "build_model", "resumed_step", "wrap_model",
        "evaluate", "train_step", "save_checkpoint", "leave_distributed"]  # main()'s, in order
BEYOND = ["log_windows", "benchmark", "report", "log_peak_gpu_memory"]  # debugging, reports


def section_lines(name):
    """The first line of each section (lesson, model, beyond the core, plumbing), 1-based."""
    text = lines(name)
    found = [[i for i, line in enumerate(text, 1) if s.match(line)] for s in SECTIONS]
    assert all(len(f) == 1 for f in found), f"{name}: section marks {found}"
    return [f[0] for f in found]


def top_level(name):
    """{name: first line} of the script's top-level functions and classes."""
    tree = ast.parse((REPO / name).read_text())
    return {n.name: (n.decorator_list[0] if n.decorator_list else n).lineno for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def main_calls(name):
    """The script's own functions main() calls, in the order it first calls them."""
    tree, where = ast.parse((REPO / name).read_text()), top_level(name)
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    calls = sorted((c.lineno, c.col_offset, c.func.id) for c in ast.walk(main) if
                   isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in where)
    return list(dict.fromkeys(name for _, _, name in calls))


@pytest.mark.parametrize("name", SCRIPTS[2:])
def test_the_lm_trainers_read_top_down(name):
    """main() first; its core steps in the order it calls them, each helper below its first
    caller; the model; the steps beyond the core; the plumbing."""
    lesson, model, beyond, plumbing = section_lines(name)
    where = top_level(name)
    assert where["main"] == lesson + 1 == min(where.values()), f"{name}: main() is not first"
    assert model < where["GPT"] < beyond, f"{name}: the model is not in its section"
    core = [s for s in CORE if s in main_calls(name)] + ["leave_distributed"]  # __main__ calls it
    assert core == CORE, f"{name}: main() calls {core}"
    assert [where[s] for s in CORE] == sorted(where[s] for s in CORE), f"{name}: core out of order"
    assert all(lesson < where[s] < model for s in CORE), f"{name}: a core step outside the core"
    assert all(beyond < where[s] < plumbing for s in BEYOND), f"{name}: {BEYOND} not together"
    assert plumbing < where["parse_args"] and plumbing < where["avoid_known_failures"]
    doc = lines(name)[:lines(name).index('"""', 1)]
    key = len(doc) - next(i for i, line in enumerate(doc) if line.startswith("Read it top-down"))
    assert len(lines(name)) - key <= SIZE[name], f"{name} grew to {len(lines(name))} lines"
    tree = ast.parse((REPO / name).read_text())
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for helper, line in where.items():  # the core reads in call order: no step used before
        if lesson < line < model and helper not in ("main", "leave_distributed"):
            after = min((w for w in where.values() if w > line), default=line)  # a record
            users = [n for n, node in defs.items() if (where[n] < line or where[n] == after
                     and isinstance(defs[helper], ast.ClassDef)) and helper in
                     {x.id for x in ast.walk(node) if isinstance(x, ast.Name)}]  # (Run, Data)
            assert users, f"{name}: {helper} stands above every function that uses it"
    hung = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "args"]
    assert not hung, f"{name}: attributes hung on the argparse namespace: {hung}"


OWN = {"train_ddp_minigpt.py": "DDP", "train_fsdp_minigpt.py": "FSDP", "train_tp_minigpt.py": "TP",
       "train_pp_minigpt.py": "PP", "train_cp_minigpt.py": "CP", "train_4d_minigpt.py": "4D",
       "train_moe_minigpt.py": "EP"}
KEY_ROW = re.compile(r"^ {2}(DDP|FSDP|TP|PP|CP|4D|EP) (\d+) +\S", re.M)


def key_problems(name, source):
    """What is wrong with a script's key: its own tags unkeyed or keyed but unused, another
    family's tags keyed, or no line saying where the other tags come from."""
    own, doc = OWN[name], ast.get_docstring(ast.parse(source))
    used = set(re.findall(r"# (DDP|FSDP|TP|PP|CP|4D|EP) (\d+)\b", source))
    keyed = set(KEY_ROW.findall(doc))
    problems = [f"unkeyed {f} {k}" for f, k in sorted(used - keyed) if f == own]
    problems += [f"keyed but unused {f} {k}" for f, k in sorted(keyed - used)]
    problems += [f"keys another family's {f} {k}" for f, k in sorted(keyed) if f != own]
    others = {f for f, _ in used} - {own}
    if others and not re.search(r"tagged [^.]*\b(DDP|FSDP|PP)\b[^.]* chapters? \d", doc):
        problems.append(f"no line says where the {sorted(others)} tags come from")
    return problems


@pytest.mark.parametrize("name", SCRIPTS[2:])
def test_each_docstring_keys_its_own_tags_alone(name):
    """A file read alone explains its own family's tags, one row each, and says in one line where
    the other tags come from; it keys no other family (each of those says on its line what it
    does)."""
    source = (REPO / name).read_text()
    assert len(set(re.findall(rf"# {OWN[name]} (\d+)\b", source))) >= 7
    assert not key_problems(name, source), f"{name}: {key_problems(name, source)}"


def test_the_key_check_fails_on_an_unkeyed_tag_and_an_inherited_row():
    """The controls: a tag the docstring does not key, and a row of a parent's key, are caught."""
    source = (REPO / "train_fsdp_minigpt.py").read_text()
    assert not key_problems("train_fsdp_minigpt.py", source)
    unkeyed = source + "\nx = 1  # FSDP 99: planted\n"
    inherited = source.replace("  FSDP 1 ", "  DDP 1   planted\n  FSDP 1 ", 1)
    assert key_problems("train_fsdp_minigpt.py", unkeyed) == ["unkeyed FSDP 99"]
    assert "keys another family's DDP 1" in key_problems("train_fsdp_minigpt.py", inherited)


@pytest.mark.parametrize("name,family", [("train_ddp_basic.py", "DDP"),
                                         ("train_ddp_minigpt.py", "DDP"),
                                         ("train_fsdp_minigpt.py", "FSDP"),
                                         ("train_fsdp_minigpt.py", "DDP"),
                                         ("train_tp_minigpt.py", "TP"),
                                         ("train_tp_minigpt.py", "FSDP"),
                                         ("train_pp_minigpt.py", "PP"),
                                         ("train_pp_minigpt.py", "FSDP"),
                                         ("train_cp_minigpt.py", "CP"),
                                         ("train_cp_minigpt.py", "FSDP"),
                                         ("train_4d_minigpt.py", "4D"),
                                         ("train_4d_minigpt.py", "PP"),
                                         ("train_4d_minigpt.py", "FSDP"),
                                         ("train_tp_minigpt.py", "DDP"),
                                         ("train_pp_minigpt.py", "DDP"),
                                         ("train_cp_minigpt.py", "DDP"),
                                         ("train_4d_minigpt.py", "DDP"),
                                         ("train_moe_minigpt.py", "EP"),
                                         ("train_moe_minigpt.py", "FSDP"),
                                         ("train_moe_minigpt.py", "DDP")])
def test_tags_first_appear_in_reading_order(name, family):
    seen = []
    for line in lines(name):
        if not line.startswith(("import ", "from ")):
            seen += [int(k) for k in re.findall(rf"# {family} (\d+)\b", line) if int(k) not in seen]
    assert seen == sorted(seen) and seen, f"{name}: {family} tags first appear as {seen}"


def code_part(line):
    """A line without its comment, its right end stripped (a line inside a string keeps all)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
        cut = next((t.start[1] for t in tokens if t.type == tokenize.COMMENT), None)
    except (tokenize.TokenError, IndentationError, SyntaxError):  # inside a string
        cut = None
    if cut is None:
        return line.rstrip()
    return line[:len(line) - len(line.lstrip()) + cut].rstrip()


def code_of_main(name):
    """main()'s lines with their comments taken off: [(code, the line as written)]. Each twin's
    comments say what its own chapter does; its code stays the parent's."""
    source = (REPO / name).read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)
                and n.name == "main")
    text = source.splitlines()[node.lineno - 1:node.end_lineno]
    return [(code_part(line), line) for line in text if code_part(line).strip()]


def test_main_runs_the_same_code_in_the_twins():
    """The twins' main() run the same steps in the same order (but for chapter 3's --check-sync
    and chapter 9's schedule); only their comments differ, each saying what its chapter does."""
    def code(name):
        return [c for c, _ in code_of_main(name)]
    assert code_of_main("train_fsdp_minigpt.py") != [(c, c) for c in code("train_fsdp_minigpt.py")]
    check_sync = [line for line in code("train_ddp_minigpt.py") if "check_" not in line]
    assert check_sync == code("train_fsdp_minigpt.py") == code("train_tp_minigpt.py") \
        == code("train_cp_minigpt.py") == code("train_moe_minigpt.py")
    assert code("train_4d_minigpt.py") == code("train_pp_minigpt.py")  # chapter 11: chapter 9's
    extra = [raw for c, raw in code_of_main("train_pp_minigpt.py")
             if c not in code("train_fsdp_minigpt.py")]
    assert len(extra) == 3 and all("# PP 1" in line for line in extra), extra  # the schedule


def test_the_lm_training_loop_has_no_fault_switch():
    source = (REPO / "train_ddp_minigpt.py").read_text()
    for switch in ("os._exit", "time.sleep", "DDP_FAIL", "TORCHELASTIC_RESTART_COUNT"):
        assert switch not in source, switch


STRING = re.compile(r"""(?:\b[rbfuRBFU]{1,2})?("([^"\\]|\\.)*"|'([^'\\]|\\.)*')""")


def without_comments(block):
    """A block's code as one string, with its comments and the text of its strings (help,
    messages) taken off, strings in a row as one: a change there is words, not code."""
    code = [STRING.sub('""', code_part(line)).strip() for line in block]
    return re.sub(r'(?:"")+', '""', "".join(code))


def past_the_docstring(parent, child):
    """How many lines differ between two scripts, the module docstrings left out."""
    old, new = lines(parent), lines(child)
    old, new = old[old.index('"""', 1) + 1:], new[new.index('"""', 1) + 1:]
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    return sum((i2 - i1) + (j2 - j1) for op, i1, i2, j1, j2 in matcher.get_opcodes()
               if op != "equal")


def docstrings_blanked(text):
    """The script's lines with every docstring's lines left empty: docstrings are words."""
    text = list(text)
    for node in ast.walk(ast.parse("\n".join(text))):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body and \
                isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            for i in range(node.body[0].lineno - 1, node.body[0].end_lineno):
                text[i] = ""
    return text


def untagged_blocks(parent, child, tag, child_lines=None):
    """The blocks past the docstring where the child changes the parent's code (not only its
    comments or docstrings) and no line of the block carries the child's tag."""
    old, new = lines(parent), child_lines or lines(child)
    bare_old, bare_new = docstrings_blanked(old), docstrings_blanked(new)
    docstring_end = new.index('"""', 1)
    found = []
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        code = without_comments(bare_new[j1:j2])  # none: the child deletes, as before
        if op != "equal" and code and j1 > docstring_end and \
                without_comments(bare_old[i1:i2]) != code and \
                not any(tag.search(line) for line in new[j1:j2]):
            found.append(f"line {j1 + 1}: {new[j1]}")
    return found


def test_the_block_check_fails_on_untagged_code_and_passes_reworded_comments():
    """The control: a line of code a twin adds without its tag is caught; a reworded comment is
    not a change of code."""
    child = lines("train_fsdp_minigpt.py")
    assert not untagged_blocks("train_ddp_minigpt.py", "", FSDP_TAG, child)
    at = next(i for i, line in enumerate(child) if "def train_step(" in line) + 1
    planted = child[:at] + ["    torch.manual_seed(0)"] + child[at:]
    assert len(untagged_blocks("train_ddp_minigpt.py", "", FSDP_TAG, planted)) == 1
    at = next(i for i, line in enumerate(child) if line.lstrip().startswith("#") and i > at)
    reworded = child[:at] + [child[at].split("#")[0] + "# planted: a reworded comment"] + \
        child[at + 1:]
    assert not untagged_blocks("train_ddp_minigpt.py", "", FSDP_TAG, reworded)


@pytest.mark.parametrize("parent,child,tag,changes,limit,chapter,row", [
    # lines changed past the module docstrings (each keys its own family); chapter 7: most are
    # the meta build, DCP checkpoints and the export (449); 56 for chapter 7's refusals of bad
    # input that chapter 3 has not (run.json's checks, DCP's tracebacks); 61 for the partial step
    # renamed when complete and a run writing only into its own --save; 42 for chapter 3's own
    # checks that chapter 7 does otherwise (a resume's keys, --save before the group)
    ("train_ddp_minigpt.py", "train_fsdp_minigpt.py", FSDP_TAG, FSDP_CHANGES, 628, "7", "F"),
    # chapter 8: 98 for sequence parallelism and loss parallel, 5 for compile by block
    ("train_fsdp_minigpt.py", "train_tp_minigpt.py", TP_TAG, TP_CHANGES, 304, "8", "T"),
    ("train_fsdp_minigpt.py", "train_pp_minigpt.py", PP_TAG, PP_CHANGES, 510, "9", "P"),
    # chapter 10: 127 for the ring (--cp-rotate ring), 3 for the torch it needs, 3 for FSDP, 16
    # for a --block-size beyond the data refused before the context is made, 2 for the split line
    # counting what a block sends (K, V twice and their gradients)
    ("train_fsdp_minigpt.py", "train_cp_minigpt.py", CP_TAG, CP_CHANGES, 388 + 2, "10", "C"),
    # chapter 11 against chapter 9: the mesh, TP's plans, CP's Context, the norm, the flags; 16
    # for a --block-size beyond the data refused before the context is made
    ("train_pp_minigpt.py", "train_4d_minigpt.py", FOURD_TAG, FOURD_CHANGES, 519, "11", "D"),
    # chapter 12 against chapter 7: the mesh, the mixture (router, balance loss, all-to-alls), the
    # norm over two meshes, the experts' flags and log; 3 for a capacity above the experts, 12 for
    # --ep refused once from rank 0 before the group and without experts, 4 for a mixture that
    # cannot be in a checkpoint
    ("train_fsdp_minigpt.py", "train_moe_minigpt.py", EP_TAG, EP_CHANGES, 391, "12", "E")])
def test_every_changed_block_holds_its_tag_and_the_readme_has_every_row(
        parent, child, tag, changes, limit, chapter, row):
    count = past_the_docstring(parent, child)  # each docstring keys its own family
    assert count <= limit, f"{child}: {count} changed lines"
    untagged = untagged_blocks(parent, child, tag)
    assert not untagged, f"{child}: changed code without its tag:\n" + "\n".join(untagged)
    numbers = {int(k) for line in lines(child) for k in tag.findall(line)}
    assert numbers == set(range(1, changes + 1))
    section = (REPO / "README.md").read_text().split(f"## Chapter {chapter}")[1]
    for k in range(1, changes + 1):
        assert re.search(rf"^\| {row}{k} \|", section, re.M), f"chapter {chapter} has no row {row}{k}"


@pytest.mark.parametrize("parent,child,limit", [
    ("train_ddp_minigpt.py", "train_fsdp_minigpt.py", 224 + 5),  # 200; 1: streams by layout;
    # 23: words; 5: a step saved under a partial name, renamed once complete
    ("train_fsdp_minigpt.py", "train_tp_minigpt.py", 216),  # 114; 76: SP, loss parallel; 5: compile;
    # 6: words the first-time readers asked for
    ("train_fsdp_minigpt.py", "train_pp_minigpt.py", 249),  # 200; 4: --grad-sync, RNG; 24: words
    # 18: the interleaved schedule (a PipelineStage per stage, RankStages, the forward's hops)
    ("train_fsdp_minigpt.py", "train_cp_minigpt.py", 265),  # 120, 125: the ring, 1: FSDP, 2: RNG,
    # 2: the names of its two collectives
    # chapter 11: 251, then 22 for words and for layout_line and stream_shape, moved up beside
    # the core that calls them; 2: the names of its two collectives; 7: --pp 1 without a schedule
    ("train_pp_minigpt.py", "train_4d_minigpt.py", 289),
    ("train_fsdp_minigpt.py", "train_moe_minigpt.py", 86)])  # 86: with capacity and export
def test_each_twins_lesson_section_differs_from_its_parents_within_budget(parent, child, limit):
    count = lesson_diff(parent, child)
    assert 0 < count <= limit, f"{child}: {count} changed lines in the lesson section"


def lesson_diff(parent, child):
    """The lines removed and added between two scripts' lesson sections (main() and its steps, up
    to the plumbing's marker, the model aside)."""
    def lesson(name):
        lesson, model, beyond, plumbing = section_lines(name)
        text = lines(name)
        return text[lesson - 1:model - 1] + text[beyond - 1:plumbing - 1]
    matcher = difflib.SequenceMatcher(None, lesson(parent), lesson(child), autojunk=False)
    return sum((i2 - i1) + (j2 - j1) for tag, i1, i2, j1, j2 in matcher.get_opcodes()
               if tag != "equal")


def test_the_readme_says_how_many_lines_each_lesson_differs_by():
    """Each chapter's "Its lesson differs from chapter N's by K lines" in the README is the count
    lesson_diff makes now. The control: every chapter's sentence is found (six)."""
    said = []
    for section in (REPO / "README.md").read_text().split("\n## Chapter ")[1:]:
        found = re.search(r"Its lesson differs from (?:chapter )?(\d+)'s by (\d+) lines",
                          " ".join(section.split()))
        said += [(section.split()[0].rstrip(":"), *found.groups())] if found else []
    scripts = {3: "train_ddp_minigpt.py", 7: "train_fsdp_minigpt.py", 8: "train_tp_minigpt.py",
               9: "train_pp_minigpt.py", 10: "train_cp_minigpt.py", 11: "train_4d_minigpt.py",
               12: "train_moe_minigpt.py"}
    assert [int(c) for c, _, _ in said] == [7, 8, 9, 10, 11, 12], said
    for chapter, parent, count in said:
        assert int(count) == lesson_diff(scripts[int(parent)], scripts[int(chapter)]), chapter


def prose(source):
    """[(line, text)] of a script's comments, docstrings and argparse help strings: its words."""
    found = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body and \
                isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            first = node.body[0].lineno
            found += [(first + i, text) for i, text in
                      enumerate(str(node.body[0].value.value).splitlines())]
        if isinstance(node, ast.Call):
            found += [(k.value.lineno, ast.unparse(k.value)) for k in node.keywords
                      if k.arg == "help"]
    return sorted(found)


OTHER_MACHINERY = re.compile(r"fsdp|shard|dtensor|meta device|tensor parallel|pipelin|"
                             r"context parallel", re.I)


def test_chapter_3_speaks_only_of_what_it_runs():
    """Chapter 3 runs DDP: its comments, docstrings and help strings name none of the later
    chapters' machinery (a control: a planted comment is found)."""
    source = (REPO / "train_ddp_minigpt.py").read_text()
    named = [f"line {n}: {text.strip()}" for n, text in prose(source)
             if OTHER_MACHINERY.search(text)]
    assert not named, "chapter 3 speaks of what it does not run:\n" + "\n".join(named)
    planted = source + "\nx = 1  # the model, sharded\n"
    assert [text for _, text in prose(planted) if OTHER_MACHINERY.search(text)] == [
        "# the model, sharded"]


def other_pages_and_chapters(source):
    """The lines of a script's words, outside its See also line, that name a docs page or a
    chapter other than its own (the key's line of where inherited tags come from aside)."""
    doc, words = ast.get_docstring(ast.parse(source)), prose(source)
    see_also = next(n for n, text in words if text.startswith("See also"))
    own = re.match(r"Chapter (\d+)", doc).group(1)
    return [f"line {n}: {text.strip()}" for n, text in words if n != see_also and (
        re.search(r"docs/|\.md\b", text) or set(re.findall(r"\bchapters?[ -](\d+)", text, re.I))
        - {own} and not re.search(r"\btagged\b", text))]


@pytest.mark.parametrize("name", SCRIPTS[2:])
def test_each_chapter_defines_its_terms_and_names_no_other_page(name):
    """Each GPT chapter's docstring has a Terms paragraph and one "See also" line; no other
    comment, docstring or help string names a docs page, and only the key's line of where the
    inherited tags come from names another chapter."""
    source = (REPO / name).read_text()
    doc = ast.get_docstring(ast.parse(source))
    assert re.search(r"^Terms\b", doc, re.M), f"{name}: no Terms paragraph"
    assert len(re.findall(r"^See also\b", doc, re.M)) == 1, f"{name}: one See also line"
    named = other_pages_and_chapters(source)
    assert not named, f"{name} names a page or another chapter:\n" + "\n".join(named)


def test_the_page_and_chapter_check_finds_a_planted_name():
    """The control: a comment naming a docs page, or another chapter, is found; its own is not."""
    source = (REPO / "train_cp_minigpt.py").read_text()
    assert not other_pages_and_chapters(source)
    for planted in ("# see docs/fsdp.md", "# as chapter 7 does", "# as in chapter-9"):
        assert len(other_pages_and_chapters(source + f"\nx = 1  {planted}\n")) == 1, planted
    assert not other_pages_and_chapters(source + "\nx = 1  # this chapter 10 alone\n")
