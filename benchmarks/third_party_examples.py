"""The examples of issue 11, tried as a new user would: plan, apply, train, compare with plain.

GPT-2, T5, Whisper and Falcon from their config classes with every setting at its default
(``use_cache=True``, dropout, ALiBi/rotary choices, tied embeddings) except the sizes (width,
layers, vocabulary: the defaults are 60M to 7B parameters, too slow for a CPU), trained
with ``labels=``; torchvision ``efficientnet_b0`` and ``densenet121`` and timm
``efficientnet_b0`` and ``coatnet_nano_rw_224`` exactly as their builders make them. Random
weights, CPU. For each: the peaks of keeping everything and of full checkpointing
(``memfit.measure``), a plan at the budget halfway between them, its predicted and measured
peak, and three AdamW steps with ``memfit.Trainer`` and the plan against three plain steps
from the same weights (largest loss and parameter differences).

Run (needs the extras: transformers, torchvision, timm):
    HF_HUB_OFFLINE=1 PYTHONPATH=src .venv-extras/bin/python benchmarks/third_party_examples.py
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import memfit

os.environ.setdefault("HF_HUB_OFFLINE", "1")
Example = tuple[Callable[[], nn.Module], Callable[[nn.Module, Any], torch.Tensor], Any]


def _hf(kind: str, auto: str, **fields: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        torch.manual_seed(0)
        return (
            getattr(transformers, auto).from_config(transformers.AutoConfig.for_model(kind, **fields)).train()
        )

    return build


def _lm(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


def _seq2seq(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[1]).loss


def _speech(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(input_features=batch[0], labels=batch[1]).loss


def _ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _vision(library: str, name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        if library == "torchvision":
            import torchvision

            return torchvision.models.get_model(name, weights=None).train()
        import timm

        return timm.create_model(name, pretrained=False).train()

    return build


#: Sizes only; every other field keeps its default.
_SMALL = dict(vocab_size=512)


def examples() -> dict[str, Example]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (4, 128), generator=g)
    pairs = (torch.randint(0, 512, (4, 128), generator=g), torch.randint(0, 512, (4, 64), generator=g))
    images = (torch.randn(8, 3, 128, 128, generator=g), torch.randint(0, 1000, (8,), generator=g))
    coat = (torch.randn(4, 3, 224, 224, generator=g), torch.randint(0, 1000, (4,), generator=g))
    return {
        "transformers GPT2LMHeadModel (n_layer=4, n_embd=128)": (
            _hf("gpt2", "AutoModelForCausalLM", **_SMALL, n_layer=4, n_embd=128, n_head=4),
            _lm,
            tokens,
        ),
        "transformers T5ForConditionalGeneration (d_model=128, 4+4 layers)": (
            _hf(
                "t5",
                "AutoModelForSeq2SeqLM",
                **_SMALL,
                decoder_start_token_id=0,  # T5's own checkpoints set it; labels= needs it
                d_model=128,
                d_kv=32,
                d_ff=512,
                num_layers=4,
                num_heads=4,
            ),
            _seq2seq,
            pairs,
        ),
        "transformers WhisperForConditionalGeneration (d_model=128, 4+4 layers)": (
            _hf(
                "whisper",
                "AutoModelForSpeechSeq2Seq",  # its default vocabulary: the default token ids need it
                d_model=128,
                encoder_layers=4,
                decoder_layers=4,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                max_source_positions=256,
                encoder_ffn_dim=512,
                decoder_ffn_dim=512,
            ),
            _speech,
            (torch.randn(4, 80, 512, generator=g), pairs[1]),
        ),
        "transformers FalconForCausalLM (hidden_size=128, 4 layers)": (
            _hf(
                "falcon",
                "AutoModelForCausalLM",
                **_SMALL,
                hidden_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
            ),
            _lm,
            tokens,
        ),
        "torchvision efficientnet_b0": (_vision("torchvision", "efficientnet_b0"), _ce, images),
        "torchvision densenet121": (_vision("torchvision", "densenet121"), _ce, images),
        "timm efficientnet_b0": (_vision("timm", "efficientnet_b0"), _ce, images),
        "timm coatnet_nano_rw_224": (_vision("timm", "coatnet_nano_rw_224"), _ce, coat),
    }


def _train(model: nn.Module, loss_fn: Any, batch: Any, plan: memfit.Plan | None, steps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    trainer = memfit.Trainer(model, opt, loss_fn, precision="fp32", plan=plan, track_memory=False)
    losses = []
    for _ in range(steps):
        torch.manual_seed(7)  # the same dropout masks for the plain and the planned model
        losses.append(trainer.step(batch).loss)
    return losses


def run(name: str, example: Example, steps: int) -> str:
    build, loss_fn, batch = example
    start = time.perf_counter()
    model = build()
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    keep = memfit.measure(model, batch, loss_fn, opt, "fp32", steps=1).peak_bytes
    memfit.checkpoint(model, mode="full")
    full = memfit.measure(model, batch, loss_fn, opt, "fp32", steps=1).peak_bytes
    memfit.uncheckpoint(model)
    budget = (keep + full) // 2
    plan = memfit.plan(model, batch, loss_fn, budget, opt, precision="fp32")
    memfit.apply(model, plan)
    measured = memfit.measure(model, batch, loss_fn, opt, "fp32", steps=1, micro_batches=plan.micro_batches)
    counts = {m: list(plan.blocks.values()).count(m) for m in ("none", "selective", "full")}
    planned = _train(model, loss_fn, batch, plan, steps)
    reference = _train(plain, loss_fn, batch, None, steps)
    diff = max(
        float((a - b).abs().max()) for a, b in zip(model.parameters(), plain.parameters(), strict=True)
    )
    loss_diff = max(abs(a - b) for a, b in zip(planned, reference, strict=True))
    return (
        f"| {name} | {len(plan.blocks)} | {keep:,} | {full:,} | {budget:,} | "
        f"{counts['none']}/{counts['selective']}/{counts['full']} | {plan.predicted_peak_bytes:,} | "
        f"{measured.peak_bytes:,} | {'yes' if measured.peak_bytes <= budget else 'NO'} | {loss_diff:.1e} | "
        f"{diff:.1e} | {time.perf_counter() - start:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", default="", help="comma-separated: run the examples whose name contains one"
    )
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(
        "| model | blocks | keep peak B | full peak B | budget B | none/selective/full | predicted B "
        "| measured B | fits | max loss diff | max param diff | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, example in examples().items():
        if any(part in name for part in args.only.split(",")):
            print(run(name, example, args.steps), flush=True)


if __name__ == "__main__":
    main()
