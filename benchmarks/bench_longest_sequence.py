"""``memfit.plan(..., maximize="seq_len")`` on issue 38's acceptance model at 512 MiB (memory only).

The model of ``bench_long_context.py`` (``transformers.LlamaConfig``: 2 layers, hidden 256,
intermediate 688, 4 heads, 32,000-token vocabulary, untied head; fp32 AdamW, batch 1, its own
``labels=`` loss), as it is and wrapped in a peft LoRA adapter (r=16 on the attention and MLP
projections). memfit searches the longest sequence with ``levers="all"``; the answer's plan is
applied with ``memfit.prepare`` and one steady-state step measured around with MemTracker.

Run: ``HF_HUB_OFFLINE=1 .venv-extras/bin/python benchmarks/bench_longest_sequence.py [--lora]``
(prints one ``RESULT {json}`` line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_long_context import BUDGET, _loss, _model, _tokens, _tracked

import memfit


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    import peft

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--start", type=int, default=512, help="the batch's own length")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = _model()
    if args.lora:
        model = _lora(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    started = time.perf_counter()
    plan = memfit.plan(
        model, _tokens(args.start), _loss, BUDGET, opt, "fp32", levers="all", maximize="seq_len"
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
    }  # fmt: skip
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
