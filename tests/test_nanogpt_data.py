"""Chapter 3 with nanoGPT's data folders (`data/<name>/`: train.bin and val.bin of uint16 ids, and for
character-level sets meta.pkl with vocab_size, stoi and itos), written here in nanoGPT's own format.
These tests prove:

1. `--data DIR` trains on train.bin, validates on val.bin (not a split of train.bin), takes the
   vocabulary size from meta.pkl, and the checkpoint samples text through itos and stoi, in one
   plain process; a folder without meta.pkl takes --vocab-size;
2. meta.pkl is never executed: a pickle that would run a command is refused in one line (exit code
   2: an InputError) and the command never runs; anything but plain dicts, strings and ints is refused too;
3. a folder without its .bin files, ids beyond the vocabulary, and a prompt with characters the
   vocabulary lacks are one line each.
"""
import os
import pickle
import re

import numpy as np
import pytest
from helpers import GPT, TINY_GPT, in_process, trainer

gpt = trainer(GPT)
TEXT = "the quick brown fox jumps over the lazy dog.\n" * 400


def nanogpt_folder(folder, text=TEXT, meta=True):
    """What nanoGPT's data/shakespeare_char/prepare.py writes, for `text`: 90% train, 10% val."""
    folder.mkdir(parents=True, exist_ok=True)
    chars = sorted(set(text))
    stoi, itos = {c: i for i, c in enumerate(chars)}, dict(enumerate(chars))
    n = int(0.9 * len(text))
    for name, part in (("train.bin", text[:n]), ("val.bin", text[n:])):
        np.array([stoi[c] for c in part], dtype=np.uint16).tofile(folder / name)
    if meta:
        with open(folder / "meta.pkl", "wb") as f:
            pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
    return folder


def test_a_nanogpt_folder_trains_validates_on_its_own_file_and_samples_text(tmp_path):
    data, ckpt = nanogpt_folder(tmp_path / "fox"), tmp_path / "fox.pt"
    out = in_process(GPT, TINY_GPT + ["--data", data, "--max-steps", 3, "--save", ckpt])
    n_train, n_val = (os.path.getsize(data / name) // 2 for name in ("train.bin", "val.bin"))
    assert f"{n_train:,} train / {n_val:,} val tokens | vocab {len(set(TEXT))} |" in out
    sampled = in_process(GPT, ["--sample", "--ckpt", ckpt, "--prompt", "the ", "--max-new-tokens",
                               40, "--device", "cpu"])
    assert sampled.startswith("the ") and set(sampled.strip()) <= set(TEXT), sampled
    with pytest.raises(gpt.InputError, match=r"--prompt has characters the vocabulary lacks: "
                                             r"\['Q', 'Z'\]"):
        in_process(GPT, ["--sample", "--ckpt", ckpt, "--prompt", "ZQ", "--device", "cpu"])


def test_a_folder_without_meta_takes_the_vocab_size_flag(tmp_path):
    data = nanogpt_folder(tmp_path / "ids", meta=False)
    with pytest.raises(gpt.InputError, match="has no meta.pkl: give --vocab-size"):
        in_process(GPT, TINY_GPT + ["--data", data, "--max-steps", 1, "--save", ""])
    out = in_process(GPT, TINY_GPT + ["--data", data, "--vocab-size", 64, "--max-steps", 1,
                                      "--save", ""])
    assert "| vocab 64 |" in out
    with pytest.raises(gpt.InputError, match=r"train.bin holds token id \d+, not below the "
                                             r"vocabulary size 5 \(--vocab-size\)"):
        in_process(GPT, TINY_GPT + ["--data", data, "--vocab-size", 5, "--max-steps", 1])


class RunsACommand:
    """Unpickling this calls os.system: what a hostile meta.pkl would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_meta_pkl_is_never_executed(tmp_path):
    data, marker = nanogpt_folder(tmp_path / "evil"), tmp_path / "it-ran"
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 30, "itos": RunsACommand(marker)}, f)
    with pytest.raises(gpt.InputError) as err:
        in_process(GPT, TINY_GPT + ["--data", data, "--max-steps", 1])
    assert not marker.exists()
    assert re.fullmatch(r"cannot read \S+meta\.pkl: UnpicklingError: it asks for "
                        r"(posix|os)\.system, not plain data", str(err.value)), str(err.value)
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 30, "itos": {0: b"bytes are not text"}}, f)
    with pytest.raises(gpt.InputError, match="not a nanoGPT meta.pkl of plain dicts"):
        in_process(GPT, TINY_GPT + ["--data", data, "--max-steps", 1])


def test_a_folder_without_its_bin_files_is_one_line(tmp_path):
    data = nanogpt_folder(tmp_path / "half")
    (data / "val.bin").unlink()
    with pytest.raises(gpt.InputError, match=r"is a folder but holds no \S+val\.bin$"):
        in_process(GPT, TINY_GPT + ["--data", data, "--max-steps", 1])
