"""Resuming a run: which state file, which config, and what changed since the run was saved.

``memfit train CONFIG --resume`` continues the run with CONFIG and this command's ``--set``
options, like the run was started; ``memfit train --resume STATE`` (no config file)
continues it with the config saved in STATE, changed only by the ``--set`` options given
(``--set train.steps=400`` trains on for longer). Either way the settings that shape the
numbers (model, data, optimizer, precision, batch, seed) cannot change, and every other
difference from the saved run is said, on stderr and in the report, including what a
longer ``train.steps`` does to a cosine learning-rate schedule.

Trade-off: with a config file, an earlier run's ``--set`` options are not repeated for you
(the file and this command say what runs); they are named when they no longer hold.

Example:
    >>> flatten({"train": {"steps": 3, "seed": 0}})
    {'train.steps': 3, 'train.seed': 0}
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memfit.app.config import Config, config_from_dict
from memfit.app.schedule import lr_schedule
from memfit.errors import StateError
from memfit.trainer.state import load_state, previous_path

__all__ = ["MUST_MATCH", "Resumed", "flatten", "resolve_resume", "resume_run"]

#: Config keys a resumed run must share with the run it continues.
MUST_MATCH = (
    "model",
    "data",
    "optimizer",
    "memory.precision",
    "train.batch_size",
    "train.grad_accum",
    "train.seed",
    "train.distributed",
)
#: Keys whose difference is not worth a note (where the files go is the resume's business).
_QUIET = ("train.out",)


@dataclass
class Resumed:
    """The state a run resumes from and the config it continues with."""

    path: Path
    state: dict[str, Any]
    cfg: Config
    notes: list[str] = field(default_factory=list)
    """What differs from the saved run, one sentence each."""


def resolve_resume(resume: str, out: Path) -> Path | None:
    """The state file ``--resume`` means: ``"auto"`` is ``OUT/state.pt`` (or, if a crash came
    between its two renames, ``OUT/state.prev.pt``); anything else is a path.

    Returns None for ``"auto"`` when ``OUT`` holds a run that was stopped before it saved its
    first state (a ``metrics.jsonl`` and no state): that run starts again from step 0.

    Raises:
        StateError: ``OUT`` holds no run at all, or cannot be looked at.
    """
    if resume != "auto":
        return Path(resume)
    path = out / "state.pt"
    try:
        here, before = path.exists(), previous_path(path).exists()
        started = (out / "metrics.jsonl").exists()
    except OSError as exc:
        raise StateError(f"cannot look for a state in {str(out)!r} ({exc.strerror or exc}).") from None
    if not here and before:
        return previous_path(path)
    if not here and started:
        return None
    if not here:
        raise StateError(
            f"nothing to resume in {str(out)!r}: it holds no training run; run without --resume."
        )
    return path


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (tables of ``model.kwargs`` stay whole)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name != "model.kwargs":
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _must_match(key: str) -> bool:
    return any(key == m or key.startswith(f"{m}.") for m in MUST_MATCH)


def _refuse(path: Path, key: str, before: Any, after: Any) -> StateError:
    return StateError(
        f"{str(path)!r} was trained with {key} = {before!r} but this config has {after!r}; "
        "use the same value to resume, or set train.out to start a new run."
    )


def _check_same_run(saved: dict[str, Any], now: dict[str, Any], path: Path) -> None:
    for key, after in now.items():
        if not _must_match(key) or key not in saved:
            continue
        if key == "train.distributed" and after == "none" and "train.distributed" not in saved:
            continue  # a state saved before train.distributed existed: one process
        if saved[key] != after:
            raise _refuse(path, key, saved[key], after)


def _schedule_note(before: dict[str, Any], after: Config, step: int) -> str | None:
    old_steps = before.get("train.steps")
    if not isinstance(old_steps, int) or old_steps == after.train.steps:
        return None
    o = after.optimizer
    factors = []
    for steps in (old_steps, after.train.steps):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=o.lr)
        factors.append(lr_schedule(opt, steps, o.warmup_steps, o.schedule).lr_lambdas[0](step + 1))
    if abs(factors[0] - factors[1]) <= 1e-12 * max(abs(factors[0]), 1e-30):
        return None
    return (
        f"train.steps {old_steps} -> {after.train.steps} changes the {o.schedule} learning-rate schedule: "
        f"after step {step + 1} the learning rate is {o.lr * factors[1]:.3g} where the saved run would have "
        f"used {o.lr * factors[0]:.3g} ({factors[1] / factors[0]:.2f}x)"
    )


def resume_run(resume: str, cfg: Config, overrides: Sequence[str] | None = None) -> Resumed | None:
    """Load the state ``resume`` names and work out the config the run continues with.

    Args:
        resume: ``"auto"`` (``state.pt`` in ``cfg.train.out``) or a state file.
        cfg: the config of this command (its config file and overrides applied).
        overrides: given (a command line without a config file), the run continues with
            the *saved* config plus these ``--set`` overrides; None: with ``cfg``.

    Returns:
        None when the run in ``cfg.train.out`` saved no state yet (it starts again from step 0).

    Raises:
        StateError: the state cannot be loaded, or the config changes what shapes the numbers.
    """
    path = resolve_resume(resume, Path(cfg.train.out))
    if path is None:
        return None
    state = load_state(path)
    saved_tree = dict(state.get("extra") or {}).get("config") or {}
    saved = flatten(saved_tree) if isinstance(saved_tree, dict) else {}
    effective = cfg
    if overrides is not None and saved:
        named = {o.partition("=")[0].strip() for o in overrides}
        where = cfg.train.out if resume == "auto" else str(path.parent)
        out = [] if "train.out" in named else [f"train.out={where!r}"]
        effective = config_from_dict(saved_tree, [*overrides, *out])
    after = flatten(effective.to_dict())
    _check_same_run(saved, after, path)
    changed = [k for k in after if k in saved and after[k] != saved[k] and k not in _QUIET]
    notes = [f"{k} is {after[k]!r} now; the saved run used {saved[k]!r}" for k in changed]
    if changed and overrides is None:
        notes.append(
            "a resumed run takes its settings from this command's config file and --set options; "
            "repeat an earlier --set to keep it"
        )
    step = int(state.get("step", 0)) if isinstance(state.get("step", 0), int) else 0
    schedule = _schedule_note(saved, effective, step)
    if schedule:
        notes.append(schedule)
    return Resumed(path=path, state=state, cfg=effective, notes=notes)


def print_notes(notes: Sequence[str]) -> None:
    """Each note on stderr, so that ``--quiet`` does not hide what changed."""
    for note in notes:
        print(f"memfit train: note: {note}.", file=sys.stderr)
