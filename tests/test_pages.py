"""The copy pages of chapters 7-11 hold their chapter's pieces as they stand and train what one
process trains. For each of docs/fsdp_in_your_trainer.md, docs/tp_in_your_trainer.md,
docs/pp_in_your_trainer.md and docs/4d_in_your_trainer.md these tests prove that

1. the page holds each piece it names as the chapter's script holds it (a piece that names the
   script's block insides, "attn.qkv" say, with those names alone replaced by the page model's),
   its diff block is the real diff between its one-process trainer and its parallel trainer,
   every page's one-process trainer is the same file, and the parallel trainer is at most 250
   lines (the page's Python at most 500; the 4-D page keeps its pieces in a file of their own,
   which its trainer imports);
2. copied afresh out of the script into the page's parallel trainer, the pieces run under
   torchrun at the page's layouts, and each layout logs the one-process trainer's losses, gradient
   norms and validation loss (every printed digit; the clip of 1.0 binds in every step, so the
   norms' scale matters), and rank 0 saves the one-process trainer's final weights, gathered whole
   (to 1e-5; the control: they moved by more than 0.1 from their start, so a run that does not
   train, or trains another model, fails);
3. FSDP's checkpoint of step 8, written by 2 processes, resumes at 1 process (with the gradients
   reduce-scattered once a step, `last`) with the uninterrupted run's losses and weights; watched
   from outside the trainer, each of the 2 ranks trains on its own 4 of the 8 rows (the control:
   one process, all 8), each block is an FSDP unit, and only rank 0 receives the exported weights;
4. the 4-D page's trainer, its sizes line changed to pp 2 x dp 2, also trains one process's model
   (its loss scaled by dp x cp, the ranks FSDP averages over);
5. the lines the 4-D page changes for a head of its own apply to the pieces as the script has them,
   and with an untied model (in a world of one) put the head's gradient in the last stage's norm and
   keep the head apart at PP 1, where the pieces and `shard` as they stand leave it out and tie it.

The launches of the pages whose tests run start at once in one module fixture, side by side, while
the one-process trainer runs in this process.
"""
import ast
import difflib
import io
import re
import runpy
import sys
import tokenize
from types import SimpleNamespace

import pytest
import torch
from helpers import NEEDS_CP, NEEDS_PP, REPO, command, finish, needs_torch, ok, one_process_group
from helpers import run_single, start
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

PAGES = {  # name: (the chapter's script, the pieces the page copies as they stand)
    "fsdp": ("train_fsdp_minigpt.py",
             ["init_distributed", "accumulate_gradients", "mean_over_ranks",
              "mean_loss_over_ranks", "free_gathered_weights", "save_on_rank_0",
              "leave_distributed"]),
    "tp": ("train_tp_minigpt.py",
           ["block_plan", "ends_plan", "accumulate_gradients", "local", "clip_gradients",
            "mean_loss_over_ranks", "free_gathered_weights", "mean_over_ranks"]),
    "pp": ("train_pp_minigpt.py",
           ["Stage", "stage_blocks", "mean_token_loss", "ends_group", "sum_tied_gradients",
            "clip_gradients"]),
    "4d": ("train_4d_minigpt.py",
           ["init_distributed", "Context", "chunk_positions", "GatherContext", "causal_attention",
            "block_plan", "ends_plan", "Stage", "stage_blocks", "ends_group", "sum_tied_gradients",
            "clip_gradients", "local"]),
}
MODULES = {"4d": "pieces_4d.py"}  # a page whose pieces are a file of their own, which it imports
LAYOUTS = {  # a launch's name: (its page, processes)
    "fsdp": ("fsdp", 2),  # through WATCH_FSDP
    "tp": ("tp", 2),  # dp 1 x tp 2
    "dp_tp": ("tp", 4),  # dp 2 x tp 2
    "pp": ("pp", 2),  # pp 2
    "dp_pp": ("pp", 4),  # dp 2 x pp 2
    "4d": ("4d", 8),  # pp 2 x dp 1 x cp 2 x tp 2
    "4d_dp": ("4d", 4),  # pp 2 x dp 2 x cp 1 x tp 1: its sizes line as RESIZED says
}
RESIZED = {"4d_dp": ("PP, CP, TP, MICRO = 2, 2, 2, 2", "PP, CP, TP, MICRO = 2, 1, 1, 2")}
# The course's names inside a block, and the page model's, for the pieces that name them.
RENAMED = {"ln1": "norm1", "ln2": "norm2", "attn.qkv": "attention.to_qkv",
           "attn.proj": "attention.to_out", "attn": "attention", "mlp.0": "feed_forward.up",
           "mlp.2": "feed_forward.down", "mlp": "feed_forward"}
FOUND = r"step (\d+)/\d+ \| loss (\d+\.\d+) \| norm (\d+\.\d+)"
# Runs the FSDP page's main() with three of its calls watched, each rank telling stderr what it saw:
# the rows each step's micro-batches hold, the FSDP units built, the entries the export gathered.
WATCH_FSDP = """import runpy
import sys
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
g = runpy.run_path("my_gpt_fsdp.py")["main"].__globals__
def watch(name, said):
    real = g[name]
    def watched(*args, **kwargs):
        out = real(*args, **kwargs)
        sys.stderr.write(f"rank {dist.get_rank()} {said(args, out)}\\n")  # one write: whole lines
        return out
    g[name] = watched
watch("accumulate_gradients", lambda args, out: f"rows {sum(len(x) for x, _ in args[1])}")
watch("build_sharded", lambda args, out: "units %d" % sum(
    isinstance(m, FSDPModule) for m in out.modules()))
watch("get_model_state_dict", lambda args, out: f"gathered {len(out)}")
try:
    g["main"]()
finally:
    g["leave_distributed"]()
"""


def page(name):
    return REPO / "docs" / f"{name}_in_your_trainer.md"


def blocks(name):
    """The page's one-process trainer, its parallel trainer, its diff block and the file of the
    pieces (None where the trainer holds them), as text."""
    found = re.findall(r"^```(?:python|diff)\n(.*?)^```", page(name).read_text(), re.M | re.S)
    if name in MODULES:  # the one-process trainer, the pieces' file, the trainer, the diff (and
        assert len(found) == 5, (name, len(found))  # the untied head's lines, untied_head())
        return found[0], found[2], found[3], found[1]
    assert len(found) == 3, (name, len(found))
    return (*found, None)


def pieces(name, rename=True):
    """{piece: source} cut out of the page's script from the first decorator or the def or class
    line, with the course's quoted block names replaced by the page model's (rename)."""
    script, names = PAGES[name]
    source = (REPO / script).read_text()
    lines, found = source.splitlines(), {}
    for n in ast.parse(source).body:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names:
            first = min([n.lineno, *(d.lineno for d in n.decorator_list)]) - 1
            text = "\n".join(lines[first:n.end_lineno])
            found[n.name] = renamed(text) if rename else text
    return found


def renamed(text):
    """The quoted module names of the course's block ("attn.qkv") as the page model names them."""
    return re.sub(r'"(ln1|ln2|attn\.qkv|attn\.proj|attn|mlp\.0|mlp\.2|mlp)"',
                  lambda m: f'"{RENAMED[m.group(1)]}"', text)


def tokens(source):
    """The Python tokens of source, comments included, without its line breaks and indentation."""
    skip = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    return [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type not in skip]


def fresh(name):
    """{file name: text}: the page's parallel trainer, and the file of its pieces if it has one,
    with each piece copied afresh out of the script in its place."""
    _, parallel, _, module = blocks(name)
    text = module or parallel
    for piece, source in pieces(name).items():
        start_, end = piece_span(text, piece)
        text = text[:start_] + source + text[end:]
    if module is None:
        return {f"my_gpt_{name}.py": text}
    return {f"my_gpt_{name}.py": parallel, MODULES[name]: text}


def piece_span(text, piece):
    """Where the page's copy of a piece starts and ends: from its def or class line (or the
    decorator above it) to the next top-level line that is not blank."""
    match = re.search(rf"^(@.*\n)*(def|class) {piece}\b", text, re.M)
    assert match, piece
    end = re.compile(r"^\S", re.M).search(text, match.end())
    stop = end.start() if end else len(text)
    return match.start(), match.start() + len(text[match.start():stop].rstrip("\n"))


def untied_head():
    """The 4-D page's pieces file and trainer, copied afresh, with the lines its section "A head of
    its own" changes changed: {file name: text}. Each hunk's lines must stand there exactly once."""
    files = fresh("4d")
    shown = re.findall(r"^```diff\n(.*?)^```", page("4d").read_text(), re.M | re.S)[-1]
    for part in re.split(r"^--- ", shown, flags=re.M)[1:]:
        file = part.split("\n", 1)[0]
        for hunk in re.split(r"^@@.*\n", part, flags=re.M)[1:]:
            lines = hunk.splitlines()
            old = "".join(line[1:] + "\n" for line in lines if line.startswith("-"))
            new = "".join(line[1:] + "\n" for line in lines if line.startswith("+"))
            assert files[file].count(old) == 1, f"{file} does not hold, once:\n{old}"
            files[file] = files[file].replace(old, new)
    return files


@pytest.mark.parametrize("name", PAGES)
def test_the_page_holds_the_scripts_pieces_as_they_stand(name):
    single, parallel, diff, module = blocks(name)
    assert sorted(pieces(name)) == sorted(PAGES[name][1])
    raw = pieces(name, rename=False)
    for piece, source in pieces(name).items():
        start_, end = piece_span(module or parallel, piece)
        mine = (module or parallel)[start_:end]
        # A piece whose names the page changed may also rewrap its lines to fit 100 characters.
        rewrapped = source != raw[piece] and tokens(mine) == tokens(source)
        assert mine == source or rewrapped, f"{page(name).name} lost {piece} as the script has it"
    real = difflib.unified_diff(single.splitlines(), parallel.splitlines(), "my_gpt_single.py",
                                f"my_gpt_{name}.py", n=1, lineterm="")
    assert diff.rstrip("\n") == "\n".join(real)
    assert len(parallel.splitlines()) <= 250
    assert len((single + (module or "") + parallel).splitlines()) <= 500
    assert single == blocks("fsdp")[0]  # one trainer of one's own, for every page


def test_a_piece_that_differs_from_the_script_is_found():
    """The control of the test above: a piece changed by one character is not found."""
    parallel, source = blocks("fsdp")[1], pieces("fsdp")["mean_over_ranks"]
    assert source in parallel and source.replace("SUM", "MAX") not in parallel
    assert renamed('{"attn.qkv": 1, "mlp.2": 2, "ln1": 3}') == (
        '{"attention.to_qkv": 1, "feed_forward.down": 2, "norm1": 3}')
    plan = pieces("tp")["block_plan"]  # rewrapped on the page: the same tokens, not another plan
    assert tokens(plan.replace("),\n", "), ")) == tokens(plan)
    assert tokens(plan.replace("Shard(1)", "Shard(0)", 1)) != tokens(plan)


@needs_torch(*NEEDS_CP)
def test_the_4d_pages_untied_head_is_in_the_norm_and_stays_apart(tmp_path):
    """The lines the 4-D page changes for a head of its own, run in a world of one with an untied
    model: at the last of 2 stages the norm holds the head's gradient, and at PP 1 `shard` leaves
    the head its own matrix and values. The control: the pieces and `shard` as they stand, with
    the same untied model, leave the head out of the norm and tie it to the embedding."""
    mine = load_4d(tmp_path / "untied", untied_head())
    theirs = load_4d(tmp_path / "as_is", fresh("4d"))
    untied_gpt = mine["TinyGPT"]
    with one_process_group():
        mine["init_distributed"]("cpu", 60)
        (norm, squares), (norm_as_is, _) = (last_stage_norm(g, untied_gpt) for g in (mine, theirs))
        apart, apart_as_is = (head_at_pp_1(g, untied_gpt) for g in (mine, theirs))
    head = squares.pop("head.weight")
    assert head > 1e-4 * sum(squares.values())  # the head's gradient counts in the norm
    assert norm == pytest.approx(float(sum(squares.values()) + head) ** 0.5, rel=1e-5)
    assert norm_as_is == pytest.approx(float(sum(squares.values())) ** 0.5, rel=1e-5)  # left out
    assert apart == (False, True) and apart_as_is == (True, False)  # (tied, its own values)


def load_4d(folder, files):
    """The namespace of the page's trainer written into folder beside its pieces, which it imports
    from there (not its main())."""
    folder.mkdir()
    for file, text in files.items():
        (folder / file).write_text(text)
    sys.modules.pop("pieces_4d", None)  # another folder's pieces, imported before
    sys.path.insert(0, str(folder))
    try:
        return runpy.run_path(str(folder / "my_gpt_4d.py"))
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("pieces_4d", None)


def one_rank_run(g, stage):
    """A Run for `stage` on a mesh of one rank, and its Context (the whole sequence)."""
    mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=("pp", "dp", "cp", "tp"))
    context = g["Context"](mesh["cp"].get_group(), 0, 1, g["T"], torch.device("cpu"))
    return SimpleNamespace(mesh=mesh, stage=stage, tied=None), context


def last_stage_norm(g, gpt):
    """The norm that g's clip_gradients gives at the last of 2 stages (the head's), after one
    backward of g's loss, and each parameter's squared gradient norm, by name."""
    run, context = one_rank_run(g, stage=1)
    torch.manual_seed(0)
    stage = g["shard"](run, g["Stage"](gpt(), 1, 2, context))
    x, y = torch.randn(2, g["T"], g["WIDTH"]), torch.randint(0, g["VOCAB"], (2, g["T"]))
    with loss_parallel():
        g["share_of_loss"](stage(x), y, 1).backward()
    squares = {n: p.grad.full_tensor().norm() ** 2 for n, p in stage.named_parameters()}
    return g["clip_gradients"](run, stage, 1e9).item(), squares  # 1e9: nothing is clipped


def head_at_pp_1(g, gpt):
    """Whether g's shard leaves one stage's head tied to its embedding at PP 1, and whether the
    head keeps its own initial values."""
    run, context = one_rank_run(g, stage=0)
    torch.manual_seed(0)
    model = gpt()
    initial = model.head.weight.detach().clone()
    stage = g["shard"](run, g["Stage"](model, 0, 1, context))
    return stage.head.weight is stage.tok_emb.weight, torch.equal(stage.head.weight.full_tensor(),
                                                                  initial)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The layouts of every page whose test runs (`-k tp` starts only TP's), started side by side
    (each in a folder of its own, where its trainer writes parallel.pt and FSDP its checkpoint),
    and the one-process trainer's output and weights, run here meanwhile. Returns {launch:
    (folder, command, process)} and (output, weights)."""
    selected, launched = {item.name for item in request.session.items}, {}
    for launch, (name, nproc) in LAYOUTS.items():
        if f"test_the_{name}_page_trains_one_processs_model" not in selected:
            continue
        folder, files, script = tmp_path_factory.mktemp(launch), fresh(name), f"my_gpt_{name}.py"
        if launch in RESIZED:  # the trainer's sizes line, changed
            old, new = RESIZED[launch]
            assert old in files[script]
            files[script] = files[script].replace(old, new)
        if name == "fsdp":  # run through the wrapper that watches it
            files["watch.py"], script = WATCH_FSDP, "watch.py"
        for file, text in files.items():
            (folder / file).write_text(text)
        cmd = command(folder / script, nproc=nproc)
        launched[launch] = (folder, cmd, start(cmd, folder))
    alone = tmp_path_factory.mktemp("single")
    (alone / "my_gpt_single.py").write_text(blocks("fsdp")[0])
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(alone)  # it saves single.pt where it runs
        printed = run_single(alone / "my_gpt_single.py")
    torch.manual_seed(0)  # as the trainer seeds its model: the weights before the first step
    initial = runpy.run_path(str(alone / "my_gpt_single.py"))["TinyGPT"]().state_dict()
    weights = torch.load(alone / "single.pt", weights_only=True)
    assert max((weights[k] - v).abs().max() for k, v in initial.items()) > 0.1  # the control
    return launched, (printed, weights)


def assert_trains_one_processs_model(out, folder, single):
    """The launch logged the one-process losses, norms and validation loss and saved its weights."""
    printed, weights = single
    one, logged = re.findall(FOUND, printed), re.findall(FOUND, out)
    wrong = [(mine, theirs) for mine, theirs in zip(logged, one[-len(logged):]) if mine != theirs]
    assert len(one) == 16 and logged, (logged, one)
    assert not wrong, "step {}: loss {} | norm {}, one process's {} | {}".format(
        *wrong[0][0], *wrong[0][1][1:])  # the first step that differs
    assert re.findall(r"val loss (\d+\.\d+)", out) == re.findall(r"val loss (\d+\.\d+)", printed)
    assert all(float(norm) > 1.0 for _, _, norm in one)  # the clip binds: the scale matters
    mine = torch.load(folder / "parallel.pt", weights_only=True)
    assert sorted(mine) == sorted(weights)
    for key, value in weights.items():
        torch.testing.assert_close(mine[key], value, atol=1e-5, rtol=1e-4, msg=key)


def assert_launches_train_one_processs_model(runs, launches):
    """Each launch ended well, logged all 16 steps and trained the one-process trainer's model."""
    launched, single = runs
    for launch in launches:
        folder, cmd, proc = launched[launch]
        out = ok(finish(proc, cmd))
        assert len(re.findall(FOUND, out)) == 16, out
        assert_trains_one_processs_model(out, folder, single)


def test_the_fsdp_page_trains_one_processs_model(runs):
    launched, single = runs
    folder, cmd, proc = launched["fsdp"]
    result = finish(proc, cmd)
    out, seen = ok(result), result.stderr
    assert len(re.findall(FOUND, out)) == 16
    assert_trains_one_processs_model(out, folder, single)
    keys = len(single[1])
    for rank in (0, 1):  # its share, 4 of the 8 rows; 2 blocks and the root; rank 0 gets the file
        rows = re.findall(rf"^rank {rank} rows (\d+)$", seen, re.M)
        assert rows == ["4"] * 16, f"rank {rank}'s micro-batches held {sorted(set(rows))} rows"
        units = re.findall(rf"^rank {rank} units (\d+)$", seen, re.M)
        assert units == ["3"], f"rank {rank} built {units} FSDP units"
        gathered = re.findall(rf"^rank {rank} gathered (\d+)$", seen, re.M)
        assert gathered == [str(keys * (1 - rank))], f"rank {rank} received {gathered} weights"
    resume = command(folder / "watch.py", ["resume", "last"], nproc=1)
    result = finish(start(resume, folder), resume)  # one process, from the 2 processes' step 8
    out, seen = ok(result), result.stderr
    assert [step for step, _, _ in re.findall(FOUND, out)] == [str(s) for s in range(9, 17)]
    assert_trains_one_processs_model(out, folder, single)
    assert re.findall(r"^rank 0 rows (\d+)$", seen, re.M) == ["8"] * 8  # the control: all rows


@needs_torch(*NEEDS_PP)
def test_the_pp_page_trains_one_processs_model(runs):
    assert_launches_train_one_processs_model(runs, ["pp", "dp_pp"])


def test_the_tp_page_trains_one_processs_model(runs):
    assert_launches_train_one_processs_model(runs, ["tp", "dp_tp"])


@needs_torch(*NEEDS_CP)
def test_the_4d_page_trains_one_processs_model(runs):
    # The page's layout, and 2 replicas (its loss times dp x cp).
    assert_launches_train_one_processs_model(runs, ["4d", "4d_dp"])
