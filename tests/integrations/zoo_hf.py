"""The zoo's Hugging Face models: built from config classes (random weights), trained with ``labels=``.

Every config field not set here is the library's default: decoders keep ``use_cache=True``,
dropout stays where the architecture has it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from zoo import Batch, Entry, generator, layers

VOCAB = 96


def _hf(kind: str, auto: str = "AutoModelForCausalLM", **fields: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(kind, **fields)
        return getattr(transformers, auto).from_config(config).train()

    return build


def _tokens(seq: int) -> Callable[[int], Batch]:
    return lambda n: torch.randint(0, VOCAB, (n, seq), generator=generator())


def _lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


def _seq2seq_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return model(input_ids=x, labels=y).loss


def _pairs(seq: int) -> Callable[[int], Batch]:
    def make(n: int) -> Batch:
        g = generator()
        return torch.randint(1, VOCAB, (n, seq), generator=g), torch.randint(1, VOCAB, (n, seq), generator=g)

    return make


def _whisper_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    features, y = batch
    return model(input_features=features, labels=y).loss


def _audio(mels: int, frames: int, seq: int) -> Callable[[int], Batch]:
    def make(n: int) -> Batch:
        g = generator()
        return torch.randn(n, mels, frames, generator=g), torch.randint(1, VOCAB, (n, seq), generator=g)

    return make


def _image_loss_hf(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return model(pixel_values=x, labels=y).loss


_DEC = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
)
_DEC_IDS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0, max_position_embeddings=128)


HF: list[Entry] = [
    Entry(
        "transformers/gpt2",
        _hf("gpt2", n_layer=2, n_embd=32, n_head=4, n_positions=128, vocab_size=VOCAB),
        _lm_loss,
        _tokens(32),
        layers("transformer.h"),
        covers="decoder, cache on, dropout, Conv1D",
    ),
    Entry(
        "transformers/llama",
        _hf("llama", **_DEC, **_DEC_IDS, num_key_value_heads=2),
        _lm_loss,
        _tokens(32),
        layers("model.layers"),
        covers="decoder, cache on, grouped-query attention, RoPE",
    ),
    Entry("transformers/mistral", _hf("mistral", **_DEC, **_DEC_IDS, num_key_value_heads=2, head_dim=8),
          _lm_loss, _tokens(32), layers("model.layers"), covers="decoder, cache on, sliding window"),
    Entry("transformers/qwen2", _hf("qwen2", **_DEC, **_DEC_IDS, num_key_value_heads=2),
          _lm_loss, _tokens(32), layers("model.layers"), covers="decoder, cache on"),
    Entry("transformers/gemma", _hf("gemma", **_DEC, **_DEC_IDS, num_key_value_heads=1, head_dim=8),
          _lm_loss, _tokens(32), layers("model.layers"), covers="decoder, cache on, tied embeddings"),
    Entry("transformers/phi", _hf("phi", **_DEC, **_DEC_IDS),
          _lm_loss, _tokens(32), layers("model.layers"), covers="decoder, cache on, partial RoPE, parallel"),
    Entry("transformers/gpt_neox", _hf("gpt_neox", **_DEC, **_DEC_IDS),
          _lm_loss, _tokens(32), layers("gpt_neox.layers"), covers="decoder, cache on, parallel residual"),
    Entry(
        "transformers/opt",
        _hf("opt", vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
            word_embed_proj_dim=32, max_position_embeddings=128, pad_token_id=1, bos_token_id=0,
            eos_token_id=0),
        _lm_loss, _tokens(32), layers("model.decoder.layers"), covers="decoder, cache on, learned positions",
    ),
    Entry(
        "transformers/falcon",
        _hf("falcon", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            bos_token_id=0, eos_token_id=0),
        _lm_loss, _tokens(32), layers("transformer.h"), covers="decoder, cache on, multi-query, ALiBi off",
    ),
    Entry(
        "transformers/mixtral",
        _hf("mixtral", **_DEC, **_DEC_IDS, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        _lm_loss, _tokens(32), layers("model.layers"), covers="mixture of experts, cache on",
    ),
    Entry(
        "transformers/qwen2_moe",
        _hf("qwen2_moe", **_DEC, **_DEC_IDS, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32),
        _lm_loss, _tokens(32), layers("model.layers"), covers="mixture of experts with a shared expert",
    ),
    Entry(
        "transformers/mamba",
        _hf("mamba", vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
            bos_token_id=0, eos_token_id=0, pad_token_id=0),
        _lm_loss, _tokens(32), layers("backbone.layers"), covers="state-space model, cache on",
    ),
    Entry(
        "transformers/t5",
        _hf("t5", "AutoModelForSeq2SeqLM", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
            num_decoder_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
        _seq2seq_loss, _pairs(24), layers("encoder.block") + layers("decoder.block"),
        covers="encoder-decoder, relative position bias, cache on",
    ),
    Entry(
        "transformers/bart",
        _hf("bart", "AutoModelForSeq2SeqLM", vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
            decoder_start_token_id=2),
        _seq2seq_loss, _pairs(24), layers("model.encoder.layers") + layers("model.decoder.layers"),
        covers="encoder-decoder, different encoder and decoder layer classes",
    ),
    Entry(
        "transformers/whisper",
        _hf("whisper", "AutoModelForSpeechSeq2Seq", vocab_size=VOCAB, d_model=32, encoder_layers=2,
            decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=16, max_target_positions=32,
            pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0,
            suppress_tokens=None, begin_suppress_tokens=None),
        _whisper_loss, _audio(16, 32, 16), layers("model.encoder.layers") + layers("model.decoder.layers"),
        covers="speech encoder-decoder, conv stem",
    ),
    Entry(
        "transformers/bert",
        _hf("bert", "AutoModelForMaskedLM", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=64, max_position_embeddings=64),
        _lm_loss, _tokens(32), layers("bert.encoder.layer"), covers="encoder, masked LM",
    ),
]  # fmt: skip
