"""The marked line of each GPT chapter (3, 7, 8, 9, 10) means what it says: everything that talks
to another process is above it, the lesson; below it is code one process would run the same way.
These tests prove that, for each of the five scripts,

1. no call below the line reaches torch.distributed (the process group, DCP, the state-dict
   helpers, DeviceMesh, FSDP, TP, pipelining, DTensor's full_tensor/redistribute) or DDP, neither
   directly nor through a function of the script that does (followed transitively): the lesson
   section alone shows every way the processes depend on each other. Only the script's entry
   point, `if __name__ == "__main__":`, calls main() and leave_distributed() from below. Settings
   classes that talk to no one (MixedPrecisionPolicy, StateDictOptions, the TP styles and
   placements, a
   PipelineStage and its schedule until they step) and DebugLevel's values are not calls into the
   process group;
2. every call that talks to other processes, in the steps of the lesson section, says why on its
   own lines (a `#` comment on the statement), and every step of main() that talks says so on its
   line or in the comment above it;
3. the production guards (refusals, the debug level, the allocator, compile workarounds) are one
   group of functions named `refuse_*`, `safe_*` or `avoid_*`, each tagged `# guard:`, every call
   of one says `# guard` on its line, and none runs inside a core step: main() calls them once,
   through `avoid_known_failures`, before it joins the group;
4. the detector is no rubber stamp: it finds the collectives above the line (init_process_group,
   all_reduce...), and flags a collective planted below the line, directly or through a helper.
"""
import ast
import re

import pytest
from helpers import REPO

SCRIPTS = ["train_ddp_minigpt.py", "train_fsdp_minigpt.py", "train_tp_minigpt.py",
           "train_pp_minigpt.py", "train_cp_minigpt.py", "train_4d_minigpt.py",
           "train_moe_minigpt.py"]
PLUMBING = re.compile(r"^# =+ the plumbing$")
TALKS_TO_NO_ONE = {  # calls into torch.distributed that send nothing: queries and settings
    "get_rank", "get_world_size", "is_initialized", "get_debug_level", "set_debug_level",
    "MixedPrecisionPolicy", "StateDictOptions", "ColwiseParallel", "RowwiseParallel",
    "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput", "Shard", "Replicate",
    "get_group", "get_local_rank",
    "PipelineStage", "Schedule1F1B", "ScheduleGPipe",  # built idle: schedule.step() sends
    "ScheduleInterleaved1F1B"}
DTENSOR_COLLECTIVES = {"full_tensor", "redistribute"}  # methods that gather or reshard


def distributed_names(tree):
    """The names the script's imports bind to torch.distributed (or DDP): `dist`, `dcp`,
    `fully_shard`..."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names
                      if a.name.startswith("torch.distributed") and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                ("torch.distributed", "torch.nn.parallel")):
            names |= {a.asname or a.name for a in node.names}
    return names


def direct_call(call, names):
    """The name of the torch.distributed function `call` makes, or None: `dist.all_reduce(...)`,
    `dcp.load(...)`, `fully_shard(...)`, `torch.distributed.x(...)`, `t.full_tensor()`."""
    text = ast.unparse(call.func)
    root, last = text.split(".")[0].split("(")[0], text.split(".")[-1]
    if isinstance(call.func, ast.Attribute) and last in DTENSOR_COLLECTIVES:
        return last
    if (root in names or text.startswith("torch.distributed.")) and last not in TALKS_TO_NO_ONE:
        return text
    return None


def collective_functions(tree, names):
    """The script's top-level functions (and classes' methods, by method name) that call
    torch.distributed, directly or through another such function."""
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    found = {name for name, node in defs.items() for call in ast.walk(node)
             if isinstance(call, ast.Call) and direct_call(call, names)}
    while True:  # follow the calls until nothing new joins
        more = {name for name, node in defs.items() if name not in found
                for call in ast.walk(node) if isinstance(call, ast.Call)
                and called_name(call) in found}
        if not more:
            return found
        found |= more


def called_name(call):
    """`f` of `f(...)`, `obj.f(...)`; None for anything else."""
    if isinstance(call.func, ast.Name):
        return call.func.id
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def talking_below(source):
    """[(line, what)] of every call below the marked line that talks to other processes."""
    tree, lines = ast.parse(source), source.splitlines()
    mark = next(i for i, line in enumerate(lines, 1) if PLUMBING.match(line))
    names = distributed_names(tree)
    collectives = collective_functions(tree, names)
    entry = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    skip = {id(c) for n in entry for c in ast.walk(n)}
    found = []
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call) or call.lineno <= mark or id(call) in skip:
            continue
        what = direct_call(call, names) or (
            called_name(call) if called_name(call) in collectives else None)
        if what:
            found.append((call.lineno, what))
    return sorted(found)


def lesson_calls(source):
    """[(call node, what)] of every call in the lesson section (main() up to the marked line)
    that talks to other processes, directly or through a function of the script."""
    tree, lines = ast.parse(source), source.splitlines()
    mark = next(i for i, line in enumerate(lines, 1) if PLUMBING.match(line))
    start = next(n.lineno for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    names = distributed_names(tree)
    collectives = collective_functions(tree, names)
    return [(call, direct_call(call, names) or called_name(call)) for call in ast.walk(tree)
            if isinstance(call, ast.Call) and start <= call.lineno < mark
            and (direct_call(call, names) or called_name(call) in collectives)]


@pytest.mark.parametrize("name", SCRIPTS)
def test_nothing_below_the_line_talks_to_another_process(name):
    found = talking_below((REPO / name).read_text())
    assert not found, f"{name}: below the marked line: " + ", ".join(
        f"line {line}: {what}" for line, what in found)


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_detector_sees_the_lessons_collectives(name):
    found = {what.split(".")[-1] for _, what in lesson_calls((REPO / name).read_text())}
    assert {"init_process_group", "all_reduce", "broadcast_object_list", "all_gather_object",
            "destroy_process_group"} <= found, found
    if name != "train_ddp_minigpt.py":  # the sharded chapters' checkpoints are collectives
        assert {"load", "save", "get_state_dict", "set_state_dict", "fully_shard"} <= found


def test_a_collective_planted_below_the_line_is_flagged():
    source = (REPO / "train_ddp_minigpt.py").read_text()
    assert not talking_below(source)  # the control: as it stands
    direct = source + "\n\ndef planted(x):\n    dist.broadcast(x, src=0)\n"
    through = source + "\n\ndef planted(run, data):\n    return build_data(run)\n"  # --debug
    step = source + "\n\ndef planted(run, m, o, w):\n    return train_step(run, m, o, w, 0)\n"
    dtensor = source + "\n\ndef planted(norm):\n    return norm.full_tensor()\n"
    for planted, what in [(direct, "dist.broadcast"), (through, "build_data"),
                          (step, "train_step"), (dtensor, "full_tensor")]:
        assert [what] == [w for _, w in talking_below(planted)], what


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_call_that_talks_says_why_on_its_line(name):
    source = (REPO / name).read_text()
    lines, tree = source.splitlines(), ast.parse(source)
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    silent = []
    for call, what in lesson_calls(source):
        if main.lineno <= call.lineno <= main.end_lineno:
            continue  # main()'s steps: the next test
        statement = lines[call.lineno - 1:call.end_lineno]
        if not any("#" in line for line in statement):
            silent.append(f"line {call.lineno}: {what}")
    assert not silent, f"{name}: calls that talk to other processes with no comment: {silent}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_mains_steps_say_which_talk(name):
    source = (REPO / name).read_text()
    tree, lines = ast.parse(source), source.splitlines()
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    collectives = collective_functions(tree, distributed_names(tree))
    talking = {call.lineno for call in ast.walk(main) if isinstance(call, ast.Call)
               and called_name(call) in collectives}
    assert len(talking) >= 6  # init, data (--debug), resume, train, evaluate, save, report
    silent = [lines[i - 1].strip() for i in sorted(talking) if not re.search(
        r"(talks|collective|every rank|all ranks)", lines[i - 1] + lines[i - 2])]
    assert not silent, f"{name}: main() calls that talk without saying so: {silent}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_guards_are_one_named_group(name):
    source = (REPO / name).read_text()
    tree, lines = ast.parse(source), source.splitlines()
    guards = [n for n in tree.body if isinstance(n, ast.FunctionDef)
              and n.name.startswith(("refuse_", "safe_", "avoid_"))]
    assert {"refuse_a_bad_launch", "safe_debug_level", "avoid_page_faults_on_cpu"} <= {
        g.name for g in guards}
    where = sorted(g.lineno for g in guards)
    between = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
               and where[0] < n.lineno < where[-1] and n not in guards]
    assert not between, f"{name}: the guards are split by {between}"
    assert any("# ---" in line and "guards" in line for line in lines[where[0] - 4:where[0]])
    for guard in guards:
        assert "# guard:" in lines[guard.lineno - 1], f"{name}: {guard.name} has no guard tag"
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call)
             and called_name(c) in {g.name for g in guards}]
    assert calls and all("# guard" in lines[c.lineno - 1] for c in calls), name
    mark = next(i for i, line in enumerate(lines, 1) if PLUMBING.match(line))
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    above = [(c.lineno, called_name(c)) for c in calls if c.lineno < mark]
    assert [name for _, name in above] == ["avoid_known_failures"], f"{name}: guards in the core"
    assert main.lineno < above[0][0] <= main.end_lineno  # once, in main(), before the group
