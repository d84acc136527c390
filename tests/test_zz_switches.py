"""The flag matrix: every switch a GPT chapter's script accepts (chapters 3 and 7-12), and every value
of a switch with choices, is given to at least one launch of this test session that ended with exit
0, or is listed with its reason in tests/README.md's table "Switches no launch turns on". What ran is
read from helpers.LAUNCHED, where the helpers note each launch as they finish it (a probe counts for
the trainer it runs), so a switch a module names but never launches is caught.

The module's name sorts last, so pytest runs it after every launch of the suite. Run alone, or with
a -k or -m selection, it has not seen the suite's launches and skips; the README's test command runs
the whole suite and so runs it. The control: a launch list without one flag or one value is refused.
"""
import argparse
import re
import types
from pathlib import Path

import pytest
import torch
from helpers import LAUNCHED, launched_values, switches, trainer

CHAPTERS = {3: "train_ddp_minigpt.py", 7: "train_fsdp_minigpt.py", 8: "train_tp_minigpt.py",
            9: "train_pp_minigpt.py", 10: "train_cp_minigpt.py", 11: "train_4d_minigpt.py",
            12: "train_moe_minigpt.py"}
README = Path(__file__).parent / "README.md"


def exemptions():
    """{(script, flag or "flag value"): why} from tests/README.md's table, a row per script and
    reason, its switches quoted in one cell; "every GPT chapter" stands for all seven scripts."""
    text = README.read_text().split("## Switches no launch turns on", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| ")][1:]  # the header aside
    found = {}
    for row in rows:
        cells = re.fullmatch(r"\| ([^|]+?) \| (`[^|]+`) \| ([^|]+) \|", row)
        assert cells, f"tests/README.md: a row of the table is not script | switches | why: {row}"
        where, cell, why = cells.groups()
        scripts = CHAPTERS.values() if where == "every GPT chapter" else [where.strip("`")]
        found.update({(script, switch): why for script in scripts
                      for switch in re.findall(r"`([^`]+)`", cell)})
    return found


def unlaunched(script, flags, launches, exempt):
    """The switches of `script` ("--flag" or "--flag value") that no launch gave and no row exempts."""
    given = {}
    for name, args in launches:
        if name == script:
            for flag, values in launched_values(args, flags).items():
                given.setdefault(flag, set()).update(values)
    wanted = [(flag, value) for flag, (choices, _) in flags.items() for value in choices or [None]]
    names = [flag if value is None else f"{flag} {value}" for flag, value in wanted]
    return [name for name, (flag, value) in zip(names, wanted)
            if (script, name) not in exempt and value not in given.get(flag, ())]


def whole_suite(session):
    """True if this session collected every test module of tests/ and selected none out."""
    modules = {Path(item.fspath).name for item in session.items}
    every = {path.name for path in Path(__file__).parent.glob("test_*.py")}
    option = session.config.option
    return modules >= every and not option.keyword and not option.markexpr


@pytest.mark.parametrize("chapter", sorted(CHAPTERS))
def test_every_switch_and_every_choice_is_launched_or_exempt_with_a_reason(chapter, request):
    if not whole_suite(request.session):
        pytest.skip("reads the launches of a whole-suite run (python -m pytest)")
    script = CHAPTERS[chapter]
    missing = unlaunched(script, switches(script), LAUNCHED, exemptions())
    assert not missing, f"{script}: no launch of this session gave {missing}, and tests/README.md " \
                        "exempts none of them"


def test_a_launch_list_without_a_flag_or_a_value_is_refused():
    flags = {"--amp": (["off", "bf16"], "off"), "--dropout": (None, 0.0), "--tp": (None, 1)}
    runs = [("a.py", ["--dropout", "0.1"]), ("a.py", ["--amp=bf16", "--tp", "2"])]
    assert unlaunched("a.py", flags, runs, {}) == []  # the first runs --amp off, its default
    assert unlaunched("a.py", flags, runs[:1], {}) == ["--amp bf16", "--tp"]
    assert unlaunched("a.py", flags, runs[:1], {("a.py", "--tp"): "x"}) == ["--amp bf16"]
    assert unlaunched("a.py", flags, [("b.py", runs[1][1])] + runs[:1], {}) == ["--amp bf16", "--tp"]
    assert unlaunched("a.py", flags, runs[1:], {}) == ["--amp off", "--dropout"]


def test_the_exemption_table_names_only_switches_the_scripts_have():
    """Every row is read (a row the pattern misses fails in exemptions()), a row of one script
    names only that script, and every switch it names is one of that script's."""
    scripts = {script for script, _ in exemptions()}
    assert scripts <= set(CHAPTERS.values()) and scripts, scripts
    for (script, switch) in exemptions():
        flag, _, value = switch.partition(" ")
        flags = switches(script)
        assert flag in flags and (not value or value in (flags[flag][0] or ())), (script, switch)


@pytest.mark.parametrize("chapter", sorted(CHAPTERS))
def test_every_compile_backend_reaches_torch_compile_as_given(chapter, monkeypatch):
    """--compile-backend's value is what torch.compile receives, whole model or block by block, for
    every choice: the launches run aot_eager (and chapter 3 every CPU backend), and a script that
    named its own backend would fail here for the other choices. The control: without --compile
    nothing is compiled."""
    module, seen = trainer(CHAPTERS[chapter]), []
    monkeypatch.setattr(torch, "compile", lambda model, backend: seen.append(backend) or model)
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, backend: seen.append(backend))
    monkeypatch.setattr(module, "DDP", lambda model, device_ids: model, raising=False)
    blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    model = types.SimpleNamespace(blocks=blocks if chapter == 8 else
                                  torch.nn.ModuleDict({"0": blocks[0], "1": blocks[1]}))
    choices = switches(CHAPTERS[chapter])["--compile-backend"][0]
    for backend in choices:
        args = argparse.Namespace(compile=True, compile_backend=backend)
        module.wrap_model(types.SimpleNamespace(args=args, device=torch.device("cpu")), model)
        assert seen and set(seen) == {backend}, (backend, seen)
        seen.clear()
    module.wrap_model(types.SimpleNamespace(args=argparse.Namespace(
        compile=False, compile_backend="eager"), device=torch.device("cpu")), model)
    assert seen == []
