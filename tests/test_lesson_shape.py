"""The lesson of chapter 2 is `diff train_single_gpu.py train_ddp_basic.py`. These tests prove that the
diff stays a lesson: every line the DDP script adds or changes (outside its docstring, which holds the
launch commands) carries a `# DDP k/10` tag, every numbered change 1..10 is present in the script and in
the README's table, and the diff stays small."""
import difflib
import re

from conftest import REPO

TAG = re.compile(r"# DDP (\d+)/(\d+)")
MAX_CHANGED_LINES = 77  # both sides of the diff, docstring included; the goal is 60 (see README)


def diff_lines():
    single = (REPO / "train_single_gpu.py").read_text().splitlines()
    ddp = (REPO / "train_ddp_basic.py").read_text().splitlines()
    added, removed = [], []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, single, ddp, autojunk=False).get_opcodes():
        if tag != "equal":
            removed += single[i1:i2]
            added += [(j, ddp[j]) for j in range(j1, j2)]
    return added, removed, single, ddp


def test_every_ddp_line_is_tagged_with_its_change_number():
    added, _, _, ddp = diff_lines()
    docstring_end = ddp.index('"""', 1)  # the docstring's launch commands differ too, and cannot carry tags
    untagged = [f"{j + 1}: {line}" for j, line in added if j > docstring_end and line.strip() and not TAG.search(line)]
    assert not untagged, "untagged DDP lines:\n" + "\n".join(untagged)


def test_changes_are_numbered_1_to_10_in_script_and_readme():
    _, _, _, ddp = diff_lines()
    numbers = {(int(k), int(n)) for line in ddp for k, n in TAG.findall(line)}
    assert numbers == {(k, 10) for k in range(1, 11)}
    readme = (REPO / "README.md").read_text()
    for k in range(1, 11):
        assert re.search(rf"^\| {k} \|", readme, re.M), f"README's table of DDP changes has no row {k}"


def test_the_diff_stays_small_and_leaves_the_shared_lines_alone():
    added, removed, single, _ = diff_lines()
    assert len(added) + len(removed) <= MAX_CHANGED_LINES
    assert len(single) - len(removed) > 200  # most of the trainer is shared, line for line
