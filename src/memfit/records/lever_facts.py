"""What the levers change, counted from the model and optimizer: :class:`LeverFacts`."""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.records.base import Record

__all__ = ["HeadCost", "HeadFacts", "LeverFacts"]


@dataclass
class HeadCost(Record):
    """Bytes of one loss head (projection + cross-entropy) on the step's hidden states, as
    MemTracker counts them, each above the total just before the head runs (its input alive)."""

    saved_bytes: int = 0
    """Kept from the head's forward to its backward (the input's bytes out when it is not kept)."""
    forward_peak_bytes: int = 0
    """Highest while the head's forward runs."""
    backward_peak_bytes: int = 0
    """Highest while the head's backward runs (its weight's gradient included)."""


@dataclass
class HeadFacts(Record):
    """The loss head of a step, plain and chunked (the ``chunked_loss`` lever), measured on the
    head alone at the step's shape: :func:`memfit.measuring.lever_facts.head_facts`."""

    tokens: int = 0
    """Tokens whose logits the step makes (batch x sequence)."""
    hidden: int = 0
    vocab: int = 0
    chunk_tokens: int = 0
    """Tokens per chunk of the chunked head."""
    plain: HeadCost = field(default_factory=HeadCost)
    chunked: HeadCost = field(default_factory=HeadCost)
    weight_grad_bytes: int = 0
    """The chunked head's fp32 weight gradient, made in its forward: it does not shrink with
    micro-batches."""
    refused: str = ""
    """Why the lever cannot shrink this step's head ("" : it can), e.g. a loss that reads the logits."""


@dataclass
class LeverFacts(Record):
    """The numbers :mod:`memfit.stepmodel.with_levers` turns into a lever set's bytes.

    Parameter counts are exact (read from the model); the step's temporaries per element
    are measured once per optimizer kind on a parameter of its own (MemTracker, the step
    run eagerly), since a fused step holds one parameter's temporaries inside the backward.
    """

    params: dict[str, list[int]] = field(default_factory=dict)
    """Per part (a block's name, or ``""`` for everything outside the blocks): the element
    counts of its trainable floating parameters (a shared parameter counted once)."""
    frozen_numel: int = 0
    """Elements of floating parameters that do not train (cast by ``weights_bf16`` too)."""
    other_bytes: int = 0
    """Bytes of buffers and non-floating parameters (no lever changes them)."""
    weight_bytes: int = 4
    """Bytes per element of the floating parameters as profiled (4: fp32, 2: bf16)."""
    amsgrad: bool = False
    """The optimizer keeps a third moment (AMSGrad)."""
    optimizer: str = "none"
    """The optimizer's family (``AdamW``, ``Adam``, ``SGD``...)."""
    step_temp_per_element: dict[str, float] = field(default_factory=dict)
    """``"<kind>/<weights>"`` (kind ``orig`` for the user's own optimizer, or ``fp32`` / ``bf16`` /
    ``8bit`` / ``4bit``; weights ``fp32`` / ``bf16``) -> temporaries of one parameter's step,
    in bytes per element (measured on a 65,536-element parameter)."""
    head: HeadFacts | None = None
    """The loss head's bytes, plain and chunked (None: not measured; ``chunked_loss`` is not predicted)."""
    step_seconds_per_element: dict[str, float] = field(default_factory=dict)
    """Same keys: seconds of one parameter's step per element (median of 3 eager steps; torchao
    compiles its step in training, so for its kinds an upper bound)."""
