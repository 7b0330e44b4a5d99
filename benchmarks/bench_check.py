"""What the stability tools cost per training step, measured side by side in one run.

Three variants of the same step on the same model and batch, interleaved so that machine
noise hits them alike: the plain :func:`memfit.step.training_step`, the Trainer's guarded
step (:meth:`memfit.check.guards.Guard.step`, on by default), and a step under
:class:`memfit.check.attribution.OverflowWatch` (hooks on every module, as ``memfit check``
runs). Prints medians as ratios to the plain step.

Run: ``.venv/bin/python benchmarks/bench_check.py``
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch

from memfit.check.attribution import OverflowWatch
from memfit.check.guards import Guard
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.precision import Precision
from memfit.step import training_step

ROUNDS = 12


def main() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=64)
    x = torch.randint(0, 256, (8, cfg.block_size + 1))
    batch = (x[:, :-1], x[:, 1:])
    print(
        f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; GPT {cfg.n_layer}x{cfg.n_embd}, batch 8x{cfg.block_size}"
    )
    print("| precision | plain step | guarded step (Trainer default) | step under OverflowWatch (check) |")
    print("|---|---|---|---|")
    for mode in ("fp32", "bf16"):
        med = _measure(cfg, batch, mode)
        print(
            f"| {mode} | 1.00 | {med['guarded'] / med['plain']:.2f}x | {med['watched'] / med['plain']:.2f}x |"
        )


def _measure(cfg: GPTConfig, batch: tuple[torch.Tensor, torch.Tensor], mode: str) -> dict[str, float]:
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    precision = Precision(mode, device="cpu")
    guard = Guard()
    watch = OverflowWatch(model)

    def plain() -> None:
        training_step(model, batch, gpt_loss, opt, precision, clip_norm=1.0)

    def guarded() -> None:
        guard.step(model, batch, gpt_loss, opt, precision, 1, clip_norm=1.0)

    def watched() -> None:
        with watch:
            watch.begin_step()
            r = training_step(model, batch, gpt_loss, opt, precision, clip_norm=1.0)
            watch.end_step(r.loss)

    variants: dict[str, Callable[[], None]] = {"plain": plain, "guarded": guarded, "watched": watched}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        fn()  # warm-up (optimizer state, autocast caches)
    names = list(variants)
    for r in range(ROUNDS):
        for name in names[r % 3 :] + names[: r % 3]:  # rotate, so no variant always goes first
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


if __name__ == "__main__":
    main()
