"""The chunked loss head (memfit.levers.loss_head): exact against the plain head, and smaller."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memfit.applying import allowed_levers, apply, remove_levers, site_of
from memfit.errors import ConfigError, LeverRefused
from memfit.levers.head import chunked_head_of, head_refusal
from memfit.levers.loss_head import default_chunk_tokens, linear_cross_entropy, plain_cross_entropy
from memfit.measuring.tracker import MemoryWatch
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.models.llama import llama
from memfit.records import Plan

FP32_TOL = {"rtol": 1e-4, "atol": 1e-6}
#: bf16 matmuls in both; chunked sums the weight gradient in fp32 where the plain head sums in bf16.
BF16_TOL = {"rtol": 2e-2, "atol": 2e-3}


def _inputs(
    tokens: tuple[int, ...] = (3, 11), hidden: int = 16, vocab: int = 300, bias: bool = False, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*tokens, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.1).requires_grad_() if bias else None
    y = torch.randint(0, vocab, tokens, generator=g)
    y.view(-1)[::5] = -100
    return h, w, b, y


def _grads(loss: torch.Tensor, *xs: torch.Tensor | None) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, [x for x in xs if x is not None]))


@pytest.mark.parametrize("chunk", [1, 4, 33, 1000])
@pytest.mark.parametrize(
    "kw",
    [{}, {"softcap": 2.5}, {"logit_scale": 0.0625}, {"reduction": "sum"}],
    ids=["plain", "softcap", "scale", "sum"],
)
@pytest.mark.parametrize("bias", [False, True])
def test_equals_cross_entropy_of_the_whole_logits_fp32(chunk: int, kw: dict, bias: bool) -> None:
    h, w, b, y = _inputs(bias=bias)
    ref = plain_cross_entropy(h, w, y, b, **kw)
    got = linear_cross_entropy(h, w, y, b, chunk_tokens=chunk, **kw)
    torch.testing.assert_close(got, ref, **FP32_TOL)
    for a, r in zip(_grads(got, h, w, b), _grads(ref, h, w, b), strict=True):
        torch.testing.assert_close(a, r, **FP32_TOL)


def test_reference_is_torch_cross_entropy_of_the_head() -> None:
    h, w, b, y = _inputs(bias=True)
    logits = h @ w.T + b
    direct = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
    torch.testing.assert_close(linear_cross_entropy(h, w, y, b, chunk_tokens=7), direct, **FP32_TOL)


def test_bf16_autocast_follows_the_plain_head() -> None:
    h, w, _, y = _inputs(tokens=(64,), hidden=32, vocab=1000)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, w, y, chunk_tokens=10)
        ref = plain_cross_entropy(h, w, y)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, **BF16_TOL)
    gh, gw = _grads(got, h, w)
    rh, rw = _grads(ref, h, w)
    assert gh.dtype == gw.dtype == torch.float32
    torch.testing.assert_close(gh, rh, **BF16_TOL)
    torch.testing.assert_close(gw, rw, **BF16_TOL)


def test_gradient_scales_with_the_upstream_gradient_and_runs_once() -> None:
    h, w, _, y = _inputs()
    (0.25 * linear_cross_entropy(h, w, y, chunk_tokens=5)).backward()
    ref_h, ref_w = _grads(0.25 * plain_cross_entropy(h, w, y), h, w)
    torch.testing.assert_close(h.grad, ref_h, **FP32_TOL)
    torch.testing.assert_close(w.grad, ref_w, **FP32_TOL)
    loss = linear_cross_entropy(h, w, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward twice"):
        loss.backward()


def test_without_grad_keeps_nothing_and_refuses_bad_shapes() -> None:
    h, w, _, y = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, y), plain_cross_entropy(h, w, y), **FP32_TOL)
    with pytest.raises(ConfigError, match="targets"):
        linear_cross_entropy(h, w, y[:, :3])
    with pytest.raises(ConfigError, match="head weight"):
        linear_cross_entropy(h, w.T, y)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        linear_cross_entropy(h, w, y, chunk_tokens=0)


def _head_peak(chunked: bool, tokens: int, hidden: int, vocab: int, chunk: int) -> int:
    torch.manual_seed(0)
    head = nn.Linear(hidden, vocab, bias=False)
    h0 = torch.randn(tokens, hidden, requires_grad=True)
    y = torch.randint(0, vocab, (tokens,))
    with MemoryWatch(head) as watch:
        h = h0 * 1.0
        if chunked:
            loss = linear_cross_entropy(h, head.weight, y, chunk_tokens=chunk)
        else:
            loss = plain_cross_entropy(h, head.weight, y)
        del h
        loss.backward()
    return watch.peak_bytes


def test_peak_at_a_32k_vocabulary_is_a_fraction_of_the_plain_head() -> None:
    """MemTracker's peak of forward + backward: at most a quarter of the plain head's."""
    vocab, tokens, hidden = 32768, 512, 64
    plain = _head_peak(False, tokens, hidden, vocab, 0)
    chunked = _head_peak(True, tokens, hidden, vocab, 64)
    weight = vocab * hidden * 4
    assert plain >= 3 * tokens * vocab * 4  # logits, log-softmax and their gradient at once
    assert chunked <= plain / 4, (chunked, plain)
    # what is left: the weight, its fp32 gradient, and a few chunks of logits
    assert chunked <= 2 * weight + 4 * 64 * vocab * 4 + 4 * tokens * hidden * 4
    assert default_chunk_tokens(vocab) == 256


# --- the chunked_loss lever on memfit's built-in models -------------------------------------


def _builtin(name: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    if name == "gpt":
        model: nn.Module = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=1000))
    else:
        model = llama(preset="tiny", vocab_size=1000).model
    x = torch.randint(0, 1000, (3, 16), generator=torch.Generator().manual_seed(1))
    return model, (x, torch.roll(x, -1, 1))


def _loss_and_grads(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = gpt_loss(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_lever_on_builtin_models_gives_the_plain_loss_and_gradients(name: str) -> None:
    model, batch = _builtin(name)
    ref_loss, ref_grads = _loss_and_grads(model, batch)
    opt = torch.optim.AdamW(model.parameters())
    assert apply(model, Plan(blocks={}, levers=["chunked_loss"]), opt).optimizer is opt
    assert chunked_head_of(model) == 8388  # 2**23 // 1000 tokens per chunk
    model.loss_chunk_tokens = 5  # several chunks at this small batch
    loss, grads = _loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss, **FP32_TOL)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], **FP32_TOL, msg=n)
    assert model(batch[0]).shape == (3, 16, 1000)  # without targets: logits, as before
    remove_levers(model, opt)
    assert chunked_head_of(model) is None


def test_lever_is_refused_on_a_model_without_a_known_head() -> None:
    seq = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    why = head_refusal(seq)
    assert why is not None and "Sequential" in why and "linear_cross_entropy" in why
    kept, refused = allowed_levers("all", site_of("cpu", None, "fp32", seq))
    assert "chunked_loss" not in kept and refused["chunked_loss"] == why
    with pytest.raises(LeverRefused, match="Sequential"):
        apply(seq, Plan(blocks={}, levers=["chunked_loss"]), torch.optim.SGD(seq.parameters()))
