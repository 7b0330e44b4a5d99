"""The ``chunked_loss`` lever: a model's loss head computed in chunks of tokens.

:func:`install_chunked_head` makes a model compute its training loss with
:func:`memfit.levers.loss_head.linear_cross_entropy`, so the whole logits tensor never
exists; :func:`remove_chunked_head` undoes it. It applies to

- memfit's built-in GPT and LLaMA (:mod:`memfit.models`), whose ``forward(idx, targets)``
  returns the loss (``gpt_loss`` passes the targets);
- Hugging Face causal LMs called with ``labels=`` (their own loss): a removable forward
  layer (:mod:`memfit.checkpointing.layers`) runs the decoder, then the chunked head on
  its hidden states with the model's label shift, ``ignore_index``, tied or untied head
  weight, head bias, ``logit_scale`` (Cohere), ``1 / logits_scaling`` (Granite) and
  ``final_logit_softcapping`` (Gemma 2), and returns the output with ``logits=None``.
  Called without labels, the model is unchanged.

Other models are refused with the reason (:func:`head_refusal`). Trade-off: the model's
output has no logits when the lever is on and labels are given; a loss function that reads
``.logits`` itself gains nothing (the planner finds out, :func:`memfit.measuring.lever_facts.head_facts`).

Example:
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=8))
    >>> x = torch.randint(0, 256, (2, 8))
    >>> plain = gpt_loss(model, (x, x))
    >>> install_chunked_head(model, chunk_tokens=4)
    >>> chunked_head_of(model), torch.allclose(gpt_loss(model, (x, x)), plain)
    (4, True)
    >>> remove_chunked_head(model); chunked_head_of(model) is None
    True
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.checkpointing.layers import forward_layers, set_forward_layer
from memfit.devices import unwrap
from memfit.levers.loss_head import IGNORE_INDEX, default_chunk_tokens, linear_cross_entropy

__all__ = [
    "HF_HEAD_TYPES",
    "HeadSpec",
    "chunked_head_of",
    "chunked_head_on",
    "find_head",
    "head_refusal",
    "install_chunked_head",
    "remove_chunked_head",
]

_TAG = "chunked_loss"

#: Hugging Face model types whose causal-LM forward is ``decoder -> lm_head -> (scale or
#: soft-cap) -> self.loss_function``, so the chunked head computes exactly their loss.
HF_HEAD_TYPES = (
    "cohere",
    "gemma",
    "gemma2",
    "gpt2",
    "granite",
    "llama",
    "mistral",
    "olmo2",
    "phi",
    "phi3",
    "qwen2",
    "qwen3",
    "starcoder2",
)


@dataclass(frozen=True)
class HeadSpec:
    """How a model turns its last hidden states into logits: the head's Linear and its post-ops."""

    head: nn.Linear
    kind: str
    """``builtin`` (memfit's GPT / LLaMA) or ``hf`` (a Hugging Face causal LM)."""
    logit_scale: float | None = None
    softcap: float | None = None

    @property
    def vocab(self) -> int:
        """The vocabulary size (the head's output features)."""
        return int(self.head.weight.shape[0])


def _hf_scale(config: Any) -> float | None:
    if config.model_type == "cohere":
        return float(config.logit_scale)
    if config.model_type == "granite":
        return 1.0 / float(config.logits_scaling)
    return None


def head_refusal(model: nn.Module) -> str | None:
    """Why ``chunked_loss`` cannot run on ``model`` (one sentence), or None when it can."""
    inner = unwrap(model)
    if hasattr(inner, "loss_chunk_tokens"):
        return None if isinstance(getattr(inner, "head", None), nn.Linear) else _no_head(inner)
    config = getattr(inner, "config", None)
    kind = getattr(config, "model_type", None)
    if kind is None:
        return (
            f"chunked_loss computes the loss inside memfit's GPT and LLaMA and Hugging Face causal LMs; "
            f"{type(inner).__name__} is neither: call memfit.levers.loss_head.linear_cross_entropy in "
            "your own loss, or leave chunked_loss out."
        )
    if kind not in HF_HEAD_TYPES:
        return (
            f"chunked_loss does not know how the Hugging Face model type {kind!r} turns hidden states "
            f"into logits (it knows {', '.join(HF_HEAD_TYPES)}); leave chunked_loss out."
        )
    if getattr(inner, "_loss_function", None) is not None or getattr(inner, "loss_type", None) not in (
        None,
        "ForCausalLM",
    ):
        return "chunked_loss computes Hugging Face's causal-LM loss; this model has a loss of its own."
    if not isinstance(getattr(inner, "lm_head", None), nn.Linear):
        return _no_head(inner)
    return None


def _no_head(model: nn.Module) -> str:
    return f"chunked_loss needs the head as an nn.Linear; {type(model).__name__}'s is not one."


def find_head(model: nn.Module) -> HeadSpec | None:
    """The head of a model the lever can run on (:func:`head_refusal` is None), else None."""
    if head_refusal(model) is not None:
        return None
    inner = unwrap(model)
    if hasattr(inner, "loss_chunk_tokens"):
        return HeadSpec(inner.head, "builtin")  # type: ignore[arg-type]
    config = inner.config
    cap = getattr(config, "final_logit_softcapping", None)
    return HeadSpec(inner.lm_head, "hf", _hf_scale(config), None if cap is None else float(cap))  # type: ignore[arg-type]


@dataclass
class _HFLayer:
    """The forward layer's state: the model (to reach its decoder and head) and the chunk size."""

    model: nn.Module
    chunk_tokens: int


def install_chunked_head(model: nn.Module, chunk_tokens: int | None = None) -> None:
    """Make ``model`` compute its loss in chunks of ``chunk_tokens`` tokens (default: by vocabulary).

    Raises:
        LeverRefused: the model's head is not one the lever knows (:func:`head_refusal`).
    """
    from memfit.errors import LeverRefused

    spec = find_head(model)
    if spec is None:
        raise LeverRefused(head_refusal(model) or "chunked_loss cannot run on this model.", _TAG)
    chunk = chunk_tokens or default_chunk_tokens(spec.vocab)
    inner = _root(model)
    if spec.kind == "builtin":
        setattr(inner, "loss_chunk_tokens", chunk)  # noqa: B010 (a plain attribute of memfit's models)
    else:
        set_forward_layer(inner, _TAG, _hf_forward, _HFLayer(inner, chunk))


@contextmanager
def chunked_head_on(model: nn.Module, chunk_tokens: int | None = None) -> Iterator[None]:
    """``model``'s loss in chunks inside the context (:func:`install_chunked_head`), its head as
    it was after (a chunked head of another size comes back).

    Example:
        >>> from memfit.models.gpt import GPT, GPTConfig
        >>> model = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=1, block_size=8))
        >>> with chunked_head_on(model, 4):
        ...     chunked_head_of(model)
        4
        >>> chunked_head_of(model) is None
        True
    """
    before = chunked_head_of(model)
    install_chunked_head(model, chunk_tokens)
    try:
        yield
    finally:
        remove_chunked_head(model)
        if before is not None:
            install_chunked_head(model, before)


def remove_chunked_head(model: nn.Module) -> None:
    """Take the lever off (the plain head again); a model without it is left as it is."""
    inner = _root(model)
    if getattr(inner, "loss_chunk_tokens", None) is not None:
        setattr(inner, "loss_chunk_tokens", None)  # noqa: B010
    if _TAG in forward_layers(inner):
        set_forward_layer(inner, _TAG, None)


def _root(model: nn.Module) -> nn.Module:
    """The model whose forward computes the loss: inside DDP, and inside a peft wrapper its base
    model (whose ``base_model_prefix`` names the decoder; the wrapper's names the base model)."""
    inner = unwrap(model)
    base = getattr(inner, "get_base_model", None)
    found = base() if callable(base) else inner
    return found if isinstance(found, nn.Module) else inner


def chunked_head_of(model: nn.Module) -> int | None:
    """Tokens per chunk of the lever on ``model``, or None when its head is plain."""
    inner = _root(model)
    chunk = getattr(inner, "loss_chunk_tokens", None)
    if chunk is not None:
        return int(chunk)
    layer = forward_layers(inner).get(_TAG)
    return None if layer is None else int(layer.state.chunk_tokens)


def _hf_arguments(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name (``**kwargs`` flattened in)."""
    bound = inspect.signature(type(model).forward).bind(model, *args, **kwargs)
    named = dict(bound.arguments)
    named.pop("self", None)
    for name, p in inspect.signature(type(model).forward).parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(name, {}))
    return named


def _hf_forward(inner: Any, layer: _HFLayer, *args: Any, **kwargs: Any) -> Any:
    """A Hugging Face causal LM's forward with the chunked head when ``labels`` are given."""
    model = layer.model
    named = _hf_arguments(model, args, kwargs)
    labels = named.pop("labels", None)
    if labels is None:
        return inner(*args, **kwargs)
    named.pop("logits_to_keep", None)
    return_dict = named.pop("return_dict", None)
    shift = named.pop("shift_labels", None)
    ignore = named.pop("ignore_index", IGNORE_INDEX)
    num_items = named.get("num_items_in_batch")
    decoder = getattr(model, str(model.base_model_prefix))
    out = decoder(**{k: v for k, v in named.items() if v is not None})
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    if shift is None:
        shift = F.pad(labels, (0, 1), value=ignore)[..., 1:]
    spec = find_head(model)
    assert spec is not None
    loss = linear_cross_entropy(
        hidden,
        spec.head.weight,
        shift.to(hidden.device),
        spec.head.bias,
        ignore_index=ignore,
        logit_scale=spec.logit_scale,
        softcap=spec.softcap,
        reduction="sum" if num_items is not None else "mean",
        chunk_tokens=layer.chunk_tokens,
    )
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    return _hf_output(loss, out, return_dict)


def _hf_output(loss: torch.Tensor, out: Any, return_dict: bool | None) -> Any:
    """The causal-LM output: the loss, no logits, the decoder's cache / states / attentions."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if return_dict is False:
        return (loss,)
    fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} - {"loss", "logits"}
    rest = {name: getattr(out, name, None) for name in fields}
    return CausalLMOutputWithPast(loss=loss, logits=None, **rest)
