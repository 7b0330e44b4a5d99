"""The one model of a training step's cost: memory events by role, and step time.

``memfit profile``, ``memfit estimate`` and ``memfit plan`` all report peaks from this
model, and the planner's solver constrains exactly its expressions:

- :mod:`.options`: what a plan chooses from: per block ``none`` / ``selective`` / ``full``,
  or a segment of consecutive blocks checkpointed as one;
- :mod:`.memory`: :func:`events` (each moment of the step as a constant plus one term per
  option) and :func:`simulate` (the peak, where it happens and its split by role);
- :mod:`.time`: each option's seconds from counted FLOPs, bytes and ops priced by the
  device's measured speeds (:func:`fill_times`), and :func:`predict_step_seconds`.

Example:
    >>> from memfit.records import BlockStats, Profile
    >>> blk = BlockStats("b0", param_bytes=10, grad_bytes=10, saved_bytes={"none": 100, "full": 10},
    ...                  backward_peak_bytes={"none": 50, "full": 150})
    >>> prof = Profile(precision="fp32", device="cpu", batch_size=2, blocks=[blk],
    ...                outside=BlockStats("outside"), param_bytes=10, grad_bytes=10,
    ...                optimizer_bytes=20, optimizer_temp_bytes=10)
    >>> simulate(prof, {"b0": "none"}).peak_bytes
    180
    >>> sim = simulate(prof, "full")
    >>> sim.peak_bytes, sim.peak_event, sim.breakdown["temporaries"]
    (190, 'backward of b0', 150)
"""

from memfit.stepmodel.memory import Event, Simulation, events, simulate, simulate_options
from memfit.stepmodel.options import (
    MAX_SEGMENT,
    Option,
    all_options,
    block_options,
    micro_batch_scale,
    normalize_modes,
    segment_ranges,
    tiling,
)
from memfit.stepmodel.time import (
    block_seconds,
    call_seconds,
    fill_times,
    forward_work,
    micro_batch_ratio,
    micro_batch_seconds,
    option_seconds,
    predict_options_seconds,
    predict_step_seconds,
    recompute_scale,
    selective_work,
    time_note,
)

__all__ = [
    "MAX_SEGMENT",
    "Event",
    "Option",
    "Simulation",
    "all_options",
    "block_options",
    "block_seconds",
    "call_seconds",
    "events",
    "fill_times",
    "forward_work",
    "micro_batch_ratio",
    "micro_batch_scale",
    "micro_batch_seconds",
    "normalize_modes",
    "option_seconds",
    "predict_options_seconds",
    "predict_step_seconds",
    "recompute_scale",
    "segment_ranges",
    "selective_work",
    "simulate",
    "simulate_options",
    "tiling",
    "time_note",
]
