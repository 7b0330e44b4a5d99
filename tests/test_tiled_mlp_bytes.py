"""The tiled MLP's bytes: measured on the MLP alone at the step's shape at every count of the
ladder (memfit.measuring.long_context), predicted at any count (memfit.stepmodel.tiled_mlp),
and the whole step's measured peak drops by the predicted bytes.

memfit's LLaMA (2 layers, 64 wide, intermediate 256) on one sequence of 1,024 tokens, where
the MLP's intermediate is the largest tensor of a block. Bytes are MemTracker's; nothing here
is a hand-made number except the synthetic block of the floor test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import memfit
from memfit.levers.tiled_mlp import install_tiled_mlp, remove_tiled_mlp
from memfit.measuring.fake_profile import memory_profile
from memfit.measuring.long_context import mlp_cost, tiled_mlp_facts
from memfit.measuring.preserve import create_optimizer_state, preserved
from memfit.measuring.tracker import MemoryWatch
from memfit.models.gpt import gpt_loss
from memfit.models.llama import llama
from memfit.precision import Precision
from memfit.records import BlockStats, Profile
from memfit.records.long_context import MlpCost, TiledMlpFacts
from memfit.step import training_step
from memfit.stepmodel import simulate
from memfit.stepmodel.tiled_mlp import floor_of, mlp_chunk_counts, mlp_cost_at, tiled_block, with_tiled_mlp

SEQ = 1024
#: the acceptance's bound on the predicted drop of the step's peak
DROP_TOLERANCE = 0.05
#: a count between two measured rungs is priced on their chord: over, never under, by at most this
BETWEEN_RUNGS = 0.10

Batch = tuple[torch.Tensor, torch.Tensor]


@pytest.fixture(scope="module")
def case() -> Iterator[tuple[nn.Module, Batch, torch.optim.Optimizer]]:
    torch.manual_seed(0)
    model = llama(preset="tiny", block_size=SEQ, n_embd=64, n_head=4).model
    x = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(1))
    yield model, (x, torch.roll(x, -1, 1)), torch.optim.AdamW(model.parameters(), lr=1e-3)


def _measured(
    model: nn.Module, batch: Batch, opt: torch.optim.Optimizer, prec: str, mode: str, chunks: int
) -> int:
    """MemTracker's peak of one whole steady-state step (optimizer state made)."""
    with preserved(model, opt):
        if mode != "none":
            memfit.checkpoint(model, mode=mode)
        if chunks > 1:
            install_tiled_mlp(model, chunks)
        create_optimizer_state(model, opt)
        with MemoryWatch(model, opt) as watch:
            training_step(model, batch, gpt_loss, opt, Precision(prec))  # type: ignore[arg-type]
        remove_tiled_mlp(model)
        memfit.uncheckpoint(model)
    return watch.peak_bytes


_PRICED: dict[str, tuple[TiledMlpFacts, Profile, Profile]] = {}


def _priced(
    model: nn.Module, batch: Batch, opt: torch.optim.Optimizer, prec: str
) -> tuple[TiledMlpFacts, Profile, Profile]:
    """The MLP's facts, the step profiled (fake tensors) and the floor: the step profiled with
    every MLP at the ladder's last count (once per precision)."""
    if prec not in _PRICED:
        facts = tiled_mlp_facts(model, batch, gpt_loss, prec)
        profile = memory_profile(model, batch, gpt_loss, opt, prec)
        install_tiled_mlp(model, facts.chunk_counts[-1])
        try:
            floor = memory_profile(model, batch, gpt_loss, opt, prec)
        finally:
            remove_tiled_mlp(model)
        _PRICED[prec] = facts, profile, floor
    return _PRICED[prec]


def test_the_mlp_is_measured_at_every_rung_of_the_ladder(case) -> None:
    model, batch, _ = case
    facts = tiled_mlp_facts(model, batch, gpt_loss, "fp32")
    assert facts.modules == ["blocks.0.mlp", "blocks.1.mlp"] and not facts.refused
    assert (facts.rows, facts.positions, facts.hidden) == (1, SEQ, 64)
    assert facts.chunk_counts == mlp_chunk_counts(SEQ) == [2, 4, 8, 16, 32, 64]
    plain = facts.plain["none"]
    # the plain MLP keeps its four sequence x 256 intermediates and its input (fp32); the tiled one its input
    assert plain.saved_bytes == 4 * SEQ * 256 * 4 + SEQ * 64 * 4
    assert [t["none"].saved_bytes for t in facts.tiled] == [SEQ * 64 * 4] * 6
    peaks = [t["full"].backward_peak_bytes for t in facts.tiled]
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < plain.backward_peak_bytes / 4


@pytest.mark.parametrize("chunks", [3, 6, 12, 100])
def test_a_count_off_the_ladder_is_over_predicted_by_little(case, chunks: int) -> None:
    model, batch, _ = case
    facts = tiled_mlp_facts(model, batch, gpt_loss, "fp32", modes=["full"])
    measured = mlp_cost(model.blocks[0].mlp, (1, SEQ, 64), torch.float32, "fp32", "full", chunks)
    predicted = mlp_cost_at(facts, chunks, "full")
    print(f"{chunks} chunks: measured {measured}, predicted {predicted}")
    for got, want in ((predicted.forward_peak_bytes, measured.forward_peak_bytes),
                      (predicted.backward_peak_bytes, measured.backward_peak_bytes)):  # fmt: skip
        assert want <= got <= (1 + BETWEEN_RUNGS) * want


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_the_steps_peak_drops_by_the_predicted_bytes(case, prec: str, mode: str) -> None:
    """Profiled without the tiled MLP (fake tensors), the MLP measured alone; the step measured
    with it at three chunk counts (two on the ladder, one off it)."""
    model, batch, opt = case
    facts, profile, floor = _priced(model, batch, opt, prec)
    plain = _measured(model, batch, opt, prec, mode, 1)
    assert simulate(profile, mode).peak_bytes == plain  # the step model's own check
    for chunks in (2, 8, 24):
        measured = plain - _measured(model, batch, opt, prec, mode, chunks)
        floored = dataclasses.replace(facts, floor=floor_of(floor))
        predicted = plain - simulate(with_tiled_mlp(profile, floored, chunks), mode).peak_bytes
        print(f"{prec} {mode} {chunks} chunks: the peak drops by {measured:,} B, predicted {predicted:,} B")
        assert measured > 0 and abs(predicted - measured) <= DROP_TOLERANCE * measured


def test_a_block_is_never_priced_below_the_floor() -> None:
    """Once the MLP is small another moment of the block holds its peak: the floor keeps it."""
    facts = TiledMlpFacts(
        modules=["b.mlp"], rows=1, positions=64, hidden=8,
        plain={"full": MlpCost(0, 1000, 3000, 0)}, chunk_counts=[2],
        tiled=[{"full": MlpCost(0, 100, 300, 0)}],
    )  # fmt: skip
    block = BlockStats("b", saved_bytes={"full": 10}, forward_peak_bytes={"full": 1500},
                       backward_peak_bytes={"full": 5000}, held_bytes={"full": 10})  # fmt: skip
    floor = BlockStats("b", saved_bytes={"full": 10}, forward_peak_bytes={"full": 800},
                       backward_peak_bytes={"full": 1000}, held_bytes={"full": 10})  # fmt: skip
    alone = tiled_block(block, facts, 2)
    assert (alone.forward_peak_bytes, alone.backward_peak_bytes) == ({"full": 600}, {"full": 2300})
    prof = Profile("fp32", "cpu", 1, [floor], BlockStats("outside"), 0, 0, 0, 0)
    bounded = tiled_block(block, dataclasses.replace(facts, floor=floor_of(prof)), 2)
    assert (bounded.forward_peak_bytes, bounded.backward_peak_bytes) == ({"full": 800}, {"full": 2300})
    assert tiled_block(block, facts, 1) == block  # one chunk: the plain MLP


def test_refusals_say_why_in_one_sentence(case) -> None:
    model, batch, _ = case
    facts = tiled_mlp_facts(
        nn.Sequential(nn.Linear(4, 4)), torch.zeros(2, 4), lambda m, b: m(b).sum(), "fp32"
    )
    assert facts.refused.startswith("found no repeated blocks in Sequential, so no MLP to tile")
    never = tiled_mlp_facts(model, batch, lambda m, b: m.tok_emb(b[0]).sum(), "fp32")
    assert never.refused == "the loss function never called it, so there is no sequence to tile."
    profile = Profile("fp32", "cpu", 1, [], BlockStats("outside"), 0, 0, 0, 0)
    assert with_tiled_mlp(profile, never, 8) is profile


@pytest.mark.parametrize("n_layer", [2, 4])
def test_an_estimate_carries_the_floor_the_tiled_step_profiles(n_layer: int) -> None:
    """``memfit estimate`` (fake tensors only) measures the floor as the planner does: each
    block's numbers with every MLP at the ladder's last count, equal to a profile of the step
    with the MLPs tiled. With 4 identical blocks the estimate runs the first and last only (the
    floor too: at Llama 8B's 32 layers every block run made each length probe take minutes)."""
    from memfit.measuring.estimate import estimate

    def build() -> nn.Module:
        torch.manual_seed(0)
        return llama(preset="tiny", n_layer=n_layer, block_size=2048, vocab_size=64).model

    x = torch.randint(0, 64, (1, 2048), generator=torch.Generator().manual_seed(1))
    batch = (x, torch.roll(x, -1, 1))
    est = estimate(build, batch, gpt_loss, torch.optim.AdamW, precisions=["fp32"], levers=["tiled_mlp"])
    facts = est.profiles["fp32"].lever_facts.tiled_mlp  # type: ignore[union-attr]
    assert facts is not None and facts.chunk_counts[-1] == 64
    model = build()
    install_tiled_mlp(model, 64)
    tiled = memory_profile(model, batch, gpt_loss, torch.optim.AdamW(model.parameters()), "fp32")
    assert facts.floor == floor_of(tiled)
