"""A fake-tensor twin of a Hugging Face decoder takes the attention path its real step takes.

transformers' masking code treats a fake tensor as tracing and, unless it may read the
positions, builds an explicit (batch, 1, T, T) mask that the real step never holds
(See Note [positions keep their values]). Here the twin's SDPA calls receive what the real
step's receive (no mask and ``is_causal=True``, or the padding mask where a token is padded),
and the twin's step peak is the real step's to the byte.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="memfit[hf] extra (transformers) not installed")

from memfit.measuring.phases import phased_step  # noqa: E402
from memfit.measuring.preserve import create_optimizer_state  # noqa: E402
from memfit.measuring.twin import make_twin  # noqa: E402
from memfit.precision import Precision  # noqa: E402

VOCAB = 300
SEQ = 48
Call = tuple[tuple[int, ...] | None, bool]


def _llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=172, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=VOCAB, tie_word_embeddings=False, use_cache=False,
        max_position_embeddings=1024, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).train()


@contextmanager
def _sdpa_calls() -> Iterator[list[Call]]:
    """Record (mask shape or None, is_causal) of every SDPA call inside."""
    calls: list[Call] = []
    original = nn.functional.scaled_dot_product_attention

    def spy(q: Any, k: Any, v: Any, attn_mask: Any = None, *args: Any, **kwargs: Any) -> Any:
        calls.append((None if attn_mask is None else tuple(attn_mask.shape), bool(kwargs.get("is_causal"))))
        return original(q, k, v, attn_mask, *args, **kwargs)

    nn.functional.scaled_dot_product_attention = spy
    try:
        yield calls
    finally:
        nn.functional.scaled_dot_product_attention = original


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, mask = batch
    out: torch.Tensor = model(input_ids=x, attention_mask=mask, labels=x).loss
    return out


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "one-padded-token"])
def test_twin_attention_path_and_peak_equal_the_real_step(padded: bool) -> None:
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    if padded:
        mask[0, 0] = 0
    batch = (x, mask)
    twin = make_twin(model, opt, batch)
    with _sdpa_calls() as fake_calls, twin.running():
        create_optimizer_state(twin.model, twin.optimizer)
        fake = phased_step(twin.model, twin.batch, _loss, twin.optimizer, Precision("fp32"), [])
    create_optimizer_state(model, opt)
    with _sdpa_calls() as real_calls:
        real = phased_step(model, batch, _loss, opt, Precision("fp32"), [])
    assert real_calls and fake_calls == real_calls
    assert real_calls[0] == (((1, 1, SEQ, SEQ), False) if padded else (None, True))
    assert fake.peak == real.peak


def test_masking_code_is_given_back_its_own_check() -> None:
    masking = pytest.importorskip("transformers.masking_utils")
    before = masking.is_tracing
    model = _llama()
    x = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    twin = make_twin(model, None, x)
    with twin.running():
        assert masking.is_tracing is not before
        twin.model(input_ids=twin.batch).logits.sum()
    assert masking.is_tracing is before
