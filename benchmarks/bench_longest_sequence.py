"""``memfit.plan(..., maximize="seq_len")`` on issue 38's acceptance model at 512 MiB.

The model of ``bench_long_context.py`` (``transformers.LlamaConfig``: 2 layers, hidden 256,
intermediate 688, 4 heads, 32,000-token vocabulary, untied head; fp32 AdamW, batch 1, its own
``labels=`` loss), as it is and wrapped in a peft LoRA adapter (r=16 on the attention and MLP
projections). memfit searches the longest sequence with ``levers="all"``; the answer's plan is
applied with ``memfit.prepare`` and one steady-state step measured around with MemTracker.

Then, side by side in this process (medians of ``--steps`` steps after one to warm up; ratios):
the planned step against the plain step (no checkpointing, no levers) at the answer's length
where the plain step's fake-tensor peak is under ``PLAIN_ROOM``; and Hugging Face's
``gradient_checkpointing_enable()`` step against the plain step at ``--hf-seq`` tokens (its
longest steady-state step under the budget, ``bench_long_context.py``). Exactness at
``--hf-seq`` tokens (a length both fit): the answer's plan with the levers that change the
forward and backward (checkpointing, ``tiled_mlp``, ``chunked_loss``; the optimizer's levers
change only its step and have tests of their own) against the plain step, loss and every
gradient within ``EXACT``.

Last, the answer's plan against the plain step at ``--also-at`` lengths (where the plain step
runs; interleaved rounds). ``--plan-json FILE`` (a ``PLAN`` line saved) times a known answer so,
without planning. ``--without tiled_mlp`` plans with ``levers="all"`` less the levers named: the
lever set memfit had before issue 38 (its "before" figure, priced and measured the same way).

Run: ``HF_HUB_OFFLINE=1 .venv-extras/bin/python benchmarks/bench_longest_sequence.py [--lora]``
(prints ``MEASURED``, ``PLAN`` and ``RESULT {json}`` lines).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_long_context import BUDGET, _hf_step, _lora, _loss, _model, _tokens, _tracked

import memfit
from memfit import progress
from memfit.applying.registry import allowed_levers, site_of
from memfit.devices import model_device
from memfit.records import Plan

#: Loss and gradients of the plan's forward and backward against the plain step's.
EXACT = {"rtol": 1e-4, "atol": 1e-6}
#: The plain step is timed at the answer's length only where its predicted peak is below this.
PLAIN_ROOM = 8 * 2**30
#: Levers that change the forward and backward (the rest change only the optimizer's step).
FORWARD_LEVERS = ("tiled_mlp", "chunked_loss")


def _seconds(step: Any, steps: int) -> float:
    """Median seconds of ``steps`` calls of ``step`` after one to warm up."""
    step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _plain_seconds(model: torch.nn.Module, seq: int, steps: int, hf: bool = False) -> float:
    """Median seconds of the plain step (or Hugging Face's checkpointed one) of a copy of ``model``."""
    plain = copy.deepcopy(model)
    if hf:
        plain.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(_trainable(plain), lr=1e-4)
    return _seconds(_hf_step(plain, opt, _tokens(seq)), steps)


def _exact(model: torch.nn.Module, plan: Plan, seq: int) -> float:
    """The plan's forward and backward against the plain one at ``seq`` tokens: asserts
    ``EXACT``; returns the largest share of the tolerance a difference used (at most 1)."""
    keep = [n for n in plan.levers if n in FORWARD_LEVERS]
    settings = {n: s for n, s in plan.lever_settings.items() if n in keep}
    forward_plan = dataclasses.replace(plan, levers=keep, lever_settings=settings)
    plain, planned = copy.deepcopy(model), memfit.apply(copy.deepcopy(model), forward_plan).model
    x = _tokens(seq)
    pairs = [(_loss(planned, x), _loss(plain, x))]
    pairs[0][0].backward()
    pairs[0][1].backward()
    pairs += [(a.grad, b.grad) for a, b in zip(_trainable(planned), _trainable(plain), strict=True)]
    worst = 0.0
    for got, want in pairs:
        torch.testing.assert_close(got, want, **EXACT)
        used = (got - want).abs() / (EXACT["atol"] + EXACT["rtol"] * want.abs())
        worst = max(worst, float(used.max()))
    return worst


def _timings(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    plan: Plan,
    x: torch.Tensor,
    opt: Any,
    hf_seq: int,
    steps: int,
) -> dict[str, float]:
    """Step seconds and ratios: the plan against the plain step (of ``reference``, the model
    before planning) at its length, Hugging Face's checkpointing against the plain step at ``hf_seq``."""
    out = {"planned_s": _seconds(lambda: memfit.train_step(model, x, _loss, opt, plan), steps)}
    if plan.report.baseline_peak_bytes <= PLAIN_ROOM:
        out["plain_at_answer_s"] = _plain_seconds(reference, x.shape[1], steps)
        out["planned_over_plain"] = out["planned_s"] / out["plain_at_answer_s"]
    try:
        out["hf_s"] = _plain_seconds(reference, hf_seq, steps, hf=True)
    except (AttributeError, RuntimeError, ValueError) as exc:  # a wrapper without it: said, not timed
        print(f"Hugging Face checkpointing not timed: {exc}", flush=True)
        return out
    out["plain_at_hf_s"] = _plain_seconds(reference, hf_seq, steps)
    out["hf_over_plain"] = out["hf_s"] / out["plain_at_hf_s"]
    return out


def _at_lengths(
    reference: torch.nn.Module, plan: Plan, lengths: list[int], rounds: int
) -> list[dict[str, Any]]:
    """The plan (as chosen for its own length) against the plain step at each of ``lengths``
    where both run: ``rounds`` interleaved rounds after one each to warm up, medians."""
    out = []
    for seq in lengths:
        x = _tokens(seq)
        plain = copy.deepcopy(reference)
        plain_opt = torch.optim.AdamW(_trainable(plain), lr=1e-4)
        planned = copy.deepcopy(reference)
        planned, opt = memfit.prepare(planned, torch.optim.AdamW(_trainable(planned), lr=1e-4), plan)
        steps = {
            "plain": _hf_step(plain, plain_opt, x),
            "planned": functools.partial(memfit.train_step, planned, x, _loss, opt, plan),
        }
        times: dict[str, list[float]] = {k: [] for k in steps}
        for step in steps.values():
            step()
        for _ in range(rounds):
            for name, step in steps.items():
                started = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - started)
        med = {k: statistics.median(v) for k, v in times.items()}
        out.append(
            {
                "seq": seq,
                "plain_s": med["plain"],
                "planned_s": med["planned"],
                "ratio": med["planned"] / med["plain"],
            }
        )
        print("AT " + json.dumps(out[-1]), flush=True)
    return out


def _levers(model: torch.nn.Module, opt: torch.optim.Optimizer, without: str) -> str | list[str]:
    """``"all"``, or where ``without`` names levers, those of ``"all"`` that can run here less them."""
    left_out = {n for n in without.split(",") if n}
    if not left_out:
        return "all"
    site = site_of(model_device(model), opt, "fp32", model)
    return [n for n in allowed_levers("all", site)[0] if n not in left_out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--start", type=int, default=512, help="the batch's own length")
    parser.add_argument("--hf-seq", type=int, default=768, help="Hugging Face's longest steady-state step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up)")
    parser.add_argument("--seq", type=int, help="plan this length (no search): to time a known answer again")
    parser.add_argument(
        "--also-at", default="768,4096", help="lengths to time the answer's plan against plain"
    )
    parser.add_argument("--plan-json", help="a plan saved by an earlier run: time it at --also-at only")
    parser.add_argument("--without", default="", help='levers left out of levers="all" (comma-separated)')
    args = parser.parse_args()
    progress.configure(quiet=False)  # the search's phases on stderr, in a log too
    torch.set_num_threads(1)
    model = _model()
    if args.lora:
        model = _lora(model)
    reference = copy.deepcopy(model)
    also_at = [int(n) for n in args.also_at.split(",") if n]
    if args.plan_json:
        _at_lengths(reference, Plan.from_json(Path(args.plan_json).read_text()), also_at, args.steps + 2)
        return
    opt = torch.optim.AdamW(_trainable(model), lr=1e-4)
    levers = _levers(model, opt, args.without)
    started = time.perf_counter()
    if args.seq:  # one length, planned as memfit.plan plans it (no search)
        plan = memfit.plan(model, _tokens(args.seq), _loss, BUDGET, opt, "fp32", levers=levers)
        plan = dataclasses.replace(plan, seq_len=args.seq)
    else:
        plan = memfit.plan(
            model, _tokens(args.start), _loss, BUDGET, opt, "fp32", levers=levers, maximize="seq_len"
        )
    planned = time.perf_counter() - started
    x = _tokens(plan.seq_len)
    model, opt = memfit.prepare(model, opt, plan)
    memfit.train_step(model, x, _loss, opt, plan)
    loss, peak, split = _tracked(model, opt, lambda: memfit.train_step(model, x, _loss, opt, plan))
    out: dict[str, Any] = {
        "lora": args.lora, "seq_len": plan.seq_len, "peak": peak, "budget": BUDGET, "split": split,
        "predicted": plan.predicted_peak_bytes, "measured_when_planned": plan.measured_peak_bytes,
        "levers": plan.levers, "settings": plan.lever_settings, "modes": sorted(set(plan.blocks.values())),
        "notes": plan.notes[-1], "planning_seconds": planned, "loss": loss,
        "baseline_at_answer": plan.report.baseline_peak_bytes,
    }  # fmt: skip
    print("MEASURED " + json.dumps(out), flush=True)
    out["exact_tolerance_used"] = _exact(reference, plan, args.hf_seq)
    out.update(_timings(model, reference, plan, x, opt, args.hf_seq, args.steps))
    print("PLAN " + plan.to_json(indent=None), flush=True)
    print("RESULT " + json.dumps(out), flush=True)
    out["at"] = _at_lengths(reference, plan, also_at, args.steps + 2)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
