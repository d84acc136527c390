"""The mistakes catalogue (tests/mistakes.py, its table in docs/mistakes.md) follows the scripts, in
well under a second; its own command (`python tests/mistakes.py`, 43 min here) runs each
mistake.
These tests prove:

1. every mistake's patch applies to its script as the script stands: each course text is there
   exactly once (the control: a text that is not there is refused, as the command refuses it);
2. every test a mistake names exists, and every chapter from 2 to 12 has at least 6 mistakes;
3. docs/mistakes.md's table holds one row for every mistake, none caught by "survived".
"""
import collections
import re

import pytest
from helpers import REPO

import mistakes  # noqa: E402  (tests/ is on sys.path under pytest)


@pytest.mark.parametrize("mistake", mistakes.CATALOGUE, ids=lambda m: m.name)
def test_each_mistake_applies_to_its_script_as_it_stands(mistake, tmp_path):
    (tmp_path / mistake.script).parent.mkdir(exist_ok=True)  # docs/ for a copy page's
    (tmp_path / mistake.script).write_text((REPO / mistake.script).read_text())
    mistakes.apply(mistake, tmp_path)
    assert (tmp_path / mistake.script).read_text() != (REPO / mistake.script).read_text()


def test_a_patch_whose_text_is_gone_is_refused(tmp_path):
    gone = mistakes.Mistake("gone", 2, "train_ddp_basic.py", [("no such line\n", "")], "", "", [])
    (tmp_path / gone.script).write_text((REPO / gone.script).read_text())
    with pytest.raises(ValueError, match="holds 0 copies of 'no such line'"):
        mistakes.apply(gone, tmp_path)


def test_every_named_test_exists_and_every_chapter_has_six():
    for m in mistakes.CATALOGUE:
        for node in m.catches:
            path, name = node.split("::")
            assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), (m.name, node)
    per_chapter = collections.Counter(m.chapter for m in mistakes.CATALOGUE)
    assert all(per_chapter[chapter] >= 6 for chapter in range(2, 13)), per_chapter
    names = [m.name for m in mistakes.CATALOGUE]
    assert len(names) == len(set(names))


def test_the_docs_table_has_a_row_for_every_mistake_and_none_survived():
    table = (REPO / "docs" / "mistakes.md").read_text()
    rows = re.findall(r"^\| `([\w-]+)` \|.*\| ([^|]+) \|$", table, re.M)
    assert sorted(name for name, _ in rows) == sorted(m.name for m in mistakes.CATALOGUE)
    assert not [name for name, caught in rows if "survived" in caught]
