"""The zoo's PEFT models: Hugging Face models from :mod:`zoo_hf`, wrapped as users wrap them.

Each entry is ``peft.get_peft_model(model, config)`` on a zoo model (random weights, every
other setting at its default: decoders keep ``use_cache=True``): LoRA and DoRA with adapter
dropout on (``lora_dropout=0.1``), and IA3, so the exactness checks also prove that a recompute replays the
adapters' dropout masks. Nothing is called first: no ``enable_input_require_grads``, no
reentrant choice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from zoo import Entry, layers
from zoo_hf import HF

#: Adapter dropout in every entry: the recompute must draw the same masks.
DROPOUT = 0.1


def _base(name: str) -> Entry:
    return next(e for e in HF if e.name == name)


def _wrapped(base: Entry, method: str, **settings: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import peft

        model = base.build()
        torch.manual_seed(1)  # the adapters' own initialisation
        if method == "ia3":
            config: Any = peft.IA3Config(**settings)
        else:
            config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=DROPOUT, **settings)
        return peft.get_peft_model(model, config).train()

    return build


def _entry(
    name: str, base_name: str, blocks: list[str], covers: str, method: str = "lora", **settings: Any
) -> Entry:
    base = _base(base_name)
    build = _wrapped(base, method, **settings)
    return Entry(name, build, base.loss, base.batch, blocks, large=32, covers=covers)


_P = "base_model.model."

PEFT: list[Entry] = [
    _entry("peft/llama-lora", "transformers/llama", layers(_P + "model.layers"),
           "decoder, cache on, LoRA on q_proj/v_proj", target_modules=["q_proj", "v_proj"]),
    _entry("peft/gpt2-lora", "transformers/gpt2", layers(_P + "transformer.h"),
           "decoder, cache on, LoRA on a Conv1D (fan_in_fan_out), model dropout too",
           target_modules=["c_attn"], fan_in_fan_out=True),
    _entry("peft/bert-lora", "transformers/bert", layers(_P + "bert.encoder.layer"),
           "encoder, LoRA on query/value", target_modules=["query", "value"]),
    _entry("peft/t5-lora", "transformers/t5", layers(_P + "encoder.block") + layers(_P + "decoder.block"),
           "encoder-decoder, cache on, LoRA on q/v", target_modules=["q", "v"]),
    _entry("peft/llama-dora", "transformers/llama", layers(_P + "model.layers"),
           "decoder, DoRA (weight-decomposed LoRA) on every projection",
           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           use_dora=True),
    _entry("peft/llama-ia3", "transformers/llama", layers(_P + "model.layers"),
           "decoder, IA3 (learned rescaling vectors, no dropout of its own)", method="ia3",
           target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
]  # fmt: skip
