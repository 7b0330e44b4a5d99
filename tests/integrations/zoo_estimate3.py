"""The zoo's third round: models whose construction or forward needs real values: data-dependent init,
narrow fake kernels, value checks in the forward.

Every setting not given here is the library's default.
"""

from __future__ import annotations

from zoo import Entry, layers
from zoo_hf import VOCAB, _hf, _image_loss_hf, _lm_loss, _tokens  # the zoo's own builders
from zoo_vision import CLASSES, _ce, _images, _timm

_SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
)
_IDS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0, max_position_embeddings=128)
_MOE = dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)

ESTIMATE3: list[Entry] = [
    Entry("timm/deit_tiny", _timm("deit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2,
                                  num_heads=2), _ce, _images(32), layers("blocks"),
          covers="DeiT: trunc_normal_ init and drop-path rates read with .item() in the constructor",
          estimate=True),
    Entry("transformers/modernbert",
          _hf("modernbert", "AutoModelForMaskedLM", **_SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              cls_token_id=1, sep_token_id=2, mask_token_id=3, max_position_embeddings=128),
          _lm_loss, _tokens(32), layers("model.layers"),
          covers="ModernBERT: trunc_normal_ init, alternating local/global attention", estimate=True),
    Entry("transformers/dinov2",
          _hf("dinov2", "AutoModelForImageClassification", hidden_size=32, num_hidden_layers=2,
              num_attention_heads=2, mlp_ratio=2, image_size=32, patch_size=8, num_labels=CLASSES),
          _image_loss_hf, _images(32), layers("dinov2.encoder.layer"),
          covers="DINOv2: trunc_normal_ init, layer scale", estimate=True),
    Entry("transformers/swin",
          _hf("swin", "AutoModelForImageClassification", image_size=32, patch_size=2, embed_dim=16,
              depths=[2, 2], num_heads=[2, 4], window_size=4, num_labels=CLASSES),
          _image_loss_hf, _images(32), layers("swin.encoder.layers"),
          covers="Swin: shifted windows, relative-position index buffers", estimate=True),
    Entry("transformers/qwen3_moe", _hf("qwen3_moe", "AutoModelForCausalLM", **_SMALL, **_IDS, **_MOE,
                                        moe_intermediate_size=16),
          _lm_loss, _tokens(32), layers("model.layers"),
          covers="mixture of experts through grouped_mm (fp32 on the CPU; its fake kernel takes bf16 only)",
          estimate=True),
    Entry("transformers/jamba", _hf("jamba", "AutoModelForCausalLM", **{**_SMALL, "num_hidden_layers": 4},
                                    **_IDS, **_MOE, attn_layer_period=2, attn_layer_offset=1,
                                    expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8,
                                    mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4),
          _lm_loss, _tokens(32), layers("model.layers", 4),
          covers="Jamba: Mamba and attention layers, experts through grouped_mm (four layers: with two, "
                 "full checkpointing saves nothing)", estimate=True),
    Entry("transformers/recurrent_gemma",
          _hf("recurrent_gemma", "AutoModelForCausalLM", num_hidden_layers=3, vocab_size=VOCAB,
              hidden_size=32,
              intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, lru_width=32,
              attention_window_size=16, head_dim=16, block_types=["recurrent", "recurrent", "attention"]),
          _lm_loss, _tokens(16), layers("model.layers", 3),
          covers="recurrent state and a use_cache flag passed to its layers by position", estimate=True),
]  # fmt: skip
