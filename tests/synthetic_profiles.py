"""Random synthetic profiles (hypothesis strategies) for the solver and step-model tests."""

from __future__ import annotations

from hypothesis import strategies as st

from memfit.records import BlockStats, Profile


@st.composite
def _block(draw: st.DrawFn, i: int) -> BlockStats:
    params = draw(st.integers(0, 10_000))
    kept_none = draw(st.integers(0, 1_000_000))
    kept_sel = draw(st.integers(0, kept_none))
    kept_full = draw(st.integers(0, kept_sel))
    bwd_none = draw(st.integers(params, params + 1_000_000))
    modes = draw(st.sampled_from([("none", "selective", "full"), ("none", "full")]))
    t_none = draw(st.floats(0.001, 1.0))
    saved = {"none": kept_none, "selective": kept_sel, "full": kept_full}
    peaks = {
        "none": bwd_none,
        "selective": bwd_none + draw(st.integers(0, 500_000)),
        "full": bwd_none + draw(st.integers(0, 1_000_000)),
    }
    seconds = {
        "none": t_none,
        "selective": t_none + draw(st.floats(0.0, 1.0)),
        "full": t_none + draw(st.floats(0.0, 2.0)),
    }
    return BlockStats(
        name=f"b{i}",
        param_bytes=params,
        output_bytes=draw(st.integers(0, kept_full)),
        forward_peak_bytes={m: saved[m] + draw(st.integers(0, 200_000)) for m in modes},
        saved_bytes={m: saved[m] for m in modes},
        backward_peak_bytes={m: peaks[m] for m in modes},
        forward_seconds=draw(st.floats(0.0, 0.5)),
        backward_seconds={m: seconds[m] for m in modes},
    )


@st.composite
def profiles(draw: st.DrawFn, max_blocks: int = 10, segments: bool = True) -> Profile:
    """Random profiles; with ``segments``, random chain links let segments span blocks."""
    n = draw(st.integers(1, max_blocks))
    blocks = [draw(_block(i)) for i in range(n)]
    links = [draw(st.booleans()) for _ in range(n - 1)] if segments else []
    params = sum(b.param_bytes for b in blocks) + draw(st.integers(0, 10_000))
    return Profile(
        precision="fp32",
        device="cpu",
        batch_size=draw(st.integers(1, 8)),
        blocks=blocks,
        outside=BlockStats(
            "outside",
            saved_bytes={"none": draw(st.integers(0, 200_000))},
            backward_peak_bytes={"none": draw(st.integers(0, 400_000))},
        ),
        param_bytes=params,
        grad_bytes=params,
        optimizer_bytes=2 * params,
        optimizer_temp_bytes=draw(st.integers(0, params)),
        step_seconds=draw(st.floats(0.0, 20.0)),
        outside_before_forward_peak_bytes=draw(st.integers(0, 300_000)),
        outside_before_backward_peak_bytes=draw(st.integers(0, 300_000)),
        chain_links=links,
    )
