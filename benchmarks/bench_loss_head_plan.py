"""A Qwen2-style decoder with a 152k vocabulary planned under a budget the head alone breaks.

Issue 24's case: ``transformers.Qwen2Config`` with a 151,936-token vocabulary, tied
embeddings, hidden 256, 4 layers (every other field at its default), batch 2 x 512, trained
through its own ``labels=`` loss in fp32 with AdamW. The plain step is profiled, then
``memfit.plan`` is asked for 0.50x of its peak with the loss head as the only lever and for
0.30x with ``levers="all"``; each plan is applied with ``memfit.prepare`` and its second step
(optimizer state made) is measured with PyTorch's own MemTracker around
``memfit.train_step``, its first loss compared with the plain model's.

Run (about 15 minutes on a 2-core CPU): ``TORCHDYNAMO_DISABLE=1 .venv-extras/bin/python
benchmarks/bench_loss_head_plan.py`` (torchao's compiled step runs eagerly, as MemTracker
sees it). With ``MEMFIT_BENCH_PROFILE=FILE`` the plain profile is written there, or read from
there when it exists (it takes most of the time).
"""

from __future__ import annotations

import copy
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.distributed._tools.mem_tracker import MemTracker

import memfit
from memfit.records import Profile

VOCAB, SEQ, BATCH = 151936, 512, 2


def _model() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg).train()


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def _tracked_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, plan: memfit.Plan
) -> tuple[float, int]:
    """The first loss, then MemTracker's peak of the second step (steady state)."""
    first = float(memfit.train_step(model, batch, _loss, opt, plan))
    tracker = MemTracker()
    tracker.track_external(model, opt)

    def next_micro_batch(module: torch.nn.Module, args: object) -> None:
        # MemTracker takes a second forward of the root module for a new iteration; with
        # micro-batches it is the same step's next one: clear its per-module statistics
        if module is model and module in tracker.memory_tracking and not tracker._mod_tracker.is_bw:
            tracker.reset_mod_stats()

    hook = torch.nn.modules.module.register_module_forward_pre_hook(next_micro_batch)
    with tracker:
        memfit.train_step(model, batch, _loss, opt, plan)
    hook.remove()
    peak = tracker.get_tracker_snapshot("peak")
    return first, int(sum(v["Total"] for v in peak.values()))


def main() -> None:
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    model = _model()
    fresh = copy.deepcopy(model)
    print(
        f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; Qwen2-style, vocab {VOCAB}, batch {BATCH} x {SEQ}, fp32, AdamW"
    )
    started = time.perf_counter()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    saved = os.environ.get("MEMFIT_BENCH_PROFILE")  # a JSON profile of this model from an earlier run
    if saved and os.path.exists(saved):
        prof = Profile.from_json(Path(saved).read_text())
    else:
        prof = memfit.profile(model, x, _loss, opt, "fp32", repeats=1)
        if saved:
            Path(saved).write_text(prof.to_json())
    plain_peak = prof.measured_peak_bytes
    plain_loss = float(_loss(copy.deepcopy(fresh), x))
    took = time.perf_counter() - started
    print(f"plain step: peak {plain_peak} B (memfit.profile, {took:.0f} s); first loss {plain_loss:.6f}")
    print(
        "| budget | levers allowed | plan levers | blocks | predicted B | MemTracker peak B | x plain "
        "| at or under | first loss rel. diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for fraction, levers in ((0.50, ["chunked_loss"]), (0.30, "all")):
        model = copy.deepcopy(fresh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        budget = int(fraction * plain_peak)
        plan = memfit.plan(model, x, _loss, budget, opt, "fp32", levers=levers, profiles={"fp32": prof})
        model, opt = memfit.prepare(model, opt, plan)
        first, peak = _tracked_step(model, opt, x, plan)
        modes = sorted(set(plan.blocks.values()))
        print(f"| {fraction:.2f}x = {budget} | {levers} | {', '.join(plan.levers)} | {'/'.join(modes)} | "
              f"{plan.predicted_peak_bytes} | {peak} | {peak / plain_peak:.3f} | {peak <= budget} | "
              f"{abs(first - plain_loss) / abs(plain_loss):.2e} |")  # fmt: skip
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
