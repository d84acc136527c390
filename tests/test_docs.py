"""The documentation's code is real. These tests prove:

1. every fenced Python block in README.md and docs/*.md carries a marker on the line above it, either
   `<!-- runnable -->` (must exit 0), `<!-- runnable, fails with: TEXT -->` (must fail and print TEXT) or
   `<!-- not runnable: REASON -->`, so no new block escapes the suite;
2. every runnable block runs as its first line says: `# python NAME.py` (here, in this test process) or
   `# torchrun --standalone --nproc_per_node=N NAME.py` (under real torchrun, on CPU/gloo);
3. the unused-parameter block of docs/troubleshooting.md reproduces DDP's real error and both fixes work;
4. every sentence that states the batch equivalence (N processes with one batch size train as one
   process with another: README, docs, tests/README and the test modules' docstrings) says which
   batch it means the same way: per process, and the same global batch;
5. every link from the docs into a script (``[`code`](../script.py)``) quotes code that the
   script holds (a name, a tag such as `# DDP 4`, a line), no link points at a line number (those
   break with every edit), and every `tests/FILE.py::test_name` the docs cite exists;
6. the numbers a page works out in its prose (bytes of logits, of gradients, of all-to-alls) are
   the arithmetic written out in the test, rounded as printed.
"""
import ast
import contextlib
import io
import re
import runpy

import pytest

from helpers import NEEDS_CP, NEEDS_PP, REPO, command, needs_torch, started

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "tests" / "README.md"]
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
MARKER = re.compile(r"<!-- (runnable|runnable, fails with: (?P<text>.*?)|not runnable: .+?) -->$")
LAUNCH = re.compile(r"# (?:python|torchrun --standalone --nproc_per_node=(?P<n>\d+)) (?P<name>\w+\.py)$")


def blocks():
    """(doc name, marker, expected failure text or None, code) for every ```python block of the docs."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            above = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = MARKER.search(above)
            found.append((doc.name, marker.group(1) if marker else None, marker and marker.group("text"), m.group(1)))
    return found


def runnable(kind):
    """The runnable blocks launched with `kind` ('python' or 'torchrun'), as pytest params."""
    out = []
    for doc, marker, fails_with, code in blocks():
        launch = LAUNCH.match(code.splitlines()[0]) if marker and marker.startswith("runnable") else None
        if launch and (launch.group("n") is not None) == (kind == "torchrun"):
            needs = {"pp.md": NEEDS_PP, "cp.md": NEEDS_CP}.get(doc)  # newer than the floor
            out.append(pytest.param(launch.group("name"), launch.group("n"), fails_with, code,
                                    id=f"{doc}:{launch.group('name')}",
                                    marks=[needs_torch(*needs)] if needs else []))
    return out


def test_every_python_block_is_marked_and_says_how_to_run_it():
    assert len(blocks()) >= 5
    for doc, marker, _, code in blocks():
        assert marker, f"{doc}: a ```python block without a runnable/not runnable marker:\n{code[:200]}"
        if marker.startswith("runnable"):
            assert LAUNCH.match(code.splitlines()[0]), f"{doc}: first line must say how to run it:\n{code[:200]}"


@pytest.mark.parametrize("name, nproc, fails_with, code", runnable("python"))
def test_plain_python_blocks_run(name, nproc, fails_with, code, tmp_path, monkeypatch):
    (tmp_path / name).write_text(code)
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(str(tmp_path / name), run_name="__main__")  # an assert inside the block fails the test
    assert printed.getvalue().strip(), f"{name} printed nothing"


@pytest.fixture(scope="module")
def torchrun_results(tmp_path_factory):
    """Every torchrun block, launched once, side by side: {file name: CompletedProcess}."""
    folder = tmp_path_factory.mktemp("snippets")
    launches = {}
    for param in runnable("torchrun"):
        name, nproc, _, code = param.values
        (folder / name).write_text(code)
        launches[name] = (command(folder / name, nproc=int(nproc)), folder, None)
    return started(launches)()


@pytest.mark.parametrize("name, nproc, fails_with, code", runnable("torchrun"))
def test_torchrun_blocks_run(name, nproc, fails_with, code, torchrun_results):
    result = torchrun_results[name]
    output = result.stdout + result.stderr
    if fails_with:
        assert result.returncode != 0 and fails_with in output, f"expected a failure with {fails_with!r}:\n{output}"
    else:
        assert result.returncode == 0, output


def test_unused_parameter_block_shows_the_error_and_both_fixes_work(torchrun_results):
    out = torchrun_results["unused.py"].stdout
    assert "the bug: Expected to have finished reduction in the prior iteration" in out, out
    assert "fix 1, find_unused_parameters=True: 2 steps" in out and "fix 2, no unused layer: 2 steps" in out, out


def test_links_into_the_scripts_quote_code_they_hold():
    links = 0
    for doc in DOCS:
        text = doc.read_text()
        assert not re.search(r"\.(py|sh)#L\d+", text), f"{doc.name} links to a line number"
        for code, path in re.findall(r"\[`([^`]+)`\]\((?:\.\./)?([\w/.-]+\.(?:py|sh))\)", text):
            assert code in (REPO / path).read_text(), f"{doc.name}: {path} holds no `{code}`"
            links += 1
        for path, name in re.findall(r"(tests/test_\w+\.py)::(test_\w+)", text):
            assert f"def {name}(" in (REPO / path).read_text(), f"{doc.name} cites {path}::{name}"
    assert links >= 10


# a sentence comparing runs of two batch sizes: "2B", two different --batch-size values, 16 and 32
EQUIVALENCE = re.compile(r"\b2B\b|--batch-size (\d+)\b.*--batch-size (?!\1\b)\d+|x 16\b.*x 32\b", re.S)


def test_every_statement_of_the_batch_equivalence_says_which_batch_it_means():
    texts = {str(doc.relative_to(REPO)): doc.read_text() for doc in DOCS}
    texts.update({path.name: ast.get_docstring(ast.parse(path.read_text())) or ""
                  for path in sorted((REPO / "tests").glob("test_*.py"))})
    found = []
    for name, text in texts.items():
        for paragraph in re.split(r"\n\s*\n|\n(?=\|)|\n(?=\d+\. )", text):
            for sentence in re.split(r"(?<=[.;])\s+(?=[A-Z`(])", paragraph):
                sentence = " ".join(sentence.split())
                if EQUIVALENCE.search(sentence):
                    found.append(name)
                    assert "per process" in sentence and "the same global batch" in sentence, \
                        f"{name}: say which batch (per process, the same global batch):\n{sentence}"
    assert {"README.md", "docs/concepts.md", "docs/troubleshooting.md", "tests/README.md",
            "test_classifier.py", "test_cluster_paths.py"} <= set(found), found


# The worked numbers in the docs' prose, each beside the arithmetic that gives it (sizes from the
# models' configurations: GPT-2's 50,257 tokens and 768 wide, Llama 3's 128,256 and 8,192 wide).
GPT2_ROOT = 50_257 * 768 + 1_024 * 768 + 2 * 768  # tied embedding, positions, final norm
GPT2_BLOCK = 12 * 768 ** 2 + 13 * 768  # attention and MLP matrices with biases, two norms
MOE_EP_BYTES = 4 * 2_048 * 128 * 4  # half of 4,096 copies, out and back, forward and backward
MOE_FSDP_BYTES = 263_680 // 2 * 4 * 3  # half of the experts, two all-gathers, a reduce-scatter
WORKED = [
    ("4d.md", "that is {:.1f} GB of fp32 per rank where {:.1f} GB was counted at tp 8",
     [128_256 * 8_192 * 4 / 1e9, 128_256 * 8_192 * 4 / 8 / 1e9]),
    ("pp.md", "m x B x T x vocab floats, {:.0f} MiB at m = 8, B = 16 and T = 128 here, {:.1f} GiB "
              "a micro-batch for Llama 3's 128,256-token vocabulary at B = 1 and T = 8192",
     [8 * 16 * 128 * 256 * 4 / 2**20, 8_192 * 128_256 * 4 / 2**30]),
    ("tp.md", "a micro-batch of 16 x 1,024 tokens has {:.1f} GiB of fp32 logits",
     [16 * 1_024 * 50_257 * 4 / 2**30]),
    ("fsdp.md", "({:.0f}M parameters, {:.1f}M of them the root's embeddings) the root alone is "
                "about {:.1f} blocks' worth", [(GPT2_ROOT + 12 * GPT2_BLOCK) / 1e6,
                                               GPT2_ROOT / 1e6, GPT2_ROOT / GPT2_BLOCK]),
    ("moe.md", "4 x 2,048 x 128 x 4 bytes = {:.1f} MB", [MOE_EP_BYTES / 1e6]),
    ("moe.md", "this block's experts instead: {:,} parameters, half of them received per "
               "all-gather at 2 ranks, two all-gathers and one reduce-scatter, about {:.1f} MB",
     [4 * (2 * 128 * 256 + 256 + 128), MOE_FSDP_BYTES / 1e6]),
    ("moe.md", "it moves {:.1f} times the bytes, above: {:.1f} MB against {:.1f} MB a block",
     [MOE_EP_BYTES / MOE_FSDP_BYTES, MOE_EP_BYTES / 1e6, MOE_FSDP_BYTES / 1e6]),
]


@pytest.mark.parametrize("page,words,values", WORKED)
def test_a_worked_number_in_the_prose_is_its_arithmetic(page, words, values):
    """Each number a page works out in a sentence is the arithmetic written out here, rounded as
    printed (the page's line breaks aside). The control: one value a tenth off is not on the page."""
    text = " ".join((REPO / "docs" / page).read_text().split())
    assert words.format(*values) in text, words.format(*values)
    assert words.format(*[values[0] * 1.1, *values[1:]]) not in text
