"""The chunked_loss lever's bytes: the step model's prediction against MemTracker's measurement.

The built-in GPT and LLaMA at a 16k vocabulary, where the head is most of the step: the
plain and the chunked step measured (MemTracker around memfit.step.training_step), the
chunked one predicted from the plain profile (memfit.stepmodel.with_levers), within 5%.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import memfit
from memfit.applying import apply, remove_levers, with_levers
from memfit.measuring.lever_facts import attach_lever_facts, head_facts
from memfit.measuring.preserve import create_optimizer_state, preserved
from memfit.measuring.profile import Profiler
from memfit.measuring.tracker import MemoryWatch
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.models.llama import llama
from memfit.planning.lever_sets import lever_sets
from memfit.precision import Precision
from memfit.records import Plan
from memfit.step import training_step
from memfit.stepmodel import simulate

VOCAB = 16384


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=64, vocab_size=VOCAB))
    return llama(preset="tiny", vocab_size=VOCAB, n_embd=64, block_size=64).model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, VOCAB, (6, 65), generator=torch.Generator().manual_seed(1))
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _measured(model: nn.Module, batch, opt: torch.optim.Optimizer, plan: Plan) -> tuple[int, torch.Tensor]:
    with preserved(model, opt):
        used = apply(model, plan, opt).optimizer
        create_optimizer_state(model, used)
        with MemoryWatch(model, used) as watch:
            loss = training_step(model, batch, gpt_loss, used, Precision("fp32"), plan.micro_batches).loss
        remove_levers(model, used)
    return watch.peak_bytes, loss


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_predicted_peak_of_the_chunked_head_within_5_percent(name: str, micro_batches: int) -> None:
    model, batch = _model(name), _batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with preserved(model, opt):
        profiler = Profiler(model, batch, gpt_loss, opt, Precision("fp32"))
        profiler.none()
        profile = attach_lever_facts(
            profiler.result(), model, opt, memfit.find_blocks(model), (batch, gpt_loss)
        )
    head = profile.lever_facts.head
    assert head is not None and not head.refused and head.tokens == 6 * 64 and head.vocab == VOCAB
    plain, _ = _measured(model, batch, opt, Plan(blocks={}, micro_batches=micro_batches))
    chunked, loss = _measured(
        model, batch, opt, Plan(blocks={}, micro_batches=micro_batches, levers=["chunked_loss"])
    )
    plain_predicted = simulate(profile, "none", micro_batches).peak_bytes
    predicted = simulate(with_levers(profile, ["chunked_loss"]), "none", micro_batches).peak_bytes
    print(
        f"{name} x{micro_batches}: plain measured {plain:,} predicted {plain_predicted:,}; chunked measured "
        f"{chunked:,} ({chunked / plain:.3f}x) predicted {predicted:,} ({predicted / chunked - 1:+.2%}); "
        f"head plain {head.plain}, chunked {head.chunked}"
    )
    assert math.isfinite(loss)
    assert chunked < 0.75 * plain  # the head was most of the step
    assert abs(predicted - chunked) <= 0.05 * chunked


def test_head_facts_refuse_a_loss_that_reads_the_logits() -> None:
    model, batch = _model("gpt"), _batch()

    def own_loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        logits = m(b[0])
        return nn.functional.cross_entropy(logits.flatten(0, 1), b[1].flatten())

    facts = head_facts(model, batch, own_loss, "fp32")
    assert facts is not None and "logits itself" in facts.refused
    assert head_facts(nn.Sequential(nn.Linear(2, 2)), batch, own_loss, "fp32") is None


def test_lever_sets_try_the_head_before_the_fused_step() -> None:
    assert lever_sets(["fused_step", "chunked_loss"]) == [
        [],
        ["chunked_loss"],
        ["fused_step"],
        ["fused_step", "chunked_loss"],
    ]
