"""Stop signals during ``memfit train``: Ctrl-C, SIGTERM and SIGHUP end a run the same way.

``kill``, ``docker stop``, systemd, Kubernetes and SLURM send SIGTERM; closing a terminal
sends SIGHUP; Ctrl-C sends SIGINT. Each one asks the Trainer to stop after the step in
flight; the state of that finished step is then saved atomically (by the
:class:`memfit.trainer.callbacks.SaveState` callback) and the command exits with ``128 + the
signal's number`` (130, 143, 129). A second signal of the same kind ends the process at once.
Under ``torchrun`` every rank does the same, and the ranks agree on the step to stop after
(:meth:`memfit.Trainer.fit` takes the largest stop code over all ranks after each step).

Trade-off: the step in flight runs to its end (seconds on a large model) rather than being
cut short, so the saved state is always that of a whole step and resumes bit for bit.

Example:
    >>> stop_code(STOP_REASONS[signal.SIGTERM]), stop_code("diverged"), stop_code(None)
    (15, 1, 0)
    >>> exit_code(STOP_REASONS[signal.SIGTERM]), exit_code(None)
    (143, 0)
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from memfit.trainer.distributed import DistContext, global_max

__all__ = ["STOP_REASONS", "agreed_stop", "exit_code", "graceful_stop", "reason_of", "stop_code"]

#: ``Trainer.stop_reason`` after each stop signal.
STOP_REASONS: dict[int, str] = {
    signal.SIGINT: "interrupted (Ctrl-C)",
    signal.SIGTERM: "terminated (SIGTERM)",
    **({signal.SIGHUP: "hung up (SIGHUP)"} if hasattr(signal, "SIGHUP") else {}),
}


class _Stoppable(Protocol):
    def stop(self, reason: str) -> None: ...


def stop_code(reason: str | None) -> int:
    """0 for no stop, the signal's number for a stop signal, 1 for any other stop."""
    if reason is None:
        return 0
    return next((int(s) for s, r in STOP_REASONS.items() if r == reason), 1)


def reason_of(code: int) -> str:
    """The stop reason another rank's ``code`` stands for (see :func:`stop_code`)."""
    if code in STOP_REASONS:
        return STOP_REASONS[code]
    return "another process of the run stopped"


def exit_code(reason: str | None) -> int:
    """The exit status of ``memfit train`` after ``reason``: 128 + the signal, else 0."""
    code = stop_code(reason)
    return 128 + code if code in STOP_REASONS else 0


def agreed_stop(reason: str | None, ctx: DistContext) -> str | None:
    """``reason``, agreed over all ranks under torchrun: any rank's stop (a signal one rank
    got, a failed write on rank 0) stops every rank after the same step."""
    if not ctx.active:
        return reason
    code = global_max(stop_code(reason), ctx)
    return reason if reason is not None or not code else reason_of(code)


@contextlib.contextmanager
def graceful_stop(trainer: _Stoppable, echo: Callable[[str], None]) -> Iterator[None]:
    """While inside, the first Ctrl-C, SIGTERM or SIGHUP stops ``trainer`` after its current
    step; a second one of the same kind acts at once (the handler before is restored). A
    signal ignored before (``nohup`` ignores SIGHUP) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {}

    def _on_signal(signum: int, frame: Any) -> None:
        signal.signal(signum, previous[signum])
        trainer.stop(STOP_REASONS[signum])
        again = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        echo(f"memfit train: stopping after this step and saving the training state ({again} again to abort)")

    for signum in STOP_REASONS:
        if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
            previous[signum] = signal.signal(signum, _on_signal)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
