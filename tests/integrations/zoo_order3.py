"""The zoo's third round: models whose blocks do not run in module order, or whose depth is random in
training.

Every setting not given here is the library's default: CLIP's two towers (defined text first, run
vision first), Wav2Vec2's ``layerdrop = 0.1`` (whole layers skipped at random in training) and its
SpecAugment masks, Swin's ``drop_path_rate = 0.1``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy
import torch
from torch import nn
from zoo import Batch, Entry, generator, layers

VOCAB = 32


def _hf(kind: str, model: str, **fields: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(kind, **fields)
        return getattr(transformers, model)(config).train()

    return build


def _clip_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, pixels = batch
    return model(input_ids=ids, pixel_values=pixels, return_loss=True).loss


def _captioned_images(seq: int, size: int) -> Callable[[int], Batch]:
    def make(n: int) -> Batch:
        g = generator()
        return torch.randint(0, VOCAB, (n, seq), generator=g), torch.randn(n, 3, size, size, generator=g)

    return make


def _ctc_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    audio, labels = batch
    # Wav2Vec2 draws its SpecAugment masks from numpy's global generator, which the zoo's
    # torch seed does not reach: seeded from torch's seed (a Python int, so it runs under
    # memfit.estimate's fake tensors too), one torch seed gives one step.
    numpy.random.seed(torch.initial_seed() % 2**32)
    return model(input_values=audio, labels=labels).loss


def _speech(samples: int, seq: int) -> Callable[[int], Batch]:
    def make(n: int) -> Batch:
        g = generator()
        return torch.randn(n, samples, generator=g), torch.randint(1, VOCAB, (n, seq), generator=g)

    return make


_TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)

ORDER3: list[Entry] = [
    Entry(
        "transformers/clip",
        _hf("clip", "CLIPModel", projection_dim=16,
            text_config=dict(vocab_size=VOCAB, max_position_embeddings=32, **_TOWER),
            vision_config=dict(image_size=32, patch_size=4, **_TOWER)),
        _clip_loss, _captioned_images(16, 32),
        layers("text_model.encoder.layers") + layers("vision_model.encoder.layers"),
        covers="two towers defined text first and run vision first, contrastive loss", estimate=True,
    ),
    Entry(
        "transformers/wav2vec2",
        _hf("wav2vec2", "Wav2Vec2ForCTC", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, conv_dim=(16, 16), conv_stride=(5, 2),
            conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4),
        _ctc_loss, _speech(2000, 8),
        layers("wav2vec2.feature_extractor.conv_layers") + layers("wav2vec2.encoder.layers"),
        covers="LayerDrop 0.1 (random depth in training), SpecAugment masks, CTC loss", estimate=True,
    ),
    # HF Swin (drop path 0.1 by default: stochastic depth as a random mask) is zoo_estimate3's.
]  # fmt: skip
