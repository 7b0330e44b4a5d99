"""Hugging Face RecurrentGemma passes ``use_cache`` to its layers by position (issue 27, case 1):
checkpointed in every mode, its loss and gradients equal the plain model's."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="memfit[hf] extra (transformers) not installed")

import memfit  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6


def _recurrent_gemma() -> torch.nn.Module:
    cfg = transformers.RecurrentGemmaConfig(
        num_hidden_layers=3, vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, lru_width=32, attention_window_size=16, head_dim=16,
        block_types=["recurrent", "recurrent", "attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.RecurrentGemmaForCausalLM(cfg)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recurrent_gemma_checkpointed_equals_plain(mode: str) -> None:
    model = _recurrent_gemma()
    ref = copy.deepcopy(model)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    assert len(memfit.find_blocks(model)) == 3
    memfit.checkpoint(model, mode=mode)  # type: ignore[arg-type]
    loss = model(input_ids=x, labels=x).loss  # the model's defaults: use_cache on
    loss.backward()
    expected = ref(input_ids=x, labels=x).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)
