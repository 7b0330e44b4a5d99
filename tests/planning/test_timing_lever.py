"""Whole steps timed with the loss head in chunks where no step without it fits the budget
(Note [timing with a lever] in memfit/measuring/timing_lever.py): a search's answer is planned with
``steps_within`` set, and its plain head's logits alone may be over the budget."""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from memfit.checkpointing import set_block_modes, uncheckpoint
from memfit.levers.head import chunked_head_of
from memfit.measuring.preserve import create_optimizer_state, preserved
from memfit.measuring.prices import TimedSteps, _moved_back
from memfit.measuring.profile import Profiler
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.planning.measure import _chunked_head, measure
from memfit.planning.request import Request, resolve_request
from memfit.precision import Precision
from memfit.records import HeadFacts
from memfit.step import training_step
from memfit.stepmodel import simulate

VOCAB, SEQ = 8192, 256


def _request(budget: int | str, levers: list[str] | None) -> Request:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, n_layer=2, n_embd=32, n_head=2, block_size=SEQ))
    x = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters())
    return resolve_request(model, (x, x), gpt_loss, budget, opt, "fp32", levers=levers)


def _full_peaks(request: Request) -> tuple[int, int]:
    """The fully checkpointed step's predicted peak with the plain head and with it chunked."""
    r = request
    with preserved(r.model, r.optimizer):
        create_optimizer_state(r.model, r.optimizer)
        prof = Profiler(r.model, r.batch, r.loss_fn, r.optimizer, Precision("fp32"), list(r.blocks))
        prof.none()
        prof.modes(["full"])
        plain = prof._memory_profile()
        lever = _chunked_head(r, "fp32", {})
        assert lever is not None
        return simulate(plain, "full").peak_bytes, simulate(lever.predict(plain), "full").peak_bytes


def _timed_line(lines: tuple[str, ...]) -> str:
    return next(line for line in lines if "timed step(s)" in line)


def test_a_budget_only_the_chunked_head_fits_times_steps_with_it_and_within_the_budget() -> None:
    plain_full, chunked_full = _full_peaks(_request("100%", ["chunked_loss"]))
    assert chunked_full < plain_full - 3 * SEQ * VOCAB  # the logits' copies are gone
    within = (plain_full + chunked_full) // 2
    request = dataclasses.replace(_request(within, ["chunked_loss"]), steps_within=within)
    found = measure(request)
    line = _timed_line(found.lines)
    assert "the loss head in chunks of" in line, line
    assert "the loss head in chunks" in (found.profiles["fp32"].speed.timed_as or "")  # type: ignore[union-attr]
    assert chunked_head_of(request.model) is None  # taken off after timing
    # the head's facts measured to make the lever are kept for the lever facts to reuse
    heads: dict[str, HeadFacts] = {}
    lever = _chunked_head(request, "fp32", heads)
    assert lever is not None and found.head["fp32"] == heads["fp32"]
    # the configuration timed, run again under MemTracker, keeps within the budget
    if "fully checkpointed" in line:
        set_block_modes(request.model, dict.fromkeys(request.blocks, "full"))
    with lever.applied(), MemTracker() as tracker:
        training_step(request.model, request.batch, gpt_loss, request.optimizer, Precision("fp32"))
    uncheckpoint(request.model)
    assert tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] <= within


def test_without_the_lever_allowed_the_same_budget_times_the_plain_head_in_the_room() -> None:
    plain_full, chunked_full = _full_peaks(_request("100%", None))
    within = (plain_full + chunked_full) // 2
    found = measure(dataclasses.replace(_request(within, None), steps_within=within))
    line = _timed_line(found.lines)
    assert "fully checkpointed (the plain step does not fit)" in line, line
    assert "in chunks" not in line and not found.head


def test_the_heads_gradient_work_timed_in_the_forward_is_moved_back() -> None:
    request = _request("100%", ["chunked_loss"])
    found = measure(request)
    prof = found.profiles["fp32"]
    counted = sum(p.forward_flops for p in [*prof.blocks, prof.outside])
    assert counted > 0
    steps = TimedSteps([(1.0, 2.0, 3.0)], "none", 1, "", moved_flops=float(counted))
    assert _moved_back(prof, steps, 1.0, 2.0) == (0.5, 2.5)  # half the forward was the head's gradient
    assert _moved_back(prof, steps._replace(moved_flops=0.0), 1.0, 2.0) == (1.0, 2.0)
