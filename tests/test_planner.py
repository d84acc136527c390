"""Chapter 13's planner, plan_layout.py, in this process: no torch, no launch, the module in
seconds. These tests prove:

1. bad input is one line on stderr and exit code 2 through the script's own __main__, never a
   traceback: an unknown preset, a --layout whose sizes are not the GPUs, a tp that does not divide
   the heads, an ep that does not divide the experts, a --layout key given twice, --world-size
   without --chapter-lines, a negative --misses, --svg or --json with nothing to write, and a
   model that fits no layout (the line names the nearest change that fits: the fewest whole nodes
   of GPUs, or a shorter sequence); the control, a good command, exits 0; a reader that closes
   the pipe gets no traceback; a layout the planner does not try says why in words; --help gives
   every default;
2. the presets' parameter counts are their published totals (Llama 3 8B, 70B and 405B; Mixtral
   8x7B's 46.7B and 12.9B active; DeepSeek-V3's 671B and 37B active; GPT-2's 124M; the course's
   GPT's 842,496, chapter 11's model line), and the same shape given by flags counts the same (the
   control: one layer fewer does not);
3. the table ranks by the estimated step time (the control: not by memory), and every layout it
   lists has pp x dp x cp x tp equal to the GPUs, a tp that divides the heads, an ep that divides
   the experts and dp x cp, and fits the usable memory, while each miss it lists does not;
4. --json parses (the table's, and --layout's explained plans), and --svg is well-formed XML with
   one dot for every layout tried; FSDP's traffic hides behind compute alone, as the overlap model
   says;
5. the chapter lines: for two layouts of each of chapters 7 to 12, on the tests' tiny GPT (2
   layers, 32 wide, context 32, the 256 byte values), the text of the lines that chapter's rank 0
   prints about what a rank holds and sends, written out here; each against a control (another
   world size or flag) whose text differs; and at the default flags, the lines the docs quote
   from real runs of chapters 7, 8, 9 and 10 (docs/fsdp.md, tp.md, pp.md, cp.md), the control
   chapter 7 at 4 processes;
6. the docs' numbers are the planner's: every ```bash block of docs/4d.md, pp.md, cp.md, tp.md,
   fsdp.md, moe.md and planner.md that starts `python plan_layout.py` is run here, and the
   plain ``` block after it is its output to the character (the control: that block with one
   digit changed fails); and no markdown table of those pages holds bytes, times or shares (GB,
   MiB, ms, %...) unless the line above it marks it `<!-- measured -->`, a table of real runs
   (the control: a GB table without the marker is found); README.md's chapter 13 output is the
   planner's output now.
"""
import contextlib
import io
import itertools
import json
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest

from helpers import REPO, as_script, trainer

PLAN = "plan_layout.py"
planner = trainer(PLAN)
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
        "--batch-size", "6", "--grad-accum", "2", "--device", "cpu", "--lr", "1e-2"]


def refused(args):
    """The script's one error line, after asserting exit code 2 and nothing else printed."""
    result = as_script(PLAN, args)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == "" and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr


def test_bad_input_is_one_line_and_exit_code_2():
    assert "invalid choice: 'llama9'" in refused(["--preset", "llama9"])
    assert "is 32 ranks, not the 64 GPUs" in refused(
        ["--preset", "llama3-70b", "--gpus", "64", "--layout", "pp=2,tp=8,dp=2"])
    assert "tp 3 does not divide the 64 heads" in refused(
        ["--preset", "llama3-70b", "--gpus", "24", "--layout", "tp=3"])
    assert "ep 3 does not divide the 8 experts" in refused(
        ["--preset", "mixtral-8x7b", "--gpus", "48", "--layout", "tp=8,ep=3"])
    assert "does not divide --width" in refused(["--width", "100", "--heads", "3"])
    line = refused(["--preset", "llama3-70b", "--gpus", "8"])  # 70.6B x 16 B: 1.1 TB of state
    assert line.startswith("error: no layout of llama3-70b fits 8 GPUs of 80 GB") and \
        "the nearest change: --gpus 24, the fewest that fit" in line, line
    ok = as_script(PLAN, ["--preset", "llama3-70b", "--gpus", "24", "--top", "1"])  # the control
    assert ok.returncode == 0 and ok.stderr == "" and "llama3-70b" in ok.stdout


def test_the_nearest_change_is_the_fewest_whole_nodes_that_fit():
    """70B on 4 GPUs: 24 fits (pp 3 x tp 8), not only the doublings 8, 16, 32; the control: 16,
    the node count before it, fits no layout."""
    line = refused(["--preset", "llama3-70b", "--gpus", "4"])
    assert "the nearest change: --gpus 24, the fewest that fit" in line, line
    assert "the nearest change: --gpus 24" in refused(["--preset", "llama3-70b", "--gpus", "16"])
    best = as_script(PLAN, ["--preset", "llama3-70b", "--gpus", "24", "--top", "1"]).stdout
    assert re.search(r"^1 +3 +1 +1 +8 ", best, re.M), best


def test_input_that_used_to_pass_unnoticed_is_one_line_and_exit_code_2(tmp_path):
    """A key given twice, --world-size without --chapter-lines, a negative --misses (its line says
    0 is allowed), --svg beside --layout or --json beside --bubble (nothing to write), two of
    --bubble, --chapter-lines and --layout (main printed the first and dropped the other)."""
    seventy = ["--preset", "llama3-70b", "--gpus", "64"]
    assert "pp given twice in 'pp=2,pp=4'" in refused(seventy + ["--layout", "pp=2,pp=4"])
    assert "--world-size goes with --chapter-lines" in refused(["--world-size", "4"])
    assert "must be a whole number, 0 or more, got '-1'" in refused(["--misses", "-1"])
    assert "--svg draws every layout tried" in refused(
        seventy + ["--layout", "tp=8", "--svg", tmp_path / "x.svg"])
    assert "--bubble makes none" in refused(["--bubble", "4", "--json", tmp_path / "x.json"])
    assert "--bubble and --layout print different things: give one" in refused(
        ["--bubble", "4", "--layout", "tp=8"])
    ok = as_script(PLAN, ["--misses", "0", "--top", "1"])  # the control: 0 misses is allowed
    assert ok.returncode == 0 and ok.stderr == "" and "fastest that do not fit" not in ok.stdout


def test_layout_with_json_writes_each_explained_plan(tmp_path):
    """--layout ... --json FILE writes the plan it explains (its layout, memory, seconds, place),
    and for several layouts one plan each, on its own GPUs where it names dp."""
    seventy, path = ["--preset", "llama3-70b", "--gpus", "64"], tmp_path / "plans.json"
    one = as_script(PLAN, seventy + ["--layout", "pp=2,tp=8,dp=4,recompute=full", "--json", path])
    [plan] = json.loads(path.read_text())["layouts"]
    assert one.returncode == 0 and plan["layout"]["pp"] == 2 and plan["layout"]["dp"] == 4
    assert plan["fits"] and f"{plan['step_s']:,.3f} s" in one.stdout
    assert f"place {plan['place'].replace(' of', ' of the')}" in one.stdout
    two = as_script(PLAN, seventy + ["--layout", "tp=8,dp=1", "--layout", "tp=8", "--json", path])
    gpus = [p["cluster"]["gpus"] for p in json.loads(path.read_text())["layouts"]]
    assert two.returncode == 0 and gpus == [8, 64]  # the control: dp named, its own GPUs


def test_a_reader_that_closes_the_pipe_gets_no_traceback():
    """`plan_layout.py ... | head -1`: the pipe closes before the table is written; the planner
    stops quietly with SIGPIPE's exit code 141 (the control: an open pipe gets the table)."""
    command = [sys.executable, str(REPO / PLAN), "--top", "3"]
    closed = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    closed.stdout.close()  # the reader is gone before the first write
    _, err = closed.communicate(timeout=60)
    assert closed.returncode == 141 and err == b"", err.decode()
    open_ = subprocess.run(command, capture_output=True, timeout=60)
    assert open_.returncode == 0 and open_.stdout.count(b"\n") > 3 and open_.stderr == b""


def test_a_layout_the_planner_does_not_try_says_why():
    """--layout cp=64 at 8K leaves a cp rank 128 tokens, under the 1,024 the planner tries; V 3
    is not among the V it tries; and an interleaved rank's layers are its stages' runs (pp 4, V 2:
    rank 0 holds stages 0 and 4). The control: a layout it tries has its place."""
    seventy = ["--preset", "llama3-70b", "--gpus", "64", "--layout"]
    out = as_script(PLAN, seventy + ["cp=64"]).stdout
    assert "does not try it: cp 64 leaves a rank 128 tokens of each sequence" in out, out
    assert "micro_sizes" not in out
    out = as_script(PLAN, seventy + ["pp=2,tp=8,schedule=interleaved-1f1b,v=3"]).stdout
    assert "does not try it: v 3: it tries V 2 and 4; nor does it fit" in out, out
    assert "(pp rank 0, layers 0-12, 26-38, 52-65)" in out
    out = as_script(PLAN, seventy + ["pp=4,tp=8,dp=2,schedule=interleaved-1f1b,v=2"]).stdout
    assert "(pp rank 0, layers 0-9, 40-49)" in out, out
    out = as_script(PLAN, seventy + ["pp=2,tp=8,dp=4,recompute=full"]).stdout
    assert re.search(r"^place \d+ of the \d+ that fit", out, re.M), out


def test_help_gives_every_default():
    """--help shows each cluster preset's numbers, help for every cluster flag, and the defaults
    a model given by flags takes (the control: --gpus-per-node used to have no help at all)."""
    text = " ".join(as_script(PLAN, ["--help"]).stdout.split())
    for name, c in planner.CLUSTERS.items():
        assert (f"{name}: {c['gpu_memory_gb']:g} GB, {c['peak_tflops']:g} TFLOPS, "
                f"{c['gpus_per_node']} GPUs a node, {c['intra_node_gbps']:g} GB/s in a node and "
                f"{c['inter_node_gbps']:g} across") in text, name
    assert "--gpus-per-node GPUS_PER_NODE GPUs a node" in text
    assert "--gpu-memory-gb GPU_MEMORY_GB one GPU's memory, GB; 90% of it usable" in text
    assert ("--seq-len 4096, --tokens-per-step 4,194,304 (2^22), --mlp gelu, --kv-heads = "
            "--heads and --mlp-width = 4 x --width unless given") in text
    m = planner.model_from(planner.parse_args(["--layers", "2", "--width", "64", "--heads", "4"]))
    assert (m.seq_len, m.tokens_per_step, m.mlp, m.kv_heads, m.mlp_width) == (
        4096, 2**22, "gelu", 4, 256)  # what the help says, the model the planner makes


def params(preset, active=False):
    model = planner.Model(preset, **planner.PRESETS[preset])
    return (planner.active_params if active else planner.total_params)(model)


def test_the_presets_count_their_published_parameters():
    assert params("llama3-8b") == pytest.approx(8.0e9, rel=0.01)
    assert params("llama3-70b") == pytest.approx(70.6e9, rel=0.001)
    assert params("llama3-405b") == pytest.approx(405e9, rel=0.005)
    assert params("mixtral-8x7b") == pytest.approx(46.7e9, rel=0.001)
    assert params("mixtral-8x7b", active=True) == pytest.approx(12.9e9, rel=0.002)
    assert params("deepseek-v3") == pytest.approx(671e9, rel=0.001)
    assert params("deepseek-v3", active=True) == pytest.approx(37e9, rel=0.02)
    assert params("gpt2-124m") == 124_439_808
    assert params("course-gpt") == 842_496  # chapter 11's model line at its defaults
    flags = ["--layers", "32", "--width", "4096", "--heads", "32", "--kv-heads", "8",
             "--mlp-width", "14336", "--mlp", "swiglu", "--vocab", "128256"]
    assert planner.total_params(planner.model_from(planner.parse_args(flags))) == \
        params("llama3-8b")
    flags[1] = "31"  # the control: a layer fewer
    assert planner.total_params(planner.model_from(planner.parse_args(flags))) != \
        params("llama3-8b")


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plans")
    args = ["--preset", "mixtral-8x7b", "--gpus", "64", "--top", "40", "--misses", "5",
            "--json", folder / "plans.json", "--svg", folder / "plans.svg"]
    result = as_script(PLAN, args)
    assert result.returncode == 0, result.stderr
    return json.loads((folder / "plans.json").read_text()), folder / "plans.svg", result.stdout


def test_the_table_ranks_by_step_time_and_lists_layouts_that_divide_and_fit(plans):
    doc, _, out = plans
    fitting, usable = doc["fitting"], doc["usable_share"] * doc["cluster"]["gpu_memory_gb"] * 1e9
    times = [p["step_s"] for p in fitting]
    assert len(fitting) > 40 and times == sorted(times)
    memory = [p["memory"]["total"] for p in fitting]
    assert memory != sorted(memory)  # the control: the order is not the memory's
    for p in fitting:
        lay = p["layout"]
        assert lay["pp"] * lay["dp"] * lay["cp"] * lay["tp"] == 64
        assert 32 % lay["tp"] == 0 and 8 % lay["ep"] == 0
        assert (lay["dp"] * lay["cp"]) % lay["ep"] == 0
        assert p["fits"] and p["memory"]["total"] <= usable
    assert doc["misses"] and all(p["memory"]["total"] > usable for p in doc["misses"])
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit()]
    assert len(rows) == 40 and rows[0].split()[1:6] == [str(fitting[0]["layout"][k])
                                                       for k in ("pp", "dp", "cp", "tp", "ep")]


def test_the_svg_is_well_formed_with_a_dot_per_layout(plans):
    doc, svg, _ = plans
    root = ElementTree.parse(svg).getroot()
    dots = root.findall(".//{http://www.w3.org/2000/svg}circle")
    assert root.tag.endswith("svg") and len(dots) == doc["tried"] > len(doc["fitting"])


def lines(chapter, world, *flags):
    return planner.chapter_lines(str(chapter), world, TINY + list(flags))


# What rank 0 holds, by hand for chapter 7 at 3 ranks: FSDP gives rank 0 ceil(rows / 3) rows of
# each parameter: the embedding 86 x 32, positions 11 x 32, per block 2 x 11 (ln1), 32 x 32 + 32
# (qkv), 11 x 32 + 11 (proj), 2 x 11 (ln2), 43 x 32 + 43, 11 x 128 + 11 (the MLP), the final norm
# 2 x 11: 2,752 + 352 + 2 x 4,301 + 22 = 11,728 of the 34,688; 16 B each is 0.18 MiB.
EXPECTED = {
    (7, 3, "--grad-sync", "last"): [
        "memory per rank (cpu): weights, gradients and AdamW state 0.18 MiB (11,728 of 34,688 "
        "parameters; DDP: 0.53 MiB); every parameter is sharded, the embeddings too",
        "--grad-sync last: every rank holds the whole gradients, 0.13 MiB, from the first "
        "micro-batch to the last; reduce-scattered once per step"],
    (7, 2): [
        "memory per rank (cpu): weights, gradients and AdamW state 0.26 MiB (17,344 of 34,688 "
        "parameters; DDP: 0.53 MiB); every parameter is sharded, the embeddings too",
        "--grad-sync every: gradients stay sharded between micro-batches; the 0.13 MiB of them "
        "reduce-scattered 2 times per step, unit by unit"],
    (8, 4, '--tp', '2'): [
        'memory per rank (cpu): weights, gradients and AdamW state 0.14 MiB (9,040 of 34,688 '
        'parameters; DDP: 0.53 MiB)',
        '--grad-sync every: gradients stay sharded between micro-batches; the 0.07 MiB of '
        'them reduce-scattered 2 times per step, unit by unit',
        'TP traffic per rank: 20 all-gathers and 20 reduce-scatters of 0.02 MiB per step, '
        '0.47 MiB sent (tp 2, sequence parallel on)'],
    (8, 2, '--tp', '2', '--sequence-parallel', 'off', '--grad-sync', 'last', '--amp', 'bf16'): [
        'memory per rank (cpu): weights, gradients and AdamW state 0.28 MiB (18,080 of 34,688 '
        'parameters; DDP: 0.53 MiB)',
        '--grad-sync last: every rank holds the whole gradients, 0.07 MiB, from the first '
        'micro-batch to the last; reduce-scattered once per step',
        'TP traffic per rank: 20 all-reduces of 0.01 MiB per step, 0.23 MiB sent (tp 2, '
        'sequence parallel off)'],
    (9, 4, '--pp', '2'): [
        'memory per rank (cpu): weights, gradients and AdamW state: stage 0 (embeddings, '
        'block 0) 0.17 MiB, 10,960 parameters; stage 1 (block 1, final norm and head) 0.16 '
        'MiB, 10,480 parameters (of 34,688; DDP: 0.53 MiB); inside a step also the weights '
        'gathered and the gradients whole: stage 0 0.17 MiB, stage 1 0.16 MiB, activations '
        'aside',
        'PP traffic per rank: 0.02 MiB of activations to the next stage and 0.02 MiB of their '
        'gradients back, per micro-batch (2 per step); the tied matrix: an all-reduce of 0.02 '
        'MiB per step between stage 0 and stage 1'],
    (9, 2, '--n-layer', '4', '--pp', '2', '--schedule', 'interleaved-1f1b',
     '--stages-per-rank', '2'): [
        'memory per rank (cpu): weights, gradients and AdamW state: stages 0, 2 (embeddings, '
        'blocks 0, 2) 0.53 MiB, 34,624 parameters; stages 1, 3 (blocks 1, 3, final norm and '
        'head) 0.51 MiB, 33,664 parameters (of 60,096; DDP: 0.92 MiB); inside a step also the '
        'weights gathered and the gradients whole: stages 0, 2 0.26 MiB, stages 1, 3 0.26 '
        "MiB, activations aside (at most: the interleaved schedule's order decides which "
        'stages overlap)',
        'PP traffic per rank: 0.05 MiB of activations to the next stage and 0.05 MiB of their '
        'gradients back, per micro-batch (2 per step); the tied matrix: an all-reduce of 0.03 '
        'MiB per step between stage 0 and stage 3; rank 0 sends one gradient fewer, the last '
        'rank one activation fewer'],
    (10, 2, '--cp', '2'): [
        'CP split: 4 chunks of 8 tokens, rank i of a row holds chunks i and 3 - i | attention '
        'pairs per rank: 50.0%, 50.0% (contiguous shares would give 25.8%, 74.2%) | sent per '
        'block and micro-batch: 0.07 MiB, K, V all-gathered in forward and backward and their '
        'fp32 gradients reduce-scattered',
        'memory per rank (cpu): weights, gradients and AdamW state 0.26 MiB (17,344 of 34,688 '
        'parameters; DDP: 0.53 MiB); every parameter is sharded, the embeddings too',
        '--grad-sync every: gradients stay sharded between micro-batches; the 0.13 MiB of '
        'them reduce-scattered 2 times per step, unit by unit'],
    (10, 4, '--cp', '4', '--cp-rotate', 'ring', '--grad-checkpointing', '--amp', 'bf16'): [
        'CP split: 8 chunks of 4 tokens, rank i of a row holds chunks i and 7 - i | attention '
        'pairs per rank: 25.0%, 25.0%, 25.0%, 25.0% (contiguous shares would give 6.8%, '
        '18.9%, 31.1%, 43.2%) | sent per block and micro-batch: 0.10 MiB, K, V in 9 ring '
        'passes and their fp32 gradients in 4',
        'memory per rank (cpu): weights, gradients and AdamW state 0.13 MiB (8,672 of 34,688 '
        'parameters; DDP: 0.53 MiB); every parameter is sharded, the embeddings too',
        '--grad-sync every: gradients stay sharded between micro-batches; the 0.13 MiB of '
        'them reduce-scattered 2 times per step, unit by unit'],
    (11, 4, '--pp', '2', '--cp', '1', '--tp', '2'): [
        'memory per rank (cpu): weights, gradients and AdamW state: stage 0 (embeddings, '
        'block 0) 0.18 MiB, 11,568 parameters; stage 1 (block 1, final norm and head) 0.16 '
        'MiB, 10,608 parameters (of 34,688; DDP: 0.53 MiB); inside a step also the weights '
        'gathered and the gradients whole: stage 0 0.10 MiB, stage 1 0.08 MiB, activations '
        'aside',
        'traffic per step, rank 0 (stage 0, 1 blocks): tp 0.234 MiB | cp 0.000 MiB | pp 0.039 '
        "MiB (tp: 10 collectives of 0.023 MiB; FSDP's gathers aside)"],
    (11, 4, '--pp', '1', '--cp', '2', '--tp', '2', '--sequence-parallel', 'off'): [
        'memory per rank (cpu): weights, gradients and AdamW state: stage 0 (embeddings, '
        'blocks 0-1, final norm and head) 0.14 MiB, 9,040 parameters (of 34,688; DDP: 0.53 '
        'MiB); inside a step also the weights gathered and the gradients whole: stage 0 0.07 '
        'MiB, activations aside',
        'traffic per step, rank 0 (stage 0, 2 blocks): tp 0.234 MiB | cp 0.141 MiB | pp 0.000 '
        "MiB (tp: 20 collectives of 0.012 MiB; FSDP's gathers aside)"],
    (12, 2, '--ep', '2'): [
        'experts 4 per block, 2 per token, each 64 wide: a token uses 8,384 of their 16,768 '
        'parameters (the dense MLP: 8,352) | rank 0 holds experts 0-1',
        'memory per rank (cpu): weights, gradients and AdamW state 0.40 MiB (25,888 of 51,776 '
        'parameters; DDP: 0.79 MiB); every parameter is sharded, the embeddings too, and each '
        'expert over its column',
        '--grad-sync every: gradients stay sharded between micro-batches; the 0.13 MiB of '
        'them reduce-scattered 2 times per step, unit by unit'],
    (12, 4, '--ep', '2', '--shared-expert', '--capacity-factor', '1.5',
     '--experts-per-token', '1'): [
        'experts 4 per block, 1 per token, each 128 wide: a token uses 8,352 of their 33,408 '
        'parameters (the dense MLP: 8,352) | rank 0 holds experts 0-1 | capacity 1.5: at most '
        "72 of a rank's 192 copies per expert, the rest dropped | a shared expert too: 16,704 "
        'parameters a token',
        'memory per rank (cpu): weights, gradients and AdamW state 0.39 MiB (25,440 of '
        '101,760 parameters; DDP: 1.55 MiB); every parameter is sharded, the embeddings too, '
        'and each expert over its column',
        '--grad-sync every: gradients stay sharded between micro-batches; the 0.26 MiB of '
        'them reduce-scattered 2 times per step, unit by unit'],
}
CONTROL = {7: 4, 8: 2, 9: 2, 10: 4, 11: 8, 12: 4}  # another world size: the numbers change


@pytest.mark.parametrize("case", sorted(EXPECTED), ids=lambda case: " ".join(map(str, case)))
def test_chapter_lines_are_the_numbers_each_chapter_prints(case):
    chapter, world, *flags = case
    assert lines(chapter, world, *flags) == EXPECTED[case]
    other = CONTROL[chapter] if CONTROL[chapter] != world else 2 * world
    assert lines(chapter, other, *flags) != EXPECTED[case]


def test_chapter_lines_refuse_sizes_that_do_not_divide():
    assert "--tp 2 does not divide the world size 3" in refused(
        ["--chapter-lines", "8", "--world-size", "3", "--", *TINY])
    assert "a chapter 7-12" in refused(["--chapter-lines", "5", "--world-size", "2"])
    assert "4 stages exceed --n-layer 2" in refused(
        ["--chapter-lines", "9", "--world-size", "2", "--", *TINY, "--schedule",
         "interleaved-1f1b", "--stages-per-rank", "2"])
    assert planner.chapter_lines("9", 2, TINY)  # the control: one stage a rank runs


def quoted(page, start):
    """The line of docs/PAGE that starts with `start`: what a real run printed, quoted there."""
    text = (REPO / "docs" / page).read_text()
    return next(line for line in text.splitlines() if line.startswith(start))


def test_chapter_lines_are_those_the_docs_quote_from_real_runs():
    memory, every = planner.chapter_lines("7", 2, ["--grad-accum", "4"])
    assert memory == quoted("fsdp.md", "memory per rank (cpu)")
    assert every == quoted("fsdp.md", "--grad-sync every")
    assert planner.chapter_lines("7", 2, ["--grad-accum", "4", "--grad-sync", "last"])[1] == \
        quoted("fsdp.md", "--grad-sync last")
    assert planner.chapter_lines("8", 2, [])[-1] == quoted("tp.md", "TP traffic per rank")
    assert planner.chapter_lines("9", 2, [])[1] == quoted("pp.md", "PP traffic per rank")
    assert planner.chapter_lines("10", 2, [])[0] == quoted("cp.md", "CP split")
    assert planner.chapter_lines("7", 4, [])[0] != memory  # the control: a quarter, not half


PAGES = ["4d.md", "pp.md", "cp.md", "tp.md", "fsdp.md", "moe.md", "planner.md"]
COMMAND = re.compile(r"^```bash\n(python plan_layout\.py .*?)^```\n\s*```\n(.*?)^```", re.M | re.S)
NUMBERS = re.compile(r"\d\s*(?:[KMGT]i?B|ms)\b|\d%")
MEASURED = "<!-- measured -->"


def planned(page_text):
    """(the commands of a planner block, the output block shown under it) of each block."""
    found = []
    for block in COMMAND.finditer(page_text):
        commands = block.group(1).replace("\\\n", " ").strip().splitlines()
        found.append((commands, block.group(2)))
    return found


def planner_output(commands):
    """What the commands print, one after another, each run in this process."""
    out = io.StringIO()
    for command in commands:
        with contextlib.redirect_stdout(out):
            assert planner.main(shlex.split(command)[2:]) == 0, command
    return out.getvalue()


def unmarked_tables(page_text):
    """The first line of each markdown table holding bytes, times or shares with no marker above."""
    lines, found = page_text.splitlines(), []
    for i, line in enumerate(lines):
        starts = line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))
        if not starts:
            continue
        body = "\n".join(itertools.takewhile(lambda row: row.startswith("|"), lines[i:]))
        if NUMBERS.search(body) and (i == 0 or lines[i - 1] != MEASURED):
            found.append(line)
    return found


@pytest.mark.parametrize("page", PAGES)
def test_the_docs_numbers_are_the_planners_output(page):
    text = (REPO / "docs" / page).read_text()
    blocks = planned(text)
    assert blocks, f"{page}: no planner command"
    for commands, shown in blocks:
        assert planner_output(commands) == shown, f"{page}: {commands}"
    assert not unmarked_tables(text), f"{page}: a table of numbers with no command nor marker"


def test_a_page_block_off_by_one_digit_and_an_unmarked_table_are_caught():
    text = (REPO / "docs" / "4d.md").read_text()
    commands, shown = planned(text)[0]
    digit = re.search(r"\d", shown)
    wrong = shown[:digit.start()] + str((int(digit.group()) + 1) % 10) + shown[digit.end():]
    assert planner_output(commands) == shown and planner_output(commands) != wrong
    table = "| model | state |\n|---|---|\n| 70B | 17.6 GB |\n"
    assert unmarked_tables("Per GPU:\n" + table) == ["| model | state |"]
    assert unmarked_tables(f"Per GPU:\n{MEASURED}\n" + table) == []
    assert unmarked_tables("| a | b |\n|---|---|\n| x | y |\n") == []  # no numbers: no marker


def test_the_readmes_real_output_is_the_planners():
    """README.md's chapter 13 output, a `$ python plan_layout.py ...` block, is what that command
    prints now (the control: the block without its last line is not)."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"^```\n\$ (python plan_layout\.py [^\n]*)\n(.*?)^```", readme, re.M | re.S)
    shown = block.group(2)
    assert planner_output([block.group(1)]) == shown
    commands = re.search(r"^## Chapter 13.*?^```bash\n(.*?)^```", readme, re.M | re.S).group(1)
    assert block.group(1) in commands  # the output's command is the one the section shows
    assert planner_output([block.group(1)]) != shown[:shown.rstrip("\n").rfind("\n") + 1]


# A model of the course's kind small enough to count by hand: 8 layers, 512 wide, 8 heads of 64,
# a 2,048-wide MLP, 1,024 tokens of vocabulary, sequences of 1,024, 64 sequences a step.
C, L, V, S = 512, 8, 1024, 1024
SMALL = ["--layers", L, "--width", C, "--heads", 8, "--mlp-width", 4 * C, "--mlp", "gelu",
         "--vocab", V, "--seq-len", S, "--tokens-per-step", 64 * S]
LAYER = 12 * C * C + 13 * C  # qkv and proj with biases (4C^2 + 4C), the MLP (8C^2 + 5C), 2 norms
WHOLE = L * LAYER + V * C + S * C + 2 * C  # the tied embedding once, positions, the final norm


def planned_parts(flags, layout):
    """(model, cluster, layout, its Parts by pp rank, micro-batches a step) of the planner."""
    args = planner.parse_args([str(f) for f in flags])
    m, c = planner.model_from(args), planner.cluster_from(args)
    lay = planner.parse_layout(layout, m, c)
    parts = {p.rank: p for p in planner.parts_of(m, lay.pp, lay.v, lay.tp)}
    return m, c, lay, parts, m.tokens_per_step // m.seq_len // lay.dp // lay.micro


def test_the_estimates_are_the_formulas_written_out_here():
    """One term at a time, against arithmetic written here for a small GPT (SMALL, 8 GPUs a node):
    the parameters; the bubble (pp - 1) / (V m + pp - 1); the micro-batches in flight on rank 0
    (GPipe m, 1F1B pp, interleaved pp + (pp - 1) / V) and on the last rank of an interleaved
    pipeline (pp - (pp - 1) / V); recomputation's 4/3 of a stage's FLOPs; FSDP's bytes at pp 1,
    (g - 1) / g of the parameters in bf16 twice and fp32 once a micro-batch; TP's 8 halves a
    layer and 2 for each end, (tp - 1) / tp of each; CP's K and V gathered twice in bf16 and
    their gradients in fp32; the tied gradient's all-reduce only under a pipeline; the logits
    split by tp; which groups cross nodes at 16 GPUs. The control: each formula with one term
    changed gives another number."""
    m, c, lay, parts, steps = planned_parts(SMALL + ["--gpus", 8], "pp=4,dp=2,micro=1")
    assert planner.total_params(m) == WHOLE and steps == 32
    for schedule, v, bubble in (("1f1b", 1, 3 / 35), ("gpipe", 1, 3 / 35),
                                ("interleaved-1f1b", 2, 3 / 67)):
        _, _, lay, _, _ = planned_parts(SMALL, f"pp=4,dp=2,schedule={schedule},v={v}")
        plan = planner.estimate(m, c, lay)
        assert plan["bubble"] == pytest.approx(bubble) and bubble != 3 / (32 * v), schedule
        held = {rank: planner.in_flight(lay, 32, rank) for rank in (0, 3)}
        assert held == {"1f1b": {0: 4, 3: 1}, "gpipe": {0: 32, 3: 32},
                        "interleaved-1f1b": {0: 4 + 3 / 2, 3: 4 - 3 / 2}}[schedule], held
    _, _, full, parts, _ = planned_parts(SMALL, "pp=4,dp=2,recompute=full")
    _, _, none, _, _ = planned_parts(SMALL, "pp=4,dp=2")
    middle = parts[1]  # no head: its layers alone
    assert (planner.compute_term(m, c, full, middle)[0]
            == pytest.approx(4 / 3 * planner.compute_term(m, c, none, middle)[0]))
    m, c, lay, parts, steps = planned_parts(SMALL + ["--gpus", 8], "dp=8,micro=1")
    sent = planner.group_bytes(m, lay, parts[0], steps)
    assert sent["dp"][0] == pytest.approx(7 / 8 * WHOLE * 8 * (2 + 2 + 4))  # 8 micro-batches
    assert sent["pp"][0] == 0 and sent["tp"][0] == 0 and sent["cp"][0] == 0
    m, c, lay, parts, steps = planned_parts(SMALL + ["--gpus", 8], "tp=2,cp=2,dp=2,micro=1")
    sent = planner.group_bytes(m, lay, parts[0], steps)
    stream = S // 2 * C * 2  # a cp rank's half of a sequence, bf16
    assert steps == 32 and sent["tp"][0] == pytest.approx(32 * (8 * L + 4) * stream / 2)
    kv = S // 2 * 2 * C * 2 / 2  # K and V of its tokens, bf16, its tp half of the heads
    assert sent["cp"][0] == pytest.approx(32 * L * 1 * kv * (2 + 2))  # 2 gathers, fp32 gradients
    logits = planner.logits_term(m, lay, parts[0])[0]
    assert logits == pytest.approx(S // 2 * V / 2 * (2 + 4))  # bf16 and the loss's fp32 copy
    m, c, lay, parts, steps = planned_parts(SMALL + ["--gpus", 8],
                                            "pp=2,tp=2,dp=2,micro=1,recompute=full")
    stream = S * C * 2  # a micro-batch's activations, bf16
    for rank in (0, 1):  # each end: 4 layers of 8 halves and 3 more recomputed, 2 for its end
        sent = planner.group_bytes(m, lay, parts[rank], steps)
        assert sent["tp"][0] == pytest.approx(32 * ((8 + 3) * 4 + 2) * stream / 2), rank
    kept = planner.activation_term(m, lay, parts[0], steps)[0] - S * parts[0].act_max
    assert kept == pytest.approx(2 * S * 4 * 2 * C / 2)  # 1F1B: 2 in flight, 4 inputs, tp's half
    _, _, lay, parts, steps = planned_parts(SMALL + ["--gpus", 8], "pp=2,dp=4,micro=1")
    first = V * C + S * C + 4 * LAYER  # the embeddings and 4 layers
    assert planner.group_bytes(m, lay, parts[0], steps)["dp"][0] == pytest.approx(
        3 / 4 * first * (2 + 4))  # once a step: gathered in bf16, reduce-scattered in fp32
    crossing = {}
    for gpus, layout in ((8, "tp=2,dp=4"), (16, "tp=2,dp=8"), (16, "tp=8,dp=2"),
                         (16, "pp=2,tp=8"), (16, "tp=4,cp=4")):
        _, cluster, lay, _, _ = planned_parts(SMALL + ["--gpus", gpus], layout)
        crossing[layout] = sorted(group for group, yes in planner.estimate(
            m, cluster, lay)["across_nodes"].items() if yes)
    assert crossing == {"tp=2,dp=4": [], "tp=2,dp=8": ["dp"], "tp=8,dp=2": ["dp"],
                        "pp=2,tp=8": ["pp"], "tp=4,cp=4": ["cp", "dp"]}, crossing  # FSDP: dp x cp


def test_fsdp_hides_behind_compute_alone():
    """The overlap model: FSDP's seconds hide behind the compute (all of it when it syncs every
    micro-batch, compute / m when deferred), not behind the tp collectives, which run one after
    the compute; 70B at tp 8 x dp 8, --efficiency 0.4: 79 s of FSDP against 74.4 s of compute.
    The control: hidden behind the busy time (compute and tp), the step would be shorter."""
    flags = ["--preset", "llama3-70b", "--gpus", "64", "--efficiency", "0.4"]
    for layout, hides in (("tp=8,dp=8", 1), ("tp=8,dp=8,sync=last", 64)):
        m, c, lay, _, steps = planned_parts(flags, layout)
        plan = planner.estimate(m, c, lay)
        compute, busy, dp = plan["seconds"]["compute"], plan["terms"][1]["busy"], \
            plan["seconds"]["dp"]
        assert steps == 64 and dp > compute / hides and busy > compute
        assert plan["step_s"] == pytest.approx(busy + dp - compute / hides), layout
        assert plan["step_s"] != pytest.approx(busy + max(0, dp - busy / hides))
    out = as_script(PLAN, flags + ["--layout", "tp=8,dp=8"]).stdout
    assert f"- {compute:,.3f} s: the step's compute, behind which" in out, out


def test_experts_send_and_count_as_written_out_here():
    """A mixture of 8 experts, 2 a token, each as wide as the MLP, at ep 4 within dp 8 (8 GPUs):
    the all-to-alls send each micro-batch's tokens' 2 copies, 4 times a layer (dispatch and
    combine, forward and backward), 6 with recomputation, (ep - 1) / ep of them; FSDP shards an
    expert over dp / ep ranks; MFU counts the 2 experts a token uses, not the 8 (16 experts give
    the same FLOPs). The control: without the copies, or over all dp ranks, the bytes differ."""
    flags = SMALL + ["--experts", 8, "--experts-per-token", 2, "--gpus", 8]
    m, c, lay, parts, steps = planned_parts(flags, "dp=8,ep=4,micro=1")
    expert = 2 * C * 4 * C + 4 * C + C  # one expert: the MLP's two matrices and biases
    assert steps == 8 and planner.total_params(m) == WHOLE + L * (7 * expert + 8 * C)  # routers
    sent = planner.group_bytes(m, lay, parts[0], steps)
    tokens = S * 2 * C * 2  # a micro-batch's 2 copies of each token, bf16
    assert sent["ep"][0] == pytest.approx(8 * L * 4 * tokens * 3 / 4)
    _, _, again, _, _ = planned_parts(flags, "dp=8,ep=4,micro=1,recompute=full")
    assert planner.group_bytes(m, again, parts[0], steps)["ep"][0] == pytest.approx(
        8 * L * 6 * tokens * 3 / 4)
    dense, experts = WHOLE + L * (8 * C - expert), L * 8 * expert  # the routers, not the MLP
    assert sent["dp"][0] == pytest.approx(8 * (2 + 2 + 4) * (  # edp = dp 8 / ep 4 = 2 ranks
        7 / 8 * dense + 1 / 2 * experts / 4))
    more = planner.model_from(planner.parse_args([str(f) for f in flags[:-6]] + [
        "--experts", "16", "--experts-per-token", "2"]))
    routers = 6 * L * 8 * C  # 8 more routers' FLOPs; no more experts a token
    assert planner.model_flops(more) - planner.model_flops(m) == routers


def test_a_gpu_run_of_a_chapter_counts_bf16_activations():
    """On a GPU a chapter's --amp auto means bf16: the TP traffic line's tensor is half the CPU's
    fp32 one at the same flags (the control: --amp off on the GPU gives the fp32 size)."""
    tensor = {}
    for name, extra in (("gpu", ["--device", "cuda"]), ("cpu", []),
                        ("gpu off", ["--device", "cuda", "--amp", "off"])):
        line = planner.chapter_lines("8", 2, TINY + ["--tp", "2", "--n-embd", "256",
                                                     "--batch-size", "16"] + extra)[-1]
        tensor[name] = float(re.search(r"of ([\d.]+) MiB per step", line).group(1))
    assert tensor["gpu"] * 2 == tensor["cpu"] == tensor["gpu off"] == 0.5, tensor
