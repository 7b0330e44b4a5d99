"""Write a stability check as Markdown, JSON and a PNG of the loss curves.

Trade-off: the Markdown shows the ten modules closest to fp16's limit; the JSON keeps
every number (all modules, every step) for tools.

Example:
    >>> # report = memfit.check_stability(...)
    >>> # paths = write_check_report(report, "memfit-check")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.outputs import marked_json
from memfit.records import PrecisionCheck, StabilityReport
from memfit.report.table import markdown_table

__all__ = ["check_markdown", "plot_check", "write_check_report"]

_TOP_MODULES = 10


def _num(x: float | None, fmt: str = ".4f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _module_table(pc: PrecisionCheck) -> list[str]:
    if not pc.modules:
        return []
    rows = [
        [
            m.module,
            m.dtype,
            _num(m.max_abs, ".4g") if m.max_abs is not None else "inf/nan",
            _num(m.fp16_fraction, ".2%") if m.fp16_fraction is not None else "overflow",
            _num(m.grad_underflow_fraction, ".2%"),
        ]
        for m in pc.modules[:_TOP_MODULES]
    ]
    head = ["module", "output dtype", "max abs activation", "of fp16 max 65504", "grads lost to underflow"]
    return [
        "",
        f"Modules closest to fp16's limits ({min(len(pc.modules), _TOP_MODULES)} of {len(pc.modules)}; "
        f"underflow at the final loss scale {pc.final_scale:g}):",
        "",
        markdown_table(head, rows),
    ]


def _summary_rows(report: StabilityReport) -> list[list[Any]]:
    """One row per precision, then the fp32 noise run's."""
    rows: list[list[Any]] = [
        [
            pc.precision,
            pc.verdict,
            _num(pc.run.eval_loss),
            _num(pc.loss_delta, ".4g"),
            _num(pc.band_multiple, ".2f"),
            _num(pc.grad_norm_ratio, ".3f"),
            _num(pc.param_drift, ".3f"),
            f"{pc.skipped_steps}/{len(pc.run.losses)}",
            f"{pc.final_scale:g}",
        ]
        for pc in report.by_precision.values()
    ]
    noise = ["fp32 (noise)", "-", _num(report.noise.eval_loss), "", "", ""]
    return [*rows, [*noise, _num(report.noise_param_drift, ".3f"), "", ""]]


_SUMMARY_HEAD = [
    "precision",
    "verdict",
    "final loss",
    "abs Δ loss vs fp32",
    "noise bands",
    "grad-norm ratio",
    "param drift",
    "skipped",
    "final scale",
]


def _precision_section(pc: PrecisionCheck) -> list[str]:
    """One precision's verdict, reasons, first non-finite value and modules nearest fp16's limits."""
    lines = ["", f"## {pc.precision}: {pc.verdict}", ""]
    lines += [f"- {r}" for r in pc.reasons]
    if pc.reference_run is not None:
        lines += [
            f"- compared with an fp32 run that skips the same {pc.skipped_steps} step(s) the loss scaler "
            f"skipped (final loss {_num(pc.reference_run.eval_loss)}), so that the numbers measure "
            "arithmetic, not lost updates"
        ]
    if pc.first_nonfinite is not None:
        nf = pc.first_nonfinite
        lines += [
            f"- first non-finite value: {nf.value} in module `{nf.module}`, {nf.phase} pass, "
            f"{nf.dtype}, step {nf.step}"
        ]
    return lines + _module_table(pc)


def check_markdown(report: StabilityReport) -> str:
    """The report as Markdown: verdicts, reasons, numbers, hardware facts."""
    ref = report.reference
    lines = [
        f"# memfit check: {report.verdict}",
        "",
        f"{report.steps} steps per run from identical initial weights and batches on {report.device}; "
        f"fp32 final loss {_num(ref.eval_loss)}; noise band (a second fp32 run with another data order "
        f"and seed) {report.noise_band:.4g}.",
    ]
    if report.checkpointing:
        modes = ", ".join(f"{k}: {v}" for k, v in report.checkpointing.items())
        lines += [
            "",
            f"Mixed-precision runs use checkpointing {modes}; micro-batches {report.micro_batches}.",
        ]
    lines += ["", markdown_table(_SUMMARY_HEAD, _summary_rows(report))]
    for pc in report.by_precision.values():
        lines += _precision_section(pc)
    lines += ["", "## Hardware facts this check depends on", ""]
    lines += [f"- {h}" for h in report.hardware]
    lines += [
        "",
        "Param drift is ||w - w_fp32|| / ||w_fp32 - w_0||. Thresholds: "
        + ", ".join(f"{k}={v:g}" for k, v in report.thresholds.items())
        + ".",
        "",
    ]
    return "\n".join(lines)


#: Dash pattern and marker of each mixed-precision run, in order (See Note [lines that lie on each other]).
_STYLES = (("--", "o"), (":", "s"), ("-.", "^"))


def _style(i: int, steps: int) -> dict[str, Any]:
    dash, marker = _STYLES[i % len(_STYLES)]
    return {
        "ls": dash, "lw": 1.4, "marker": marker, "markersize": 5, "markerfacecolor": "none",
        "markevery": (i, max(1, steps // 12)), "zorder": 2 + i,
    }  # fmt: skip


def plot_check(report: StabilityReport, path: str | Path) -> Path:
    """Loss curves of every run with the fp32 noise band shaded; loss scales beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nan = float("nan")
    fig = plt.figure(figsize=(12, 7))
    grid = fig.add_gridspec(2, 2, width_ratios=[2, 1], height_ratios=[3, 2])
    ax = fig.add_subplot(grid[0, 0])
    ax_diff = fig.add_subplot(grid[1, 0], sharex=ax)
    ax_scale = fig.add_subplot(grid[:, 1])
    ref = [nan if v is None else v for v in report.reference.losses]
    noise = [nan if v is None else v for v in report.noise.losses]
    steps = list(range(1, len(ref) + 1))
    k = min(len(ref), len(noise))
    lo = [min(a, b) for a, b in zip(ref[:k], noise[:k], strict=True)]
    hi = [max(a, b) for a, b in zip(ref[:k], noise[:k], strict=True)]
    spread = [abs(a - b) for a, b in zip(ref[:k], noise[:k], strict=True)]
    ax.fill_between(steps[:k], lo, hi, color="0.8", label="fp32 noise band (two fp32 runs)")
    ax_diff.fill_between(steps[:k], [-d for d in spread], spread, color="0.8", label="± fp32 noise")
    # Note [lines that lie on each other]
    # bf16 and fp16 usually track fp32 to within a line's width: drawn plain, the last one
    # hid the others (issue 37). fp32 is a wide pale band under them, and each mixed run has
    # its own dash pattern and open markers, so all three show where they coincide.
    ax.plot(steps, ref, color="black", lw=4, alpha=0.3, label="fp32", zorder=1)
    ax_diff.axhline(0.0, color="black", lw=1)
    ax.plot(
        list(range(1, len(noise) + 1)), noise, color="0.45", lw=1, ls="--", label="fp32, other order/seed"
    )
    for i, pc in enumerate(report.by_precision.values()):
        ys = [nan if v is None else v for v in pc.run.losses]
        xs = list(range(1, len(ys) + 1))
        style = _style(i, len(ys))
        (line,) = ax.plot(xs, ys, label=f"{pc.precision} ({pc.verdict})", **style)
        base = ref
        if pc.reference_run is not None:
            base = [nan if v is None else v for v in pc.reference_run.losses]
            ax.plot(
                list(range(1, len(base) + 1)),
                base,
                lw=0.8,
                ls=":",
                color=line.get_color(),
                label=f"fp32 skipping {pc.precision}'s skipped steps",
            )
        diff = [a - b for a, b in zip(ys, base, strict=False)]
        ax_diff.plot(xs[: len(diff)], diff, color=line.get_color(), label=f"{pc.precision} - fp32", **style)
        if pc.precision == "fp16" or any(s != 1.0 for s in pc.run.scales):
            ax_scale.plot(xs, pc.run.scales, label=pc.precision, color=line.get_color())
    ax_diff.set_xlabel("step")
    ax_diff.set_ylabel("loss - fp32 loss")
    ax_diff.legend(fontsize=8)
    ax.set_ylabel("training loss")
    ax.set_title(f"memfit check: {report.verdict}")
    ax.legend(fontsize=8)
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_xlabel("step")
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_title("loss scaler")
    if ax_scale.lines:
        ax_scale.legend(fontsize=8)
    else:
        ax_scale.text(
            0.5, 0.5, "no loss scaler\n(no fp16 run)", ha="center", va="center", transform=ax_scale.transAxes
        )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_check_report(report: StabilityReport, out_dir: str | Path) -> dict[str, Path]:
    """Write ``check.md``, ``check.json`` and ``check.png`` into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "check.md", "json": out / "check.json", "png": out / "check.png"}
    paths["md"].write_text(check_markdown(report), encoding="utf-8")
    paths["json"].write_text(marked_json("check", report.to_dict()), encoding="utf-8")
    plot_check(report, paths["png"])
    return paths
