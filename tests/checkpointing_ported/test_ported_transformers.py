"""transformers' ``tests/test_modeling_common.py`` gradient-checkpointing training check, ported to
``memfit.checkpoint`` on seven model families.

The peer (``check_training_gradient_checkpointing``) builds each model from a small config,
turns on gradient checkpointing, trains one SGD step with ``labels=`` and asserts every
trainable parameter got a gradient. Here each family is built with the library's defaults
(caches on, dropout where the architecture has it), memfit checkpoints its blocks in full
or selective mode, and the step is compared with the plain model's from the same seed and
weights: loss, logits, every gradient, the weights after the step, the buffers and the RNG
stream, exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from ported import MODES, check
from torch import nn

transformers = pytest.importorskip("transformers")

VOCAB = 96
_DECODER = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
)
_IDS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0, max_position_embeddings=64)

#: family -> (model type, auto class, config fields, whether it takes decoder labels).
FAMILIES: dict[str, tuple[str, str, dict[str, Any], bool]] = {
    "gpt2": (
        "gpt2",
        "AutoModelForCausalLM",
        dict(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=VOCAB),
        False,
    ),
    "llama": ("llama", "AutoModelForCausalLM", dict(**_DECODER, **_IDS, num_key_value_heads=2), False),
    "qwen2": ("qwen2", "AutoModelForCausalLM", dict(**_DECODER, **_IDS, num_key_value_heads=2), False),
    "opt": (
        "opt",
        "AutoModelForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=32,
            max_position_embeddings=64,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=0,
        ),
        False,
    ),
    "bert": ("bert", "AutoModelForMaskedLM", dict(**_DECODER, max_position_embeddings=64), False),
    "t5": (
        "t5",
        "AutoModelForSeq2SeqLM",
        dict(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0
        ),
        True,
    ),
    "bart": (
        "bart",
        "AutoModelForSeq2SeqLM",
        dict(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
        ),
        True,
    ),
}


def _build(family: str) -> Callable[[], nn.Module]:
    kind, auto, fields, _ = FAMILIES[family]

    def build() -> nn.Module:
        config = transformers.AutoConfig.for_model(kind, **fields)
        return getattr(transformers, auto).from_config(config).train()

    return build


def _training_step(family: str, **call: Any) -> Callable[[nn.Module], Any]:
    seq2seq = FAMILIES[family][3]

    def case(m: nn.Module) -> Any:
        for p in m.parameters():  # the peer unfreezes every parameter
            p.requires_grad_(True)
        optimizer = torch.optim.SGD(m.parameters(), lr=0.01)
        x = torch.randint(1, VOCAB, (2, 12))
        labels = torch.randint(1, VOCAB, (2, 10)) if seq2seq else x
        out = m(input_ids=x, labels=labels, **call)
        out.loss.backward()
        missing = [n for n, p in m.named_parameters() if p.requires_grad and p.grad is None]
        assert not missing, f"parameters without a gradient: {missing}"
        optimizer.step()
        return out.loss, out.logits, [p.detach().clone() for p in m.parameters()]

    return case


#: With its cache on (the default) the plain model runs attention through the cache (keys and values
#: concatenated into it), while memfit turns a checkpointed block's cache off in training, as Hugging
#: Face's own gradient checkpointing does: another code path, which rounds differently (T5's logits
#: by up to 1e-6). The recompute itself is exact, which the run with caches off shows.
CACHE_ON = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("mode", MODES)
def test_training_gradient_checkpointing(mode: str, family: str) -> None:
    """check_training_gradient_checkpointing: one training step of a checkpointed model from its config,
    with the library's defaults (caches on), then with caches off in both models, exactly."""
    model = _build(family)()
    assert getattr(model.config, "use_cache", True) is not False  # the default, untouched
    check(_build(family), "auto", mode, _training_step(family), CACHE_ON)
    check(_build(family), "auto", mode, _training_step(family, use_cache=False))
