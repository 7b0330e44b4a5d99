"""Llama 3.1 8B's shape with LoRA r=16 on an NF4 base, bf16: the longest sequence whose training
step ``memfit.estimate`` fits in 80 GiB and in 24 GiB (fake tensors only: estimates).

The model is built from ``transformers.LlamaConfig`` (32 layers, hidden 4096, intermediate
14336, 32 heads, 8 key/value heads, 128,256-token vocabulary, untied head; no weights), wrapped
in a peft LoRA adapter (r=16 on the attention and MLP projections), fp32 AdamW over the
adapters, batch 1, its own ``labels=`` loss, SDPA attention; estimated at bf16 under
``FakeTensorMode`` (nothing of the 8B model is allocated). For each length the step is
predicted with the lever sets a GPU has, each lever at its most saving setting: the NF4 base
(``frozen_nf4`` with ``frozen_bf16`` for what NF4 leaves: embeddings, norms, the head),
``chunked_loss``, ``tiled_mlp``, and, on top, ``offload`` (every block's checkpointed input in
host memory; its device bytes do not depend on the link's speed), in the checkpointing mode
with the smallest peak. The longest length (a multiple of ``GRAIN``) under each device memory
is bisected; the answer's peak is split by role, and the next length's named.

Estimates, not measurements: MemTracker's accounting on fake CPU tensors (SDPA on a CPU's
kernel rules; no CUDA allocator rounding, no cuBLAS workspace, no CUDA context) until a GPU
confirms them.

Run: ``HF_HUB_OFFLINE=1 .venv-extras/bin/python benchmarks/estimate_llama8b_longest.py``
(prints one ``RESULT {json}`` line per device memory).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import memfit
from memfit.applying import lever
from memfit.planning.lever_sets import lever_profiles
from memfit.records import Profile
from memfit.records.long_context import HostLinkFacts
from memfit.stepmodel import simulate
from memfit.stepmodel.offload import moved_bytes, offload_price

GiB = 2**30
GRAIN = 1024
VOCAB = 128256
LEVERS = ["frozen_nf4", "frozen_bf16", "chunked_loss", "tiled_mlp"]
#: The link's speed prices the copies' time only; the device bytes do not depend on it.
LINK = HostLinkFacts("cuda (assumed)", 25e9, 25e9)
UNSLOTH = {80: 342_733, 24: 78_475}


def _model() -> torch.nn.Module:
    import peft
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=VOCAB, max_position_embeddings=131072, rope_theta=500000.0,
        tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).train()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=targets))


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


def _most_saving(prof: Profile) -> Profile:
    for name in LEVERS:
        prof = lever(name).at_settings(prof, lever(name).settings({prof.precision: prof})[-1])
    return lever_profiles({prof.precision: prof}, LEVERS)["bf16"]


def _step(seq: int) -> dict[str, Any]:
    """The smallest predicted step at ``seq`` tokens, without and with offload."""
    started = time.perf_counter()
    x = torch.zeros(1, seq, dtype=torch.long)
    est = memfit.estimate(
        _model, x, _loss, lambda p: torch.optim.AdamW(p, lr=1e-4), precisions=["bf16"], levers=LEVERS
    )
    prof = _most_saving(est.profiles["bf16"])
    names = [b.name for b in prof.blocks]
    best: dict[str, Any] = {}
    for mode in ("none", "selective", "full"):
        sim = simulate(prof, mode)
        off = offload_price(prof, mode, moved_bytes(prof, mode, names), LINK)
        if not best or sim.peak_bytes < best["peak"]:
            best.update(peak=sim.peak_bytes, mode=mode, event=sim.peak_event, split=sim.breakdown)
        if "offload_peak" not in best or off.peak_bytes < best["offload_peak"]:
            best.update(offload_peak=off.peak_bytes, offload_mode=mode, offload_event=off.peak_event)
            best.update(host_bytes=off.host_bytes)
    best.update(seq=seq, seconds=time.perf_counter() - started)
    print(f"  {seq:>9,} tokens: {best['peak']:,} B, offloaded {best['offload_peak']:,} B", flush=True)
    return best


def _longest(memory: int, key: str, cache: dict[int, dict[str, Any]], lo: int, hi: int) -> int:
    """The longest multiple of GRAIN in [lo, hi) whose ``key`` peak fits ``memory`` (0: none)."""

    def fits(n: int) -> bool:
        if n not in cache:
            cache[n] = _step(n)
        return bool(cache[n][key] <= memory)

    if not fits(lo):
        return 0
    while hi - lo > GRAIN:
        mid = (lo + hi) // 2 // GRAIN * GRAIN
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", type=int, nargs="+", default=[80, 24], help="GiB")
    parser.add_argument("--high", type=int, default=1 << 20, help="the longest length searched")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cache: dict[int, dict[str, Any]] = {}
    for gib in args.memory:
        out: dict[str, Any] = {"device_memory_gib": gib, "unsloth": UNSLOTH.get(gib)}
        for key in ("peak", "offload_peak"):
            n = _longest(gib * GiB, key, cache, GRAIN, args.high)
            out[key] = {"tokens": n, "at": cache.get(n), "next": cache.get(n + GRAIN)}
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
