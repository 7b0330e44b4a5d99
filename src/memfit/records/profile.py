"""Per-block costs of a training step, the planner's input: :class:`BlockStats` and :class:`Profile`."""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.records.base import Record
from memfit.records.lever_facts import LeverFacts

__all__ = ["BlockStats", "Profile", "Speed"]


@dataclass
class BlockStats(Record):
    """Measured costs of one block (or of everything outside the blocks).

    Dicts are keyed by checkpointing mode (:data:`memfit.vocab.CHECKPOINT_MODES`); a number for mode
    ``m`` was taken with *every* block in mode ``m``. Memory numbers are differences of
    MemTracker totals (all categories) in bytes, so they add up; see :class:`Profile` for
    how a simulator adds them up to the step's peak.

    For a block:

    - ``saved_bytes[m]``: bytes the block's forward created that are still alive when the
      whole forward ends: what it keeps until its backward (for ``full``: its input; for
      ``selective``: also matmul/attention/conv outputs; for ``none``: everything autograd
      saves). Its output counts here when the next block keeps it. The first block's also
      counts ``stem_saved_bytes[m]``.
    - ``held_bytes[m]``: total when its forward returns minus total when it starts: the
      saved bytes plus what it holds only until the forward ends (autocast's cached weight
      casts, for example).
    - ``forward_peak_bytes[m]``: highest total while its forward runs minus the total when
      it starts (so at least ``held_bytes[m]``).
    - ``backward_peak_bytes[m]``: highest total while its backward runs (recompute
      included) minus what is kept then: parameters, optimizer state, the gradients that
      exist when its backward starts, ``Profile.outside_before_kept_bytes`` and the saved
      bytes of this block and every block before it. It covers the recomputed
      activations, the incoming and outgoing activation gradients, its own parameter
      gradients and weight-gradient temporaries.

    For the outside part (everything not in a block: embeddings, final norm, head, loss):

    - ``saved_bytes[m]``: activation total at the end of the forward minus the blocks'
      ``saved_bytes[m]``: what the outside keeps for backward (with the batch input).
    - ``forward_peak_bytes[m]``: highest (total - parameters and optimizer state - blocks'
      held bytes of the blocks whose forward has finished) at any moment of the forward
      outside every block: the loss and head transients on top of what the outside keeps.
    - ``backward_peak_bytes[m]``: highest (total - parameters and optimizer state - saved
      bytes of blocks not yet backwarded - gradients of blocks already backwarded) at any
      moment of the backward outside every block (loss, head and embedding backward).
    """

    name: str
    param_bytes: int = 0
    """Bytes of the parameters and buffers of this part."""
    saved_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes the part keeps from its forward until its backward, per mode."""
    backward_peak_bytes: dict[str, int] = field(default_factory=dict)
    """Transient bytes above what is kept while its backward runs (recompute included)."""
    forward_seconds: float = 0.0
    """Median forward time (plain forward; the same in every mode)."""
    backward_seconds: dict[str, float] = field(default_factory=dict)
    """Median backward time per mode, recompute included."""
    forward_flops: int = 0
    """FLOPs of its forward (FlopCounterMode; ops it has no formula for count 0)."""
    backward_flops: dict[str, int] = field(default_factory=dict)
    """Backward FLOPs per mode, recompute included."""
    grad_bytes: int = 0
    """Bytes of its parameters' gradients (created during its backward, kept to the step)."""
    forward_peak_bytes: dict[str, int] = field(default_factory=dict)
    """Transient peak of its forward above the total when it started, per mode."""
    forward_fixed_bytes: int = 0
    """Part of ``forward_peak_bytes`` that does not shrink with micro-batches (FSDP2's
    all-gathered parameters; 0 for a model on one process)."""
    backward_fixed_bytes: int = 0
    """Part of ``backward_peak_bytes``, beyond ``grad_bytes``, that does not shrink with
    micro-batches (FSDP2's gathered parameters and whole gradients before reduce-scatter)."""
    held_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes it holds when its forward returns (saved bytes + what the forward's end frees)."""
    output_bytes: int = 0
    """Bytes of its output still alive when the forward ends (kept by what reads it), with
    every block fully checkpointed; a segment of blocks keeps only its last one's."""
    forward_bytes: int = 0
    """Bytes of the storages its forward creates (no checkpointing): what it writes."""
    forward_ops: int = 0
    """Aten ops its forward dispatches (each costs a fixed dispatch time)."""
    selective_flops: int = 0
    """Forward FLOPs of the ops selective checkpointing recomputes."""
    after_held_bytes: int = 0
    """Bytes the code outside every block that runs between this block and the next (in the
    order they ran: a head hanging off the chain, the step from one tower to the other) still
    holds when the next block starts; 0 for a plain chain and for the last block."""
    after_grad_bytes: int = 0
    """Bytes of the parameter gradients that code creates in its backward, which runs between
    the next block's backward and this one's."""
    stem_saved_bytes: dict[str, int] = field(default_factory=dict)
    """Of ``saved_bytes[m]``, the stem's tensors (its output, the ids and mask every block
    takes) alive at the forward's end in mode ``m`` and not in the plain step: kept by the
    checkpoints, counted with the first block's (See Note [stem tensors a checkpoint holds]
    in :mod:`memfit.measuring.phases`); not in ``held_bytes`` (the forward counts them as
    the stem's)."""

    def own_saved_bytes(self, mode: str) -> int:
        """``saved_bytes[mode]`` less ``stem_saved_bytes[mode]``: what its own forward made and
        keeps (See Note [stem tensors a checkpoint holds] in :mod:`memfit.measuring.phases`)."""
        return self.saved_bytes[mode] - self.stem_saved_bytes.get(mode, 0)


@dataclass
class Speed(Record):
    """What one unit of work costs on the profiled device: the step time model's constants.

    The first five come from micro-benchmarks on the device (a matmul, an elementwise op,
    tiny ops, a checkpointed tiny function with and without selective checkpointing);
    ``forward_scale`` and ``backward_scale`` fit the resulting model of the forward to the
    forward and backward of whole timed steps. :mod:`memfit.stepmodel` turns them, with each
    block's FLOPs, bytes and ops, into seconds per option.
    """

    flop_seconds: float = 0.0
    """Seconds per FLOP of a large matmul at the profile's precision."""
    byte_seconds: float = 0.0
    """Seconds per byte written by an elementwise op."""
    op_seconds: float = 0.0
    """Seconds to dispatch one small aten op."""
    checkpoint_seconds: float = 0.0
    """Extra seconds of one checkpointed call (forward + backward), recompute aside."""
    selective_op_seconds: float = 0.0
    """Extra seconds per op of a selectively checkpointed call (forward + recompute)."""
    forward_scale: float = 1.0
    """Measured forward seconds over the model's: the work units' efficiency in this model."""
    backward_scale: float = 2.0
    """Measured backward seconds over the modelled forward's."""
    recompute_scale: float = 1.0
    """Measured seconds of recomputing a block's forward (``timed_block`` run alone fully
    checkpointed, less without, less the checkpoint call) over the scaled model's (1: not
    fitted)."""
    timed_steps: int = 0
    """Whole steps timed to fit the two scales."""
    full_steps: int = 0
    """Runs of ``timed_block`` alone, fully checkpointed and not, that fit ``recompute_scale``."""
    timed_block: str = ""
    """The block timed alone to fit ``recompute_scale`` and ``selective_op_seconds``."""
    selective_steps: int = 0
    """Runs of ``timed_block`` alone, selectively checkpointed and not, that fit
    ``selective_op_seconds`` (0: the micro-benchmark's)."""
    timed_as: str = ""
    """How the whole steps were timed where the plain step did not fit ("" : plain), e.g.
    ``"without checkpointing in 4 micro-batches (the plain step does not fit)"``."""
    spread: float = 0.0
    """How far the times the prices were fitted to disagree: for each price, the rounds of
    ``timed_block`` it was fitted to (each over ``none`` in the same round), outliers left
    out, half their range over their median, the largest (1: they tell nothing, e.g. a fit
    was clamped; 0: not measured), or the whole steps timed across the profile, outliers
    kept, where they disagree more (the load moved: See Note [a load that moves] in
    memfit/planning/choose.py). The chooser counts predictions that differ by less than
    this as ties (See Note [plans repeat])."""
    spreads: dict[str, float] = field(default_factory=dict)
    """``spread`` per checkpointing mode: how far the rounds its price was fitted to disagree,
    in the units the price is used in (that mode's extras). Empty: ``spread`` stands for every
    mode."""
    noise: float = 0.0
    """How far the machine moved a time while the profile ran, as a share of that time: the
    rounds of ``timed_block`` (each mode over ``none`` in the same round), ``none``'s own times
    across the rounds and across the step's split rounds, and the whole steps timed across the
    profile, outliers kept (See Note [a load that moves] in memfit/planning/choose.py); the
    largest. A plan in micro-batches is uncertain by this much of its whole time, at least."""
    micro_spreads: list[float] = field(default_factory=list)
    """For each of ``micro_batches``, how far the rounds its ratio was fitted to disagree (half
    their range over their median): a plan in that many micro-batches is that uncertain as a
    whole (the step split is timed against the step whole, so the noise of both is in it)."""
    micro_batches: list[int] = field(default_factory=list)
    """Micro-batch counts the step's forward and backward were timed in (its rows split
    evenly; memfit/measuring/split_timing.py), side by side with it whole (empty: not measured)."""
    micro_batch_ratios: list[float] = field(default_factory=list)
    """Its seconds in each of those counts over its seconds whole: what splitting the batch
    costs the step (dispatch again, kernels less efficient on fewer rows).
    See Note [what a micro-batch costs] in memfit/stepmodel/time.py."""


@dataclass
class Profile(Record):
    """Per-block costs of one training step: the planner's input.

    All bytes are MemTracker's counts on a CPU (CUDA allocator on a GPU for the measured
    peak) for one steady-state step at ``batch_size`` in ``precision``. The step holds
    ``fixed = param_bytes + optimizer_bytes`` throughout. With blocks ``0..n-1`` in forward
    order, block ``i`` in mode ``m_i``, ``S(i) = sum(saved_bytes[m_j] for j <= i)``,
    ``H(i) = sum(held_bytes[m_j] for j <= i)`` and
    ``G(i) = early_grad_bytes + sum(grad_bytes of blocks j > i)``, the step's peak is the
    largest of:

    - forward of block i: ``fixed + outside_before_bytes + H(i-1) + forward_peak_bytes[m_i]``
    - forward outside before the blocks: ``fixed + outside_before_forward_peak_bytes``
    - forward outside after them: ``fixed + H(n-1) + outside.forward_peak_bytes[m]``
    - backward of block i: ``fixed + G(i) + outside_before_kept_bytes + S(i) + backward_peak_bytes[m_i]``
    - backward outside after the blocks: ``fixed + S(n-1) + outside.backward_peak_bytes[m]``
    - backward outside before them: ``fixed + block gradients + outside_before_backward_peak_bytes``
    - optimizer step: ``fixed + grad_bytes + optimizer_temp_bytes``

    :func:`memfit.stepmodel.simulate` implements this (with micro-batches too).

    For a uniform mode this reproduces ``measured_peak_bytes`` (mode none) to within a few
    bytes; the tests check it for every mode and for mixed modes.
    """

    precision: str
    device: str
    batch_size: int
    blocks: list[BlockStats]
    outside: BlockStats
    param_bytes: int
    """Parameters and buffers (held all step)."""
    grad_bytes: int
    """All parameter gradients at the end of the backward."""
    optimizer_bytes: int
    """Optimizer state (held all step; created by a warm-up step before measuring)."""
    optimizer_temp_bytes: int
    """Highest total during clipping and the optimizer step minus the total before it."""
    optimizer: str = "none"
    """The optimizer's class name, or ``none``."""
    input_bytes: int = 0
    """Bytes of the batch's tensors. MemTracker on a CPU counts the model's input tensor
    (in ``outside_before_bytes``) but not tensors only the loss function reads."""
    measured_peak_bytes: int = 0
    """Peak of the model with no checkpointing, measured by :func:`memfit.measure` (or, where
    ``memory_from`` says so, under fake tensors)."""
    memory_from: str = "tracked"
    """Where the memory numbers come from: ``"tracked"`` (real steps, PyTorch's MemTracker) or
    ``"fake tensors"`` (the same steps on a fake twin: the planner's, or the plain step does not
    fit the device; :attr:`plain_fits` says which)."""
    plain_fits: bool = True
    """The step without checkpointing fits the device's room (False: it ran only on the fake
    twin, and whole steps were timed in a configuration that fits)."""
    step_seconds: float = 0.0
    """Median step time of the model with no checkpointing."""
    outside_before_bytes: int = 0
    """What the outside part holds when the first block starts (embedding output, input);
    kept until the embeddings' backward, after every block's backward."""
    outside_before_kept_bytes: int = -1
    """What the outside keeps for backward from before the blocks (embedding output, the
    input) in the plain step: alive when the forward ends and freed only after every block's
    backward. 0 where nothing is (a frozen embedding); -1: not measured, taken as
    ``outside_before_bytes``."""
    early_grad_bytes: int = 0
    """Parameter gradients that exist when the last block's backward starts (final norm,
    head); tied weights accumulate later."""
    activation_bytes: int = 0
    """Activation total at the end of the forward with no checkpointing (blocks + outside)."""
    notes: list[str] = field(default_factory=list)
    """Caveats found while profiling (no blocks found, ops without FLOP formulas, ...)."""
    optimizer_bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    """The optimizer state split by dtype, e.g. ``{"float32": ...}`` (step counters included)."""
    outside_before_forward_peak_bytes: int = 0
    """Highest bytes above the step's start while the outside runs before the first block
    (stem, embeddings): no block holds anything then."""
    outside_before_backward_peak_bytes: int = 0
    """Highest bytes above parameters, optimizer state and the blocks' gradients while the
    outside's backward runs after every block's (stem, embeddings): no block keeps anything."""
    chain_links: list[bool] = field(default_factory=list)
    """``chain_links[k]``: block k+1 takes block k's output as its input (its other arguments
    being block k's), so one checkpointed segment may span both (``checkpoint_sequential``'s
    condition). Empty: no segments."""
    speed: Speed | None = None
    """The time model's constants (None: block times are as recorded, e.g. an estimate)."""
    weights: str = "fp32"
    """The floating parameters' dtype the step was measured with (``bf16``: the weights_bf16 lever)."""
    levers: list[str] = field(default_factory=list)
    """Levers whose bytes these numbers include (set by :func:`memfit.applying.registry.with_levers`)."""
    lever_facts: LeverFacts | None = None
    """What :func:`memfit.applying.registry.with_levers` needs (None: levers cannot be predicted)."""
    lever_step_bytes: dict[str, int] = field(default_factory=dict)
    """With ``fused_step``: per part (block name, ``""`` outside) the largest gradient plus step
    temporaries of one of its parameters, held inside its backward while that one steps."""
