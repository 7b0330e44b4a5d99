"""What the levers change, counted from the model and optimizer: :class:`LeverFacts`."""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.records.base import Record
from memfit.records.long_context import HostLinkFacts, TiledMlpFacts

__all__ = ["FrozenFacts", "HeadCost", "HeadFacts", "LeverFacts"]


@dataclass
class HeadCost(Record):
    """Bytes of one loss head (projection + cross-entropy) on the step's hidden states, as
    MemTracker counts them, each above the total just before the head runs (its input alive)."""

    saved_bytes: int = 0
    """Kept from the head's forward to its backward (the input's bytes out when it is not kept)."""
    forward_peak_bytes: int = 0
    """Highest while the head's forward runs."""
    backward_peak_bytes: int = 0
    """Highest while the head's backward runs (its weight's gradient included where the head is trained)."""


@dataclass
class HeadFacts(Record):
    """The loss head of a step, plain and chunked (the ``chunked_loss`` lever), measured on the
    head alone at the step's shape: :func:`memfit.measuring.lever_facts.head_facts`."""

    tokens: int = 0
    """Tokens whose logits the step makes (batch x sequence)."""
    hidden: int = 0
    vocab: int = 0
    chunk_tokens: int = 0
    """Tokens per chunk of the chunked head :attr:`chunked` describes (the default for the
    vocabulary as measured; the planner's chosen chunk in the profiles it plans from)."""
    plain: HeadCost = field(default_factory=HeadCost)
    chunked: HeadCost = field(default_factory=HeadCost)
    weight_grad_bytes: int = 0
    """The chunked head's fp32 weight gradient, made in its forward: it does not shrink with
    micro-batches."""
    refused: str = ""
    """Why the lever cannot shrink this step's head ("" : it can), e.g. a loss that reads the logits."""
    default_chunk_tokens: int = 0
    """The default chunk (:func:`memfit.levers.loss_head.default_chunk_tokens`, at most
    :attr:`tokens`) and :attr:`default_cost` its measured cost (0: not measured, older facts)."""
    default_cost: HeadCost = field(default_factory=HeadCost)
    small_chunk_tokens: int = 0
    """The smallest chunk of the planner's ladder, and :attr:`small_cost` its measured cost
    (0: not measured): with the default's, the two points every other chunk is predicted
    from (:func:`memfit.stepmodel.head_chunks.head_cost_at`)."""
    small_cost: HeadCost = field(default_factory=HeadCost)


@dataclass
class FrozenFacts(Record):
    """The frozen weights of a step (``frozen_bf16``, ``frozen_nf4``), counted on the model and
    measured: :func:`memfit.measuring.lever_facts.frozen_facts`."""

    numel: int = 0
    """Elements of the frozen floating parameters (what ``frozen_bf16`` casts)."""
    held_bytes: int = 0
    """Their bytes as profiled."""
    nf4: dict[str, list[int]] = field(default_factory=dict)
    """Per part (a block's name, or ``""`` outside the blocks): elements of each frozen Linear
    weight ``frozen_nf4`` replaces."""
    nf4_bytes: int = 0
    """Bytes of those weights in NF4, from two converted probes (the bytes are linear in the
    elements: codes, block scales, their scales, the 16-entry table)."""
    nf4_forward_temp_per_element: float = 0.0
    """Bytes above the input of one NF4 Linear's forward (its weight dequantized), per element
    of the weight, measured on a probe (the larger of fp32 and bf16 inputs)."""
    nf4_backward_temp_per_element: float = 0.0
    """Same for its backward (the weight dequantized again for the input's gradient)."""
    saved_delta: dict[str, dict[str, int]] = field(default_factory=dict)
    """Lever set (``frozen_bf16``, ``frozen_nf4`` or ``frozen_bf16,frozen_nf4``) -> part -> bytes
    autograd saves in one forward with those levers minus without (mode ``none``, measured)."""


@dataclass
class LeverFacts(Record):
    """The numbers the lever objects of :mod:`memfit.applying` turn into a lever set's bytes.

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
    weights_saved_delta: dict[str, int] = field(default_factory=dict)
    """Per part: bytes autograd saves in one bf16 forward with bf16 weights minus with the weights
    as profiled (the bf16 casts of fp32 weights that matmuls save); empty: not measured."""
    amsgrad: bool = False
    """The optimizer keeps a third moment (AMSGrad)."""
    optimizer: str = "none"
    """The optimizer's family (``AdamW``, ``Adam``, ``SGD``...)."""
    step_eager: bool = False
    """torchao's optimizer step will run eagerly in training (dynamo disabled when the facts were
    measured), so it steps in eager slices (Note [pricing the step that runs] in
    :mod:`memfit.stepmodel.state_bytes`); False: compiled."""
    step_temp_per_element: dict[str, float] = field(default_factory=dict)
    """``"<kind>/<weights>"`` (kind ``orig`` for the user's own optimizer, or ``fp32`` / ``bf16`` /
    ``8bit`` / ``4bit``; weights ``fp32`` / ``bf16``) -> temporaries of one parameter's step,
    in bytes per element (measured on a 65,536-element parameter)."""
    head: HeadFacts | None = None
    """The loss head's bytes, plain and chunked (None: not measured; ``chunked_loss`` is not predicted)."""
    frozen: FrozenFacts | None = None
    """The frozen weights' facts (None: not measured, or the model has no frozen weights)."""
    tiled_mlp: TiledMlpFacts | None = None
    """One block's MLP plain and tiled (None: not measured; ``tiled_mlp`` is not predicted)."""
    host_link: HostLinkFacts | None = None
    """The link between the device and pinned host memory (None: not measured; ``offload`` is
    not priced)."""
    step_seconds_per_element: dict[str, float] = field(default_factory=dict)
    """Same keys: seconds of one parameter's step per element (median of 3 eager steps; torchao
    compiles its step in training, so for its kinds an upper bound)."""
