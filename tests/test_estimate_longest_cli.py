"""``memfit estimate --maximize seq_len`` (issue 38): one line per lever tier, a table, ``--json``;
bad input in one sentence and exit code 2, no traceback."""

from __future__ import annotations

import pytest

import memfit
from memfit.budget import format_bytes
from memfit.cli.main import main
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.planning.longest_sequence import resize_sequence
from memfit.records.long_context import LongestEstimate

#: The built-in GPT, 2 x 32 wide, 1,024 positions, two rows; fp32 only.
GPT_ARGS = ["--set", "model.n_layer=2", "--set", "model.n_embd=32", "--set", "model.n_head=2"]
GPT_ARGS += ["--set", "model.block_size=1024", "--set", "train.batch_size=2", "--precision", "fp32"]
LONGEST = ["--maximize", "seq_len", "--grain", "128"]


def _smallest(tokens: int) -> int:
    """The smallest peak ``memfit.estimate`` predicts for that GPT's step at ``tokens`` tokens."""
    import torch

    x = torch.zeros(2, 16, dtype=torch.long)
    model = lambda: GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=1024))  # noqa: E731
    opt = lambda p: torch.optim.AdamW(p)  # noqa: E731
    est = memfit.estimate(model, resize_sequence((x, x), tokens), gpt_loss, opt, precisions=["fp32"])
    return min(e.peak_bytes for e in est.entries)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in captured.err, captured.err
    assert err[0].startswith("memfit estimate: error: ") and err[0].endswith("."), err[0]
    return err[0]


def test_one_line_per_tier_and_the_numbers_memfit_estimate_gives(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *GPT_ARGS, *LONGEST, "--device-memory", "3MiB", "--json"]) == 0
    found = LongestEstimate.from_json(capsys.readouterr().out)
    a = found.answers[0]
    assert a.tier == "no levers" and 0 < a.tokens < 1024 and a.next_tokens == a.tokens + 128
    assert a.peak_bytes == _smallest(a.tokens) <= 3 * 2**20 < _smallest(a.next_tokens) == a.next_peak_bytes
    assert main(["estimate", *GPT_ARGS, *LONGEST, "--device-memory", "3MiB"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == (
        f"longest sequence with no levers: {a.tokens:,} tokens, peak {format_bytes(a.peak_bytes)} "
        f"of 3.00 MiB; {a.next_tokens:,} tokens need {format_bytes(a.next_peak_bytes)}"
    )
    header = next(line for line in out if line.startswith("lever tier "))
    for column in ("longest", "strategy", "activations", "peak", "+1 grain", "its peak", "peak at"):
        assert column in header
    row = next(line for line in out if line.startswith("no levers "))
    assert f"{a.tokens:,}" in row and f"fp32 / {a.mode}" in row and row.endswith(a.event)
    assert not any(line.startswith("RESULT") for line in out)


def test_a_cap_stops_the_search_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", *GPT_ARGS, *LONGEST, "--max-seq-len", "200", "--device-memory", "1GiB"]
    assert main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("longest sequence with no levers: 128 tokens, peak ")
    assert last.endswith("; the search stops there (the cap of 200 tokens asked for)"), last


def test_seq_len_without_device_memory_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(["estimate", *GPT_ARGS, "--maximize", "seq_len"], capsys)
    assert "--maximize seq_len needs --device-memory" in err


def test_batch_size_is_not_an_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(["estimate", *GPT_ARGS, "--maximize", "batch_size", "--device-memory", "1GiB"], capsys)
    assert "takes seq_len only" in err and "memfit plan --maximize batch_size" in err


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--grain", "0"], "the grain must be a whole number of tokens"),
        (["--grain", "256", "--max-seq-len", "100"], "at least one grain (256)"),
    ],
)
def test_a_bad_grain_or_cap_is_refused(
    extra: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(
        ["estimate", *GPT_ARGS, "--maximize", "seq_len", "--device-memory", "1GiB", *extra], capsys
    )
    assert words in err


def test_a_grain_without_maximize_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(["estimate", *GPT_ARGS, "--grain", "128"], capsys)
    assert "--grain and --max-seq-len go with --maximize seq_len" in err


def test_a_model_without_a_sequence_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--set", "model.name=import:conftest:blockless_spec", "--maximize", "seq_len"]
    err = _refused([*argv, "--device-memory", "1GiB"], capsys)
    assert "grows the sequence of a batch of token ids" in err and "estimate it at its own shape" in err


def test_not_even_one_grain_says_the_smallest_step_and_what_to_raise(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _refused(["estimate", *GPT_ARGS, *LONGEST, "--device-memory", "100KiB"], capsys)
    least = format_bytes(_smallest(128))
    assert (
        f"not even one grain of 128 tokens fits in 100.00 KiB: the smallest predicted step there is {least}"
        in err
    )
    assert "raise the device memory, allow levers or give a smaller grain" in err


def test_a_position_table_shorter_than_the_grain_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", *GPT_ARGS, "--maximize", "seq_len", "--grain", "4096", "--device-memory", "1GiB"]
    err = _refused(argv, capsys)
    assert (
        "GPT takes at most 1,024 tokens (its config.block_size (1024)), less than one grain of 4,096" in err
    )
