"""The loss head's bytes at a length it was not measured at: extrapolated from two short runs,
they equal the head measured at that length (fake tensors: a Llama 3 8B head costs nothing).

The plain head's peak moves from one moment to another as the tokens grow (short: the
weight's gradient beside the logits' gradient; long: the fp32 logits, their log-softmax and
its gradient), so a line through the two short runs' peaks misses it; each moment is a line
of its own (See Note [the head measured alone] in memfit.measuring.lever_facts).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.levers.head import HeadSpec
from memfit.levers.loss_head import default_chunk_tokens
from memfit.measuring.lever_facts import _at_tokens, head_cost

#: Llama 3's head: 128,256 x 4,096.
VOCAB, HIDDEN = 128_256, 4_096


def _spec(frozen: bool) -> HeadSpec:
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    head.weight.requires_grad_(not frozen)
    return HeadSpec(head=head, kind="hf")


@pytest.mark.parametrize("frozen", [False, True], ids=["trained head", "frozen head (LoRA)"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("chunked", [False, True], ids=["plain", "chunked"])
def test_extrapolated_head_equals_the_head_measured_at_the_length(
    frozen: bool, precision: str, chunked: bool
) -> None:
    unit = default_chunk_tokens(VOCAB)  # 65 tokens: measured at 130 and 260
    tokens = 12_288
    dtype = torch.float32
    with FakeTensorMode():
        spec = _spec(frozen)
        chunk = unit if chunked else None
        got = _at_tokens(spec, tokens, dtype, precision, chunk, unit)
        want = head_cost(spec, tokens, dtype, precision, chunk)
    print(f"{precision} frozen={frozen} chunked={chunked}: extrapolated {got}, measured {want}")
    for name in ("saved_bytes", "forward_peak_bytes", "backward_peak_bytes"):
        g, w = getattr(got, name), getattr(want, name)
        # exact for the plain head; the chunked head's last chunk is shorter at the length
        assert abs(g - w) <= (0 if not chunked else 0.01 * w + 4 * unit * VOCAB * 4), (name, g, w)


def test_a_frozen_head_makes_no_weight_gradient() -> None:
    """LoRA freezes the head: neither head, plain or chunked, holds its vocabulary x hidden
    fp32 gradient (on a trained head the chunked one does, from its forward on)."""
    with FakeTensorMode():
        trained, frozen = _spec(False), _spec(True)
        for chunk in (None, 65):
            a = head_cost(trained, 512, torch.float32, "fp32", chunk)
            b = head_cost(frozen, 512, torch.float32, "fp32", chunk)
            assert b.backward_peak_bytes < VOCAB * HIDDEN * 4 <= a.backward_peak_bytes, (chunk, a, b)
