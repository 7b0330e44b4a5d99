"""The same call gives the same plan on a LoRA model while every core is busy (issue 25).

As tests/test_plan_repeat.py does for full fine-tuning: the time model's prices swing under
the load (See Note [plans repeat] in memfit/planning/choose.py), the plan must not. Timing
is never asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="memfit[peft] extra (transformers) not installed")
peft = pytest.importorskip("peft", reason="memfit[peft] extra (peft) not installed")

import memfit  # noqa: E402

VOCAB, SEQ = 96, 32


def _lora_llama(n_layer: int = 4) -> torch.nn.Module:
    """A Llama-style decoder from its config, LoRA on q_proj and v_proj (docs/lora.md)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=n_layer,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    base = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(base, lora).train()


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


@contextmanager
def _busy_cores() -> Iterator[list[subprocess.Popen[bytes]]]:
    """A Python process spinning on each core while the body runs, ended after it."""
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(os.cpu_count() or 1):
            hogs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


def _key(plan: memfit.Plan) -> str:
    return json.dumps((plan.blocks, plan.segments, plan.precision, plan.micro_batches))


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# Three decoder layers: at 70% the last layer kept or every layer checkpointed, at 95% the
# first layer fully checkpointed or the second selectively; under load, ties by time alone
# picked either, call by call.
@pytest.mark.parametrize("budget", ["70%", "95%"])
def test_three_plan_calls_on_a_lora_model_on_a_busy_machine_give_one_plan(budget: str) -> None:
    model = _lora_llama(n_layer=3)
    x = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with _busy_cores() as hogs:
        # fp32, as tests/integrations/test_peft_plan.py plans: auto also weighs bf16 on a CPU
        # that runs it natively, a choice between whole timed steps this rule does not cover
        plans = [memfit.plan(model, x, _loss, budget, opt, precision="fp32") for _ in range(3)]
        assert all(h.poll() is None for h in hogs)  # the load lasted every call
    assert len({_key(p) for p in plans}) == 1, [_key(p) for p in plans]
    assert any(m != "none" for m in plans[0].blocks.values())  # the budget needs checkpointing
    assert all(p.predicted_peak_bytes <= p.budget_bytes for p in plans)
