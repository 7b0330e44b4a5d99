"""The bytes of torchao's AdamW, exactly: its state per parameter and the slice its step works on.

Pure arithmetic over counts, read by the optimizer-state levers (:mod:`memfit.applying.state`,
:mod:`memfit.applying.fused_step`) and by torchao's sliced step (:mod:`memfit.levers.optim`).

Example:
    >>> state_bytes(65536, 4, "8bit")  # codes + block scales + two 256-entry maps + the step count
    135172
    >>> state_bytes(10, 4, "fp32")  # torch.optim.AdamW's own: a step tensor and two fp32 moments
    84
"""

from __future__ import annotations

from memfit.errors import ConfigError
from memfit.vocab import WEIGHTS

__all__ = [
    "EAGER_STEP_SLICE_ELEMENTS",
    "STEP_SLICE_ELEMENTS",
    "state_bytes",
    "step_slice_elements",
    "step_slice_numel",
    "temp_key",
]

#: torchao's AdamW steps a parameter larger than this in slices of about this many elements
#: (:mod:`memfit.levers.optim`), so its step's fp32 temporaries are those of one slice.
STEP_SLICE_ELEMENTS = 2**22
#: The slice when the step runs eagerly (never more than :data:`STEP_SLICE_ELEMENTS`): the
#: eager step holds about 24 bytes of fp32 temporaries per element of its slice.
EAGER_STEP_SLICE_ELEMENTS = 2**16

# Note [pricing the step that runs]
# torchao's step is torch.compile(fullgraph=True); it runs eagerly where dynamo is off
# (TORCHDYNAMO_DISABLE=1, torch._dynamo.config.disable) or under the force_eager stance, as
# under every memfit tracker. The eager step materializes every intermediate of the update
# (measured: 24 bytes per element at fp32 weights, 41 at bf16, for every state kind), so it
# steps in slices of EAGER_STEP_SLICE_ELEMENTS, where they are 1.5 MiB; the compiled step
# (one fused kernel, few launches) in slices of STEP_SLICE_ELEMENTS. The step model prices
# the one that will run in training (LeverFacts.step_eager, read when the facts are
# measured): the eager step exactly, its per-element cost measured eagerly on one eager
# slice; the compiled step at the same per-element cost on a compiled slice, an upper bound
# (the fused kernel holds a subset of the eager intermediates). CUDA follows the same rule:
# the allocator counts the same tensors MemTracker does on a CPU; only the CPU is tested.

_BLOCK = {"8bit": 256, "4bit": 128}
_MIN_QUANTIZED = 4096


def state_bytes(numel: int, param_bytes: int, kind: str, amsgrad: bool = False) -> int:
    """Exact bytes of one parameter's AdamW state (moments and step count) of a kind.

    ``fp32`` is also torch.optim.AdamW's own state (a 4-byte step tensor, two fp32 moments).
    ``8bit`` / ``4bit``: torchao quantizes a tensor of at least 4096 elements that its block
    size divides (codes, one fp32 scale per block, a 256- or 16-entry map); smaller ones stay
    at the parameter's dtype.
    """
    buffers = 3 if amsgrad else 2
    if kind in _BLOCK:
        block = _BLOCK[kind]
        if numel >= _MIN_QUANTIZED and numel % block == 0:
            codes = numel if kind == "8bit" else numel // 2
            qmap = 256 if kind == "8bit" else 16
            per = codes + (numel // block) * 4 + qmap * 4
        else:
            per = numel * param_bytes
        return 4 + buffers * per
    if kind not in WEIGHTS:
        raise ConfigError(f"unknown optimizer state kind {kind!r}; use fp32, bf16, 8bit or 4bit.")
    return 4 + buffers * numel * (4 if kind == "fp32" else 2)


def step_slice_elements(eager: bool) -> int:
    """The most elements torchao's AdamW steps at once, run eagerly or compiled
    (Note [pricing the step that runs]).

    Example:
        >>> step_slice_elements(True), step_slice_elements(False)
        (65536, 4194304)
    """
    return min(STEP_SLICE_ELEMENTS, EAGER_STEP_SLICE_ELEMENTS) if eager else STEP_SLICE_ELEMENTS


def step_slice_numel(numel: int, kind: str, eager: bool = False) -> int:
    """The elements one step of a ``numel``-element parameter works on at once: all of them for
    the user's optimizer (``orig``), at most :func:`step_slice_elements` for torchao's AdamW.

    Example:
        >>> step_slice_numel(10_000_000, "4bit"), step_slice_numel(10_000_000, "orig")
        (4194304, 10000000)
        >>> step_slice_numel(10_000_000, "4bit", eager=True)
        65536
    """
    return numel if kind == "orig" else min(numel, step_slice_elements(eager))


def temp_key(kind: str, weights: str) -> str:
    """The key of :attr:`memfit.records.LeverFacts.step_temp_per_element`."""
    return f"{kind}/{weights}"
