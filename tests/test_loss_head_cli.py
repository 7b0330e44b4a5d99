"""The loss head at the command line: its own rows in ``memfit profile`` and ``memfit estimate
--levers``, and ``memfit check --levers chunked_loss`` judging it against the plain head."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from memfit.cli.main import main

#: The built-in LLaMA with a 32k vocabulary: the head's logits dwarf the two small blocks.
LLAMA = ["--set", "model.name=import:memfit.models.llama:llama", "--set", "model.kwargs.vocab_size=32000"]
LLAMA += ["--set", "model.kwargs.block_size=64", "--set", "train.batch_size=2"]


def _head_rows(out: str) -> tuple[str, list[str]]:
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("loss head"))
    return lines[at], [lines[at + 2], lines[at + 3]]


def _kib(cell: str) -> float:
    value, unit = cell.split()
    return float(value) * {"B": 1 / 1024, "KiB": 1, "MiB": 1024, "GiB": 1024**2}[unit]


def test_profile_shows_the_head_plain_and_chunked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", *LLAMA, "--repeats", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    title, (plain, chunked) = _head_rows(out)
    # the smaller chunks the planner may choose, each on its own row, peaks falling with the chunk
    lines = out.splitlines()
    at = lines.index(chunked)
    smaller = lines[at + 1 : at + 4]
    assert [r.split("  ")[0] for r in smaller] == [
        "chunked_loss, 4 chunks of 32 tokens (predicted)",
        "chunked_loss, 16 chunks of 8 tokens (predicted)",
        "chunked_loss, 64 chunks of 2 tokens (measured)",
    ]
    peaks = [_kib(re.split(r"\s{2,}", row)[2]) for row in (chunked, *smaller)]
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0]
    assert "128 tokens x 32,000 vocabulary" in title
    # 262 tokens a chunk at a 32k vocabulary (32 MiB of fp32 logits): these 128 are one chunk
    assert plain.startswith("plain") and chunked.startswith("chunked_loss, 1 chunk of 128 tokens")
    keeps = [_kib(re.split(r"\s{2,}", row)[1]) for row in (plain, chunked)]
    # the plain head keeps the fp32 logits for its backward (128 x 32,000 x 4 B); the chunked
    # one the weight's gradient and the hidden states' (32,000 x 32 + 128 x 32, fp32)
    assert keeps[0] > 3 * keeps[1], (plain, chunked)


def test_estimate_with_levers_shows_the_head(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torchao")
    assert main(["estimate", *LLAMA, "--precision", "fp32", "--levers", "chunked_loss", "--quiet"]) == 0
    out = capsys.readouterr().out
    title, (_plain, chunked) = _head_rows(out)
    assert title.startswith("loss head, fp32 (128 tokens x 32,000 vocabulary)")
    assert chunked.startswith("chunked_loss, ")
    assert "smallest plan with levers chunked_loss" in out


def test_check_judges_the_chunked_head_against_the_plain_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = ["--set", "model.n_layer=1", "--set", "model.n_embd=16", "--set", "model.n_head=2"]
    tiny += ["--set", "model.block_size=8", "--set", "train.batch_size=2", "--set", "train.eval_batches=1"]
    tiny += ["--set", "data.max_bytes=200000"]
    args = ["check", *tiny, "--steps", "3", "--precisions", "fp32", "--levers", "chunked_loss"]
    code = main([*args, "--out", str(tmp_path), "--quiet"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "levers in the checked runs: chunked_loss (" in out  # against fp32 without the lever
    data = json.loads((tmp_path / "check.json").read_text())
    assert data["by_precision"]["fp32"]["verdict"] == "PASS"
