"""``memfit demo``: the built-in GPT on Python's own source, the baseline and then memfit.

Both runs start from the same weights and see the same batches. For the first
``--baseline-steps`` steps they run side by side, one step each in turn, so their step
times are measured under the same machine load; the memfit run then trains on alone. The
table compares their peak memory (exact bytes from PyTorch's tracking), step time (a
ratio), and losses; ``report.md``, ``metrics.jsonl``, ``loss.png`` and ``memory.png`` go to
``--out``.

The memfit run trains in the plan :func:`memfit.plan` chooses for ``--budget`` (default 60%
of the baseline's peak): per-block checkpointing, precision (on a CPU, where bf16 is only
emulated, it stays fp32) and micro-batches. Trade-off: planning profiles the model first,
a few seconds before training starts.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from memfit import progress
from memfit.app.data import BatchSampler, ByteCorpus
from memfit.app.schedule import lr_schedule
from memfit.applying import apply
from memfit.budget import Budget, format_bytes
from memfit.cli.common import zero_grads_note
from memfit.errors import ConfigError
from memfit.measuring.speed import timing_threads
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.outputs import check_output_dir, write_text
from memfit.planning.planner import plan
from memfit.records import MemoryReport, Plan
from memfit.report.plots import loss_plot, memory_plot
from memfit.report.table import markdown_table, mode_counts, text_table
from memfit.report.training import median_step_seconds, memory_rows, summarize
from memfit.trainer.callbacks import MetricsLog
from memfit.trainer.trainer import Trainer

__all__ = ["check", "run"]

#: The demo's model and batch: small enough for about two minutes on a busy 2-core CPU.
_MODEL = GPTConfig(n_layer=4, n_embd=64, n_head=4, block_size=64)
_BATCH = 16
_LR = 2e-3


def _memory_saving_plan(
    model: torch.nn.Module, batch: Any, opt: torch.optim.Optimizer, budget: Budget
) -> Plan:
    """The planner's fastest plan under ``budget`` for the memfit run, applied to ``model``."""
    chosen = plan(model, batch, gpt_loss, budget, opt, precision="auto")
    apply(model, chosen)
    return chosen


def _optimizer(model: torch.nn.Module, steps: int) -> tuple[torch.optim.Optimizer, LRScheduler]:
    """AdamW with a short linear warm-up (5% of the steps) and cosine decay over ``steps``."""
    opt = torch.optim.AdamW(model.parameters(), lr=_LR, weight_decay=0.1)
    return opt, lr_schedule(opt, steps, warmup_steps=max(1, steps // 20))


def _describe(plan: Plan) -> str:
    """E.g. ``"fp32, planned under 13.3 MiB (60% of the fp32 peak): full 3, none 1 of 4 blocks"``."""
    counts = mode_counts(plan.blocks.values())
    parts = ", ".join(f"{mode} {n}" for mode, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    budget = f" under {format_bytes(plan.budget_bytes)}" if plan.budget_bytes else ""
    if plan.budget_bytes and plan.report.baseline_peak_bytes:
        budget += f" ({plan.budget_bytes / plan.report.baseline_peak_bytes:.0%} of the fp32 peak)"
    micro = f", {plan.micro_batches} micro-batches" if plan.micro_batches > 1 else ""
    blocks = f"{parts or 'no checkpointing'} of {len(plan.blocks)} blocks"
    return f"{plan.precision}, planned{budget}: {blocks}{micro}"


def _losses(k: int, diff: float) -> str:
    """How the paired losses compare: identical, or the largest difference."""
    if diff == 0:
        return f"over the first {k} steps the losses are identical"
    return f"over the first {k} steps the losses differ by at most {diff:.3g}"


def _threads(asked: int | None) -> int:
    if asked is not None:
        return max(1, asked)
    return timing_threads(torch.device("cpu"))[0]  # See Note [timing on the free cores]


def check(args: argparse.Namespace) -> None:
    """Refuse bad step counts, a bad ``--budget`` or an unwritable ``--out`` before training."""
    if args.steps < 3 or not 3 <= args.baseline_steps <= args.steps:
        raise ConfigError("--steps must be at least 3 and --baseline-steps between 3 and --steps.")
    Budget.parse(args.budget, what="--budget")
    check_output_dir(args.out, "--out")


def run(args: argparse.Namespace) -> int:
    """Run the baseline and memfit side by side, then memfit alone; print and write the results."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(_threads(args.threads))
    corpus = ByteCorpus.load("stdlib", val_fraction=0.05, max_bytes=4_000_000)
    sampler = BatchSampler(corpus.train, _BATCH, _MODEL.block_size, seed=0)
    val = BatchSampler(corpus.val, _BATCH, _MODEL.block_size, seed=1)
    val_batches = [val.batch_at(i) for i in range(8)]

    torch.manual_seed(0)
    base_model = GPT(_MODEL)
    model = copy.deepcopy(base_model)
    base_opt, base_schedule = _optimizer(base_model, args.steps)
    base = Trainer(base_model, base_opt, gpt_loss, "fp32", clip_norm=1.0, scheduler=base_schedule)
    opt, schedule = _optimizer(model, args.steps)
    plan = _memory_saving_plan(model, sampler.batch_at(0), opt, args.budget)
    main = Trainer(
        model,
        opt,
        gpt_loss,
        plan=plan,
        clip_norm=1.0,
        scheduler=schedule,
        callbacks=[MetricsLog(out / "metrics.jsonl")],
        progress=False if args.quiet else None,
    )
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"memfit demo: GPT {n_params / 1e6:.2f}M parameters, batch {_BATCH}x{_MODEL.block_size} bytes of "
        f"{corpus.source}, {torch.get_num_threads()} CPU thread(s)\n"
        f"  baseline: fp32, no checkpointing, {args.baseline_steps} steps side by side with memfit\n"
        f"  memfit:   {_describe(plan)}, {args.steps} steps"
    )
    # the training bar counts on from these steps to --steps (Trainer.fit counts the model's steps)
    with progress.phase("baseline and memfit side by side", total=args.baseline_steps) as ph:
        for _ in ph.over(range(args.baseline_steps)):
            batch = sampler.next_batch()
            base.step(batch)
            main.step(batch)
    main.fit(
        sampler,
        args.steps - args.baseline_steps,
        eval_fn=lambda _m: main.evaluate(val_batches),
        eval_every=max(1, args.steps // 6),
    )
    base_eval = base.evaluate(val_batches)
    _finish(args, out, base, main, plan, base_eval)
    return 0


def _finish(
    args: argparse.Namespace, out: Path, base: Trainer, main: Trainer, plan: Plan, base_eval: float
) -> None:
    assert base.memory is not None and main.memory is not None
    k = args.baseline_steps
    paired = main.history[:k]
    diff = max(abs(a.loss - b.loss) for a, b in zip(base.history, paired, strict=True))
    t_base, t_main = median_step_seconds(base.history), median_step_seconds(paired)
    s = summarize(main.history)
    mem: dict[str, MemoryReport] = {"baseline": base.memory, "memfit": main.memory}
    ratio = main.memory.peak_bytes / base.memory.peak_bytes
    rows = [
        ["configuration", "fp32, no checkpointing", _describe(plan)],
        ["peak memory (bytes)", f"{base.memory.peak_bytes:,}", f"{main.memory.peak_bytes:,}"],
        ["peak memory", format_bytes(base.memory.peak_bytes), format_bytes(main.memory.peak_bytes)],
        ["peak vs baseline", "1.00x", f"{ratio:.2f}x"],
        ["median step time", f"{t_base:.3f} s", f"{t_main:.3f} s"],
        ["step time vs baseline", "1.00x", f"{t_main / t_base:.2f}x"],
        [f"train loss at step {k}", f"{base.history[-1].loss:.4f}", f"{paired[-1].loss:.4f}"],
        [f"val loss at step {k}", f"{base_eval:.4f}", "-"],
        ["steps", str(k), str(s.steps)],
        [f"final train loss (mean of last {s.window})", "-", f"{s.final_loss:.4f}"],
        ["final val loss", "-", "-" if s.val_loss is None else f"{s.val_loss:.4f}"],
    ]
    headers = ["", "baseline", "memfit"]
    print()
    print(text_table(headers, rows))
    print(
        f"\nSame weights, same batches: {_losses(k, diff)}. "
        f"Peak memory is {ratio:.0%} of the baseline's ({format_bytes(base.memory.peak_bytes)} -> "
        f"{format_bytes(main.memory.peak_bytes)})."
    )
    loss_plot(
        out / "loss.png",
        {f"memfit ({plan.precision}, planned)": main.history, "baseline (fp32)": base.history},
        title="memfit demo: GPT on the Python standard library",
    )
    memory_plot(
        out / "memory.png",
        {name: r.breakdown for name, r in mem.items()},
        title="peak memory of one training step (MemTracker)" if main.device.type == "cpu" else "peak memory",
        budget_bytes=plan.budget_bytes,
    )
    report = [
        "# memfit demo",
        "",
        "The built-in GPT trained on the Python standard library's source, byte by byte: the baseline",
        f"(fp32, no checkpointing) for {k} steps side by side with memfit ({_describe(plan)}), which then",
        f"trains on to step {s.steps}. Both start from the same weights and see the same batches.",
        "",
        markdown_table(headers, rows),
        "",
        f"Same weights, same batches: {_losses(k, diff)}.",
        f"Step time is the median of untracked steps, measured side by side ({torch.get_num_threads()} "
        "CPU thread(s)); the machine may be shared, so treat it as a ratio, not a speed.",
        "",
        f"## Peak memory of one steady-state step ({main.memory.tracker}, {main.memory.device})",
        "",
        markdown_table(["part", "baseline", "memfit"], memory_rows(mem)),
        "",
        *([f"{note}.", ""] if (note := zero_grads_note(r.breakdown for r in mem.values())) else []),
        "![loss](loss.png)",
        "",
        "![memory](memory.png)",
        "",
    ]
    write_text(out / "report.md", "\n".join(report), "the demo report")
    print(f"wrote {out / 'report.md'}, {out / 'metrics.jsonl'}, {out / 'loss.png'}, {out / 'memory.png'}")
