"""The longest sequence an estimate fits (issue 38): :func:`memfit.planning.longest_estimate.longest_estimate`
on fake tensors, for each lever tier; its answer checked against ``memfit.estimate`` at the answer and
one grain more; the search's probes; bad input in one sentence."""

from __future__ import annotations

import pytest
import torch
from conftest import mse_loss, vector_batch

import memfit
import memfit.stepmodel
from memfit.errors import ConfigError, InfeasibleBudget
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.models.llama import llama
from memfit.planning.longest_estimate import SequenceSearch, TierStep, longest_estimate
from memfit.planning.longest_sequence import resize_sequence
from memfit.records import BREAKDOWN_KEYS, Profile
from memfit.records.long_context import LongestEstimate

MiB = 2**20


def _gpt() -> GPT:
    return GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=2048))


def _adamw(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)  # type: ignore[arg-type]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    return x, x


def _smallest(tokens: int) -> int:
    """The smallest peak ``memfit.estimate`` predicts for the GPT step at ``tokens`` tokens."""
    est = memfit.estimate(_gpt, resize_sequence(_batch(), tokens), gpt_loss, _adamw, precisions=["fp32"])
    return min(e.peak_bytes for e in est.entries)


def _profile(tokens: int) -> Profile:
    est = memfit.estimate(_gpt, resize_sequence(_batch(), tokens), gpt_loss, _adamw, precisions=["fp32"])
    return est.profiles["fp32"]


def _one_sentence(message: str) -> None:
    assert message.endswith(".") and "\n" not in message and ". " not in message, message


def test_the_answer_fits_and_one_grain_more_does_not_per_memfit_estimate() -> None:
    found = longest_estimate(
        _gpt, _batch(), gpt_loss, _adamw, device_memory="3MiB", precisions=["fp32"], grain=128
    )
    assert [a.tier for a in found.answers] == ["no levers"]
    a = found.answers[0]
    assert 0 < a.tokens < 2048 and a.tokens % 128 == 0 and a.next_tokens == a.tokens + 128
    assert (found.batch_size, found.grain, found.longest) == (2, 128, 2048)
    assert a.peak_bytes == _smallest(a.tokens) <= 3 * MiB < _smallest(a.next_tokens) == a.next_peak_bytes
    assert sum(a.breakdown[k] for k in BREAKDOWN_KEYS) == a.peak_bytes
    assert a.precision == "fp32" and a.mode in ("none", "selective", "full") and a.levers == []
    assert a.event in {label for label, _ in memfit.stepmodel.simulate(_profile(a.tokens), a.mode).timeline}
    assert a.tokens in found.probes and a.next_tokens in found.probes
    assert len(found.probe_seconds) == len(found.probes) and all(s > 0 for s in found.probe_seconds)
    assert LongestEstimate.from_json(found.to_json()) == found


class _Linear(SequenceSearch):
    """The search over a made-up step whose peak grows by ``slope`` bytes a grain."""

    slope = 1000

    def at(self, grains: int) -> dict[str, TierStep]:
        if self.last is None:  # one real probe: the record's model, parameters and assumptions
            super().at(1)
            self.steps.clear()
            self.seconds.clear()
        if grains not in self.steps:
            self.seconds[grains] = 0.0
            self.steps[grains] = {t: TierStep(self.slope * grains, [], "fp32", "full") for t in self.tiers}
        return self.steps[grains]


def test_the_search_gallops_then_bisects_to_neighbours_and_shares_its_probes() -> None:
    search = _Linear(_gpt, _batch(), gpt_loss, _adamw, grain=16)  # 2048 / 16 = 128 grains at most
    found = search.longest_sequence(37_500)  # 37 grains fit
    a = found.answers[0]
    assert (a.tokens, a.next_tokens, a.peak_bytes, a.next_peak_bytes) == (37 * 16, 38 * 16, 37_000, 38_000)
    # gallop 1, 2, 4, ..., 64, then bisect between 32 and 64
    assert [p // 16 for p in found.probes[:7]] == [1, 2, 4, 8, 16, 32, 64]
    assert len(found.probes) <= 7 + 5
    again = search.longest_sequence(20_500)  # 20 grains: bracketed by the probes already made
    assert again.answers[0].tokens == 20 * 16 and len(again.probes) <= len(found.probes) + 4
    top = search.longest_sequence(10**9).answers[0]
    assert (top.tokens, top.next_tokens, top.limit) == (2048, 0, "its config.block_size (2048)")


@pytest.mark.slow
def test_each_tier_answers_and_more_levers_reach_further() -> None:
    def model() -> torch.nn.Module:
        return llama(preset="tiny", vocab_size=8192, n_layer=4, n_embd=64, n_head=2, block_size=4096).model

    x = llama(preset="tiny", block_size=4096).random_batch(1, seed=0)
    found = longest_estimate(
        model, x, gpt_loss, _adamw, device_memory="48MiB", precisions=["fp32"],
        levers="chunked_loss,offload", grain=512,
    )  # fmt: skip
    none, levers, offload = found.answers
    assert (none.tier, levers.tier, offload.tier) == ("no levers", "levers", "levers and offload")
    assert levers.allowed == ["chunked_loss"] and offload.allowed == ["offload", "chunked_loss"]
    # the full head's logits do not fit one grain; the chunked head's do
    assert none.tokens == 0 and none.next_tokens == 512 and none.next_peak_bytes > 48 * MiB
    assert 0 < levers.tokens <= offload.tokens and levers.levers == ["chunked_loss"]
    for a in (levers, offload):
        assert a.peak_bytes <= 48 * MiB < a.next_peak_bytes or a.next_tokens == 0
        assert sum(a.breakdown[k] for k in BREAKDOWN_KEYS) == a.peak_bytes and a.event
    # offload takes the blocks' checkpointed inputs off the device: less at the same length, or longer
    assert offload.levers == ["offload", "chunked_loss"] and offload.host_bytes > 0
    assert offload.peak_bytes < levers.peak_bytes or offload.tokens > levers.tokens
    assert found.refused == {}


def test_a_batch_without_a_sequence_is_refused_in_one_sentence() -> None:
    model = lambda: torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))  # noqa: E731
    with pytest.raises(
        ConfigError, match=r"batch of token ids .*: estimate it at its own shape instead\."
    ) as info:
        longest_estimate(model, vector_batch(), mse_loss, device_memory="1GiB")
    _one_sentence(str(info.value))


@pytest.mark.parametrize(
    ("grain", "cap", "match"),
    [(0, None, "the grain must be a whole number"), (2.5, None, "the grain"), (64, 32, "at least one grain")],
)
def test_a_bad_grain_or_cap_is_refused(grain: int, cap: int | None, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        longest_estimate(_gpt, _batch(), gpt_loss, device_memory="1GiB", grain=grain, max_seq_len=cap)
    _one_sentence(str(info.value))


def test_a_position_table_shorter_than_a_grain_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"GPT takes at most 2,048 tokens \(its config.block_size") as info:
        longest_estimate(_gpt, _batch(), gpt_loss, device_memory="1GiB", grain=4096)
    _one_sentence(str(info.value))


def test_a_cap_ends_the_search() -> None:
    found = longest_estimate(
        _gpt,
        _batch(),
        gpt_loss,
        _adamw,
        device_memory="1GiB",
        precisions=["fp32"],
        grain=128,
        max_seq_len=300,
    )
    a = found.answers[0]
    assert (a.tokens, a.next_tokens, a.limit) == (256, 0, "the cap of 300 tokens asked for")
    assert a.peak_bytes == _smallest(256) and found.longest == 256


def test_not_even_one_grain_names_the_smallest_step() -> None:
    with pytest.raises(
        InfeasibleBudget, match=r"not even one grain of 128 tokens fits in 100.00 KiB"
    ) as info:
        longest_estimate(
            _gpt, _batch(), gpt_loss, _adamw, device_memory=100 * 1024, precisions=["fp32"], grain=128
        )
    _one_sentence(str(info.value))
    assert info.value.minimum_bytes == _smallest(128) and info.value.budget_bytes == 100 * 1024
    assert "raise the device memory, allow levers or give a smaller grain" in str(info.value)
