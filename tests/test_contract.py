"""The one proof contract of the GPT chapters (tests/README.md, "One proof for every GPT chapter"):
each chapter's test module declares, in CONTRACT, the tests that hold each clause, or None where
the clause is not held yet. These tests prove that every module declares every clause and no other,
that each test it names exists in it (a renamed or removed test fails here), that the chapters
whose work is done (all seven) hold every clause, and that tests/README.md's table of what is held
matches the declarations. The control: a declaration missing a clause, or naming a test that is
not there, is refused.
"""
import importlib
import re
from pathlib import Path

import pytest

CLAUSES = ("reference", "norms", "padded", "dropout", "collectives", "policy", "resume",
           "bf16")
MODULES = {3: "test_minigpt", 7: "test_fsdp", 8: "test_tp", 9: "test_pp", 10: "test_cp",
           11: "test_4d", 12: "test_moe"}
DONE = (3, 7, 8, 9, 10, 11, 12)  # the chapters that hold every clause
README = Path(__file__).parent / "README.md"


def problems(contract, names):
    """What is wrong with one module's CONTRACT, given the names its module defines."""
    found = []
    if set(contract) != set(CLAUSES):
        found.append(f"clauses {sorted(contract)} are not {sorted(CLAUSES)}")
    for clause, tests in contract.items():
        found += [f"{clause}: {test} is not a test of the module" for test in tests or []
                  if not (test.startswith("test_") and test in names)]
    return found


@pytest.mark.parametrize("chapter", sorted(MODULES))
def test_each_chapter_declares_every_clause_with_tests_it_has(chapter):
    module = importlib.import_module(MODULES[chapter])
    assert not problems(module.CONTRACT, dir(module)), problems(module.CONTRACT, dir(module))
    if chapter in DONE:
        assert all(module.CONTRACT.values()), module.CONTRACT


def test_a_missing_clause_or_a_test_that_is_not_there_is_refused():
    names = ["test_a", "test_b", "helper"]
    good = {clause: ["test_a"] for clause in CLAUSES}
    assert problems(good, names) == [] and problems({**good, "norms": None}, names) == []
    assert problems({k: v for k, v in good.items() if k != "padded"}, names)
    assert problems({**good, "dropout": ["test_gone"]}, names)
    assert problems({**good, "policy": ["helper"]}, names)


def test_the_readme_table_says_what_each_chapter_holds():
    """Each chapter's row in tests/README.md marks a clause held (yes) or not yet (no)."""
    text = README.read_text()
    for chapter, name in MODULES.items():
        row = re.search(rf"^\| {chapter} \| `{name}\.py` \|(.*)\|$", text, re.M)
        assert row, f"tests/README.md has no contract row for chapter {chapter}"
        cells = [cell.strip() for cell in row.group(1).split("|")]
        contract = importlib.import_module(name).CONTRACT
        assert cells == ["yes" if contract[c] else "no" for c in CLAUSES], (chapter, cells)
