"""Llama 3.1 8B's shape with LoRA r=16 on an NF4 base, bf16: the longest sequence whose training
step ``memfit.estimate`` fits in 80 GiB and in 24 GiB (fake tensors only: estimates).

The model is built from ``transformers.LlamaConfig`` (32 layers, hidden 4096, intermediate
14336, 32 heads, 8 key/value heads, 128,256-token vocabulary, untied head; no weights), wrapped
in a peft LoRA adapter (r=16 on the attention and MLP projections), fp32 AdamW over the
adapters, batch 1, its own ``labels=`` loss, SDPA attention; estimated at bf16 under
``FakeTensorMode`` (nothing of the 8B model is allocated). The search is
:class:`memfit.planning.longest_estimate.SequenceSearch` (what ``memfit estimate --maximize
seq_len`` runs): at each length probed, three lever tiers are predicted from one estimate, each
lever at its most saving setting: no levers; the NF4 base (``frozen_nf4`` with ``frozen_bf16``
for what NF4 leaves: embeddings, norms, the head), ``chunked_loss`` and ``tiled_mlp``; and the
same with ``offload`` (every block's checkpointed input in host memory; its device bytes do not
depend on the link's speed). Lengths are multiples of the grain (1,024 tokens); the search
gallops up from one grain by doubling and bisects to neighbours, its probes shared between the
device memories. Each answer's peak is split by role, and the next length's named.

Estimates, not measurements: MemTracker's accounting on fake CPU tensors (SDPA on a CPU's
kernel rules; no CUDA allocator rounding, no cuBLAS workspace, no CUDA context) until a GPU
confirms them.

Run: ``HF_HUB_OFFLINE=1 .venv-extras/bin/python benchmarks/estimate_llama8b_longest.py``
(prints one ``RESULT {json}`` line per device memory; each probe's line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from memfit import progress
from memfit.planning.longest_estimate import DEFAULT_GRAIN, SequenceSearch

GiB = 2**30
VOCAB = 128256
LEVERS = ["frozen_nf4", "frozen_bf16", "chunked_loss", "tiled_mlp", "offload"]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", type=int, nargs="+", default=[80, 24], help="GiB")
    parser.add_argument("--high", type=int, default=1 << 20, help="the longest length searched")
    parser.add_argument("--grain", type=int, default=DEFAULT_GRAIN, help="tokens")
    args = parser.parse_args()
    torch.set_num_threads(1)
    progress.configure(quiet=False)  # each probe's line (and the estimate's phases) on stderr, also in a log
    started = time.perf_counter()
    search = SequenceSearch(
        _model, torch.zeros(1, args.grain, dtype=torch.long), _loss,
        lambda p: torch.optim.AdamW(p, lr=1e-4), precisions=["bf16"], levers=LEVERS,
        grain=args.grain, max_seq_len=args.high,
    )  # fmt: skip
    for gib in args.memory:
        found = search.longest_sequence(gib * GiB)
        out: dict[str, Any] = {"device_memory_gib": gib, "unsloth": UNSLOTH.get(gib), "estimate": True}
        out.update(found.to_dict())
        out.pop("assumptions")
        out["seconds_so_far"] = round(time.perf_counter() - started, 1)
        print("RESULT " + json.dumps(out), flush=True)
    print("assumptions:\n" + "\n".join(f"  - {line}" for line in found.assumptions), flush=True)


if __name__ == "__main__":
    main()
