"""Estimate vs measured peaks, the 7B-scale estimate, and GPT activations vs Korthikanti et al.

Prints Markdown for benchmarks/RESULTS.md. Run: ``.venv/bin/python benchmarks/bench_estimate.py``.

1. For the test models (GPT at two sizes, a BatchNorm CNN, a model whose blocks differ in
   size), ``memfit.estimate`` (fake tensors) against ``memfit.measure`` (real step) for
   every precision x checkpointing mode.
2. ``memfit estimate`` on LLaMA-7B's shape (32 x 4096, 32 heads, seq 4096, batch 1) as a
   subprocess: wall time, peak resident memory, and the fp32 parameter + gradient + AdamW
   bytes per parameter.
3. Activation bytes one block of the built-in GPT keeps for backward (``memfit.profile``,
   no checkpointing) against sbh(34 + 5as/h) (Korthikanti et al., 2022, 16-bit activations).
"""

from __future__ import annotations

import datetime
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import memfit  # noqa: E402
from memfit.models.gpt import GPT, GPTConfig, gpt_loss  # noqa: E402
from memfit.records import Estimate  # noqa: E402
from memfit.report.table import markdown_table  # noqa: E402
from memfit.vocab import CHECKPOINT_MODES  # noqa: E402


def accuracy() -> None:
    from test_estimate import CASES

    rows = []
    for name, (model_fn, batch, loss_fn) in CASES.items():
        est = memfit.estimate(model_fn, batch, loss_fn, lambda p: torch.optim.AdamW(p, lr=1e-3))
        model = model_fn()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for precision in ("fp32", "bf16", "fp16"):
            for mode in CHECKPOINT_MODES:
                memfit.checkpoint(model, mode=mode)
                measured = memfit.measure(model, batch, loss_fn, opt, precision=precision, steps=1).peak_bytes
                predicted = est.peak_bytes(precision, mode)
                rows.append(
                    [name, f"{precision} / {mode}", measured, predicted, f"{predicted / measured:.4f}"]
                )
    print(markdown_table(["model", "strategy", "measured B", "estimated B", "estimated / measured"], rows))
    worst = max(abs(float(r[4]) - 1) for r in rows)
    print(f"\nlargest relative difference: {worst:.2%} over {len(rows)} strategies\n")


def scale() -> None:
    cmd = [
        str(ROOT / ".venv/bin/memfit"),
        "estimate",
        "--set",
        "model.name=import:memfit.models.llama:llama",
        "--set",
        'model.kwargs.preset="7b"',
        "--set",
        "train.batch_size=1",
        "--device-memory",
        "80GiB",
        "--json",
    ]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    est = Estimate.from_json(done.stdout)
    prof = est.profiles["fp32"]
    n = est.param_count
    buffers = prof.param_bytes - 4 * n
    fixed = prof.param_bytes - buffers + prof.grad_bytes + prof.optimizer_bytes
    print(f"command: `{' '.join(cmd[1:])}`\n")
    print(
        f"{n:,} parameters; wall {wall:.1f} s (estimate itself {est.seconds:.1f} s); peak resident "
        f"memory {rss / 2**20:.0f} MiB; fp32 parameters + gradients + AdamW state = {fixed:,} B = "
        f"{fixed / n:.6f} bytes/parameter (AdamW adds a 4-byte step counter per tensor)\n"
    )
    rows = [
        [
            f"{e.precision} / {e.mode}",
            *(f"{e.breakdown[k] / 2**30:.2f}" for k in e.breakdown),
            f"{e.peak_bytes / 2**30:.2f}",
        ]
        for e in est.ordered()
    ]
    headers = ["strategy", "params GiB", "grads GiB", "optimizer GiB", "activations GiB", "temporaries GiB"]
    print(markdown_table([*headers, "peak GiB"], rows))
    print(f"\nverdict for 80 GiB: fits = {est.fits[:3]} ...\n")


def korthikanti() -> None:
    rows = []
    s, b, h, a = 128, 4, 256, 4
    for dropout in (0.0, 0.1):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=3, n_embd=h, n_head=a, block_size=s, dropout=dropout))
        x = torch.randint(0, 256, (b, s))
        prof = memfit.profile(model, (x, x), gpt_loss, None, "bf16", repeats=1)
        per_layer = prof.blocks[1].saved_bytes["none"]
        formula = s * b * h * (34 + 5 * a * s / h)
        rows.append([dropout, per_layer, int(formula), f"{per_layer / formula:.3f}"])
    print(f"s={s}, b={b}, h={h}, a={a}, bf16 autocast, CPU, block 1 of 3, no checkpointing\n")
    print(markdown_table(["dropout", "measured B/layer", "sbh(34+5as/h) B", "measured / formula"], rows))


def main() -> None:
    torch.set_num_threads(1)
    today, machine = datetime.date.today(), platform.machine()
    print(f"## Estimate and profile ({today}, {machine}, torch {torch.__version__})\n")
    print(f"command: `.venv/bin/python benchmarks/bench_estimate.py` on {platform.processor() or 'CPU'}\n")
    print("### Estimate (fake tensors) vs measured peak\n")
    accuracy()
    print("### LLaMA-7B shape, batch 1, sequence 4096\n")
    scale()
    print("### Activation bytes per layer of the built-in GPT vs Korthikanti et al. (2022)\n")
    korthikanti()
    _ = json


if __name__ == "__main__":
    main()
