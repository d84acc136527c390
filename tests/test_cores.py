"""The distributed cores of chapter 3, and the context-parallel pieces of chapter 10, can be copied
into a trainer of one's own as they stand. These tests prove that

1. each core (joining the group and picking the device, with its two guards: refusing a bad launch
   and a debug level that crashes DDP; the no_sync accumulation, the mean over ranks, exact
   evaluation across ranks, rank 0 saving while every rank waits, leaving the group) is one
   top-level function of train_ddp_minigpt.py carrying its `# DDP k` (or `# guard:`) tag, on the
   line that makes the call, whose
   free names are torch's, the standard library's and the other cores' alone;
2. docs/ddp_in_your_trainer.md holds each of them as the script does, and its diff block is the real
   diff between the page's single-process trainer and its DDP trainer;
3. copied afresh out of the script beside the page's small model of its own, the cores run under
   torchrun at 2 processes: the DDP trainer logs the single-process trainer's losses, evaluates to
   its validation loss, and rank 0 alone saves weights that load into the plain model; started
   without torchrun it stops in one line with exit code 2;
4. docs/cp_in_your_trainer.md holds chapter 10's pieces (chunk_positions, Context, GatherContext,
   the ring's pieces, causal_attention) as the script does, its diff block is the real diff
   between its two trainers, and copied afresh out of the script, the pieces split a small model's
   sequences over 2 processes under torchrun, by the all-gather and by the ring, with the
   single-process losses and clipped gradient norms (4 printed decimals).
"""
import ast
import builtins
import difflib
import re
import runpy

import torch
from helpers import GPT, NEEDS_CP, REPO, as_script, command, finish, needs_torch, ok, run_single
from helpers import start

CORES = ["init_distributed", "refuse_a_bad_launch", "safe_debug_level", "accumulate_gradients",
         "mean_loss_over_ranks", "mean_over_ranks", "save_on_rank_0", "leave_distributed"]
ALLOWED = {"torch", "dist", "nn", "F", "DDP", "contextlib", "datetime", "gc", "os", "sys",
           *CORES, *dir(builtins)}
PAGE = REPO / "docs" / "ddp_in_your_trainer.md"


def cores():
    """{name: source} of each core, cut out of the script by its def line (decorators included)."""
    source = (REPO / GPT).read_text()
    lines, found = source.splitlines(), {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name in CORES:
            start = (node.decorator_list[0] if node.decorator_list else node).lineno - 1
            body = lines[node.lineno - 1:node.end_lineno]  # the tag sits on the line that acts
            assert any(re.search(r"# (DDP \d+|guard:)", x) for x in body), f"{node.name}: no tag"
            found[node.name] = "\n".join(lines[start:node.end_lineno])
    return found


def page_blocks():
    """The page's single-process trainer, its DDP trainer and its diff block, as text."""
    blocks = re.findall(r"^```(?:python|diff)\n(.*?)^```", PAGE.read_text(), re.M | re.S)
    assert len(blocks) == 3, len(blocks)
    return blocks


def free_names(source):
    """Names a function reads that it neither defines nor binds itself."""
    tree = ast.parse(source)
    bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and
             isinstance(n.ctx, ast.Store)}
    bound |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
              for a in n.args + n.kwonlyargs}
    bound |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ExceptHandler))
              and n.name}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - bound


def test_each_core_is_one_tagged_function_of_torch_and_the_standard_library():
    found = cores()
    assert sorted(found) == sorted(CORES)
    for name, source in found.items():
        assert free_names(source) <= ALLOWED, (name, free_names(source) - ALLOWED)


def test_the_page_holds_the_scripts_cores_as_they_stand():
    single, ddp, diff = page_blocks()
    for name, source in cores().items():
        assert source in ddp, f"docs/ddp_in_your_trainer.md lost {name} as the script has it"
    real = difflib.unified_diff(single.splitlines(), ddp.splitlines(), "my_trainer_single.py",
                                "my_trainer.py", n=1, lineterm="")
    assert diff.rstrip("\n") == "\n".join(real)


def test_the_cores_stand_alone_under_torchrun(tmp_path, monkeypatch):
    single, ddp, _ = page_blocks()
    first, last = ddp.index("def init_distributed("), ddp.index("def main(")
    fresh = ddp[:first] + "\n\n\n".join(cores()[name] for name in CORES) + "\n\n\n" + ddp[last:]
    mine = tmp_path / "ddp"  # the DDP trainer's own folder: both trainers save classifier.pt
    mine.mkdir()
    (mine / "my_trainer.py").write_text(fresh)
    (tmp_path / "single.py").write_text(single)
    cmd = command(mine / "my_trainer.py", nproc=2)
    launched = start(cmd, mine)  # while the single-process trainer runs here
    monkeypatch.chdir(tmp_path)  # where it saves classifier.pt
    printed = run_single(tmp_path / "single.py")
    out = ok(finish(launched, cmd))
    numbers = [re.findall(r"loss (\d+\.\d+)", text) for text in (out, printed)]
    assert len(numbers[0]) == 4 and numbers[0] == numbers[1], (out, printed)
    assert out.count("saved classifier.pt") == 1 and (mine / "classifier.pt").exists()
    model = runpy.run_path(str(tmp_path / "single.py"))["Classifier"]()
    model.load_state_dict(torch.load(mine / "classifier.pt", weights_only=True))  # no module.
    alone = as_script(mine / "my_trainer.py")  # `python my_trainer.py`: no torchrun
    assert alone.returncode == 2 and alone.stderr == (
        "error: not launched by torchrun: see the commands at the top of this script\n")


CP_PIECES = ["chunk_positions", "Context", "GatherContext", "ring_attention", "RingAttention",
             "ring_block", "pass_on", "block_attention", "block_gradients", "tile_scores",
             "causal_attention"]
CP_PAGE = REPO / "docs" / "cp_in_your_trainer.md"


def cp_pieces():
    """{name: source} of chapter 10's pieces, cut out of the script from their first decorator or
    their def or class line."""
    source = (REPO / "train_cp_minigpt.py").read_text()
    lines = source.splitlines()
    return {n.name: "\n".join(lines[min([n.lineno, *(d.lineno for d in n.decorator_list)]) - 1:
                                    n.end_lineno])
            for n in ast.parse(source).body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in CP_PIECES}


def test_the_cp_page_holds_the_scripts_pieces_as_they_stand():
    single, mine, diff = re.findall(r"^```(?:python|diff)\n(.*?)^```", CP_PAGE.read_text(),
                                    re.M | re.S)
    assert sorted(cp_pieces()) == sorted(CP_PIECES)
    for name, source in cp_pieces().items():
        assert source in mine, f"docs/cp_in_your_trainer.md lost {name} as the script has it"
    real = difflib.unified_diff(single.splitlines(), mine.splitlines(), "my_lm_single.py",
                                "my_lm_cp.py", n=1, lineterm="")
    assert diff.rstrip("\n") == "\n".join(real)


@needs_torch(*NEEDS_CP)
def test_the_cp_pieces_stand_alone_under_torchrun(tmp_path):
    single, mine, _ = re.findall(r"^```(?:python|diff)\n(.*?)^```", CP_PAGE.read_text(),
                                 re.M | re.S)
    first, last = mine.index("def chunk_positions("), mine.index("def main(")
    pieces = cp_pieces()
    fresh = mine[:first] + "\n\n\n".join(pieces[n] for n in CP_PIECES) + "\n\n\n" + mine[last:]
    (tmp_path / "my_lm_cp.py").write_text(fresh)
    (tmp_path / "my_lm_single.py").write_text(single)
    cmds = [command(tmp_path / "my_lm_cp.py", rotate, nproc=2) for rotate in ([], ["ring"])]
    launched = [start(cmd, tmp_path) for cmd in cmds]
    printed = run_single(tmp_path / "my_lm_single.py")
    found = r"loss (\d+\.\d+) \| norm (\d+\.\d+)"
    for proc, cmd in zip(launched, cmds):  # the all-gather, then the ring
        out = ok(finish(proc, cmd))
        numbers = [re.findall(found, text) for text in (out, printed)]
        assert len(numbers[0]) == 4 and numbers[0] == numbers[1], (cmd, out, printed)
        assert float(numbers[0][-1][0]) < float(numbers[0][0][0]) - 1  # it learns: the control
        assert all(float(norm) > 1 for _, norm in numbers[0])  # clipping binds: the scale matters
