"""Step time of checkpointed training with two copies of memfit's code, side by side in one run.

The exactness work on the recompute (issue 34) must not slow down steps where its cases do
not occur. Two worker processes import memfit from two source trees (``--before``, the
main branch; ``--after``, this change) and build the same built-in GPT (default size, fp32,
AdamW) checkpointed ``full`` and ``selective``. The parent asks them in turn, alternating
which goes first, for a few timed steps at a time, so that drift of a noisy machine hits
both alike; after warm-up it prints the median step time of each and the after/before
ratio per mode (the goal: at most 1.02).

Run: ``.venv/bin/python benchmarks/bench_checkpoint_exact.py --before /path/to/main/src [--rounds 20]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("full", "selective")


def worker(threads: int, batch_size: int) -> None:
    """Build one checkpointed GPT per mode, then time steps as the parent asks (one line each)."""
    import copy

    import torch

    import memfit
    from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    from memfit.step import training_step

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = GPTConfig()
    x = torch.randint(
        0, cfg.vocab_size, (batch_size, cfg.block_size), generator=torch.Generator().manual_seed(1)
    )
    base = GPT(cfg)
    runs = {}
    for mode in MODES:
        model = memfit.checkpoint(copy.deepcopy(base), mode=mode)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        runs[mode] = (model, opt, memfit.Precision("fp32", device="cpu"))
    print("ready", flush=True)
    for line in sys.stdin:
        mode, steps = line.split()
        model, opt, prec = runs[mode]
        times = []
        for _ in range(int(steps)):
            start = time.perf_counter()
            training_step(model, (x, x), gpt_loss, opt, prec)
            times.append(time.perf_counter() - start)
        print(json.dumps(times), flush=True)


def _start(src: str, args: argparse.Namespace) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()))
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--threads",
        str(args.threads),
        "--batch-size",
        str(args.batch_size),
    ]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _ask(proc: subprocess.Popen[str], mode: str, steps: int) -> list[float]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{mode} {steps}\n")
    proc.stdin.flush()
    times: list[float] = json.loads(proc.stdout.readline())
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="/work/main/src", help="the source tree to compare against")
    parser.add_argument("--after", default=str(ROOT / "src"), help="this change's source tree")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds after warm-up")
    parser.add_argument("--steps", type=int, default=2, help="steps per turn")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: default)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.threads, args.batch_size)
        return
    sides = {"before": _start(args.before, args), "after": _start(args.after, args)}
    times: dict[tuple[str, str], list[float]] = {(s, m): [] for s in sides for m in MODES}
    for r in range(args.warmup + args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for mode in MODES:
            for side in order:
                got = _ask(sides[side], mode, args.steps)
                if r >= args.warmup:
                    times[(side, mode)] += got
    for proc in sides.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    print(f"# Checkpoint exactness step time, {datetime.date.today()}")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; before {args.before}"
    )
    print(
        f"built-in GPT (default size), batch {args.batch_size}, fp32, AdamW; "
        f"{args.rounds} rounds x {args.steps} steps"
    )
    print("| mode | median before (ms) | median after (ms) | after/before |")
    print("|---|---|---|---|")
    for mode in MODES:
        b, a = statistics.median(times[("before", mode)]), statistics.median(times[("after", mode)])
        print(f"| {mode} | {b * 1e3:.1f} | {a * 1e3:.1f} | {a / b:.3f} |")


if __name__ == "__main__":
    main()
