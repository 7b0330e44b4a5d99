"""Activation offload and the tiled MLP on one device: each one's peak and step time beside
full checkpointing alone.

memfit's LLaMA (``--layers`` x ``--width``, intermediate by LLaMA's rule, 32,000-token
vocabulary, the loss head chunked so the logits do not hide the rest), one sequence of
``--seq`` tokens, AdamW, every block fully checkpointed. Variants: ``full`` (checkpointing
alone), ``+offload`` (every block's input to pinned host memory, memfit.levers.offload),
``+tiled`` (each MLP in ``--chunks`` chunks, memfit.levers.tiled_mlp), and both. Each variant
starts from the same weights: one step makes the optimizer state, one tracked step gives the
peak (the CUDA allocator's on a GPU, above what the process held before the variant was
built, so that the variants already built do not count; MemTracker's on a CPU, where the host
copies are not counted: See Note [the host on a CPU]), then ``--steps`` timed steps, interleaved across the
variants, give the median; the first loss is compared with ``full``'s. On CUDA the host link
is timed too (memfit.measuring.long_context.host_link_facts).

Run on a GPU (about a minute on one H200, `benchmarks/gpu_check.sh` runs it):
``python benchmarks/bench_offload.py --device cuda``; on a CPU, small:
``python benchmarks/bench_offload.py --device cpu --layers 4 --width 128 --seq 1024 --steps 2``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import memfit
from memfit.levers.head import install_chunked_head
from memfit.levers.offload import ActivationOffloader, offload_blocks
from memfit.levers.tiled_mlp import install_tiled_mlp
from memfit.measuring.long_context import host_link_facts
from memfit.measuring.tracker import MemoryWatch
from memfit.models.gpt import gpt_loss
from memfit.models.llama import llama
from memfit.precision import Precision
from memfit.step import training_step

VARIANTS = ("full", "+offload", "+tiled", "+offload+tiled")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--precision", default="bf16")
    return p.parse_args()


def _build(args: argparse.Namespace, variant: str) -> tuple[nn.Module, ActivationOffloader | None]:
    torch.manual_seed(0)
    spec = llama(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64, vocab_size=32000,
                 block_size=args.seq)  # fmt: skip
    model = spec.model.to(args.device)
    memfit.checkpoint(model, mode="full")
    install_chunked_head(model, None)
    offloader = None
    if "offload" in variant:
        offloader = offload_blocks(model, memfit.find_blocks(model))
    if "tiled" in variant:
        install_tiled_mlp(model, args.chunks)
    return model, offloader


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    args = _args()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 32000, (1, args.seq), generator=g).to(args.device)
    batch = (x, torch.roll(x, -1, 1))
    prec = Precision(args.precision, torch.device(args.device))  # type: ignore[arg-type]
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.machine()
    print(f"# offload and the tiled MLP: {where}, torch {torch.__version__}, {args.precision}")
    print(f"memfit LLaMA {args.layers} x {args.width}, vocab 32,000, 1 x {args.seq:,} tokens, AdamW, every "
          f"block fully checkpointed, loss head chunked; tiled MLP in {args.chunks} chunks\n")  # fmt: skip
    if args.device.startswith("cuda"):
        link = host_link_facts(torch.device(args.device))
        print(f"host link: {link.to_host_bytes_per_second / 1e9:.1f} GB/s to the host, "
              f"{link.to_device_bytes_per_second / 1e9:.1f} GB/s back (pinned, side stream)\n")  # fmt: skip
    runs: dict[str, tuple[nn.Module, torch.optim.Optimizer, ActivationOffloader | None]] = {}
    peaks, losses, moved = {}, {}, {}
    for variant in VARIANTS:
        # the variants built before stay resident for the timed rounds; on CUDA the allocator's
        # peak counts them too, so each variant's peak is taken above what was held before it
        held = torch.cuda.memory_allocated(args.device) if args.device.startswith("cuda") else 0
        model, offloader = _build(args, variant)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses[variant] = training_step(model, batch, gpt_loss, opt, prec).loss  # the state made
        with MemoryWatch(model, opt) as watch:
            training_step(model, batch, gpt_loss, opt, prec)
        peaks[variant] = watch.peak_bytes - held
        moved[variant] = offloader.moved_to_host // 2 if offloader is not None else 0  # per step
        runs[variant] = (model, opt, offloader)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.steps):
        for variant, (model, opt, _) in runs.items():
            times[variant].append(
                _timed(lambda m=model, o=opt: training_step(m, batch, gpt_loss, o, prec), args.device)
            )
    _table(peaks, times, losses, moved)


def _timed(step: Callable[[], object], device: str) -> float:
    _sync(device)
    started = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - started


def _table(
    peaks: dict[str, int], times: dict[str, list[float]], losses: dict[str, float], moved: dict[str, int]
) -> None:
    base_peak, base_time = peaks["full"], statistics.median(times["full"])
    print("| variant | peak (B) | peak / full | to host per step (B) | median step (s) | time / full "
          "| first loss |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for v in VARIANTS:
        t = statistics.median(times[v])
        print(f"| {v} | {peaks[v]:,} | {peaks[v] / base_peak:.3f} | {moved[v]:,} | {t:.3f} | "
              f"{t / base_time:.3f} | {losses[v]:.6f} |")  # fmt: skip
    same = losses["+offload"] == losses["full"]
    print(f"\noffload's first loss equals full's: {same}")


if __name__ == "__main__":
    main()
