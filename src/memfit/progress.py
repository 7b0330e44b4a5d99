"""Progress while memfit works: a tqdm bar on a terminal, plain lines in a log, nothing when quiet.

Long work (planning, profiling, estimating, benchmarking, the stability check) runs in
*phases*, ``with phase("timing blocks.0 alone", total=8) as ph: ... ph.advance()``; where
they show depends on stderr:

- a terminal: a tqdm bar per phase (``timing blocks.0 alone:  38%|███▊ | 3/8 [00:04<00:07]``,
  tqdm's own estimate of the time left), a nested phase's bar under its outer one's, each
  gone when its phase ends;
- not a terminal (a log, a pipe): plain lines, ``memfit: timing blocks.0 alone: 3/8, about
  12 s left``: one when a phase starts, at most one per 2 s while the innermost phase
  advances, and one when a phase that took 2 s or more ends (see Note [lines a log can read]);
- quiet (``configure(quiet=True)``, or the environment variable ``MEMFIT_QUIET=1``, which
  ``memfit ... --quiet`` sets): nothing.

Progress goes to stderr only, never stdout (stdout carries results and JSON). The
``memfit`` command shows progress on a terminal and in a log; a Python caller sees the bar
on a terminal and nothing otherwise, unless it asks with ``configure(quiet=False)`` (see
Note [progress for commands and for Python callers]). This module uses the standard
library and tqdm only (imported when a bar is drawn), so it may be imported from anywhere.

Trade-off: the plain lines are rate-limited and a phase advances only where the code calls
:meth:`Phase.advance`, so one long step with nothing to count is one line at its start.

Example:
    >>> import io
    >>> log = io.StringIO()
    >>> configure(quiet=False, stream=log)
    >>> with phase("timing blocks.0 alone", total=8) as ph:
    ...     ph.advance(3, detail="full")
    >>> note("the plan fits")
    >>> print(log.getvalue(), end="")
    memfit: timing blocks.0 alone: 0/8
    memfit: the plan fits
    >>> configure()  # back to the defaults
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Literal, TypeVar

__all__ = ["INTERVAL", "Phase", "Style", "configure", "configured", "note", "phase", "starting", "style"]
__all__ += ["waiting"]

#: How progress shows: a tqdm bar, plain lines, or not at all.
Style = Literal["bar", "lines", "off"]

#: Seconds between two plain lines of one phase (and the shortest phase whose end is a line).
INTERVAL = 2.0

T = TypeVar("T")

#: The longest a running phase goes without a line (See Note [never silent for long]).
WAITING_INTERVAL = 8.0

#: Values of ``MEMFIT_QUIET`` that do not silence progress.
_NOT_QUIET = frozenset({"", "0", "false", "no", "off"})


@dataclass(frozen=True)
class _Settings:
    quiet: bool | None = None
    stream: IO[str] | None = None
    interval: float = INTERVAL
    clock: Callable[[], float] = time.monotonic


_settings = _Settings()
_lock = threading.RLock()
_stack: list[Phase] = []
"""The phases running now, outermost first (one process: phases of all threads)."""
_said = [0]
"""How many lines progress has shown (bars and notes included), for :func:`starting`."""


def configure(
    *,
    quiet: bool | None = None,
    stream: IO[str] | None = None,
    interval: float = INTERVAL,
    clock: Callable[[], float] | None = None,
) -> None:
    """Set how progress shows; every call replaces the whole setting (``configure()``: defaults).

    Args:
        quiet: True: nothing; False: progress also when stderr is not a terminal (plain
            lines); None (default): see Note [progress for commands and for Python callers].
            ``MEMFIT_QUIET=1`` in the environment silences progress whatever this says.
        stream: where progress goes (default: ``sys.stderr`` as it is at each line).
        interval: seconds between two plain lines of one phase.
        clock: seconds, monotonic (default :func:`time.monotonic`; tests pass a fake one).
    """
    global _settings
    with _lock:
        _settings = _Settings(quiet, stream, interval, clock or time.monotonic)


@contextmanager
def configured(*, quiet: bool | None = None, stream: IO[str] | None = None) -> Iterator[None]:
    """The settings as now, with ``quiet`` and ``stream`` replaced where not None, while the
    body runs (what ``memfit.bench(progress=False)`` runs under)."""
    global _settings
    with _lock:
        before = _settings
        _settings = replace(
            before,
            quiet=before.quiet if quiet is None else quiet,
            stream=before.stream if stream is None else stream,
        )
    try:
        yield
    finally:
        with _lock:
            _settings = before


# Note [progress for commands and for Python callers]
# The command is where silence hurts: `memfit plan` in a log said nothing for minutes. So
# the `memfit` command (`python -m memfit`, the `memfit` script, `torchrun -m memfit`,
# recognised by the program's __main__) shows progress on a terminal and as plain lines in a
# log. A Python caller of memfit.plan or memfit.profile gets the bar on a terminal, as
# memfit.Trainer does, and nothing in a log, a notebook or test output it did not ask to
# share; configure(quiet=False) asks. A call of memfit.cli.main.main() from Python (the
# tests) is a Python caller. MEMFIT_QUIET=1 silences both.


def _env_quiet() -> bool:
    return os.environ.get("MEMFIT_QUIET", "").strip().lower() not in _NOT_QUIET


def _as_command() -> bool:
    """Whether this process is the ``memfit`` command.

    See Note [progress for commands and for Python callers].
    """
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if (getattr(spec, "name", None) or "").split(".")[0] == "memfit":
        return True
    return bool(sys.argv and sys.argv[0]) and Path(sys.argv[0]).stem == "memfit"


def _stream() -> IO[str] | None:
    return _settings.stream if _settings.stream is not None else sys.stderr


def _is_tty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def style() -> Style:
    """How a phase started now shows: ``"bar"``, ``"lines"`` or ``"off"``."""
    stream = _stream()
    if stream is None or _settings.quiet or _env_quiet():
        return "off"
    if _is_tty(stream):
        return "bar"
    return "lines" if _settings.quiet is False or _as_command() else "off"


def _write(stream: IO[str] | None, text: str) -> None:
    """One line; progress never stops the work (a closed or broken stream is skipped)."""
    _said[0] += 1
    if stream is None:
        return
    try:
        stream.write(text + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass


def _duration(seconds: float) -> str:
    """``0.4 s``, ``12 s``, ``3 min``, ``1.5 h``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# Note [lines a log can read]
# A log gets a line when a phase starts (so it says what runs now, however long), at most
# one line per interval while the innermost phase advances (an outer phase is quiet while
# an inner one runs: its start line already said what it is), and a line at the end only
# for a phase that took an interval or more: a short phase's end is the next line. The
# time left is the time per step so far times the steps left.


class Phase:
    """One phase of work in progress, as :func:`phase` yields it; ``advance`` counts its steps.

    Attributes:
        name: what runs (``"timing blocks.0 alone"``).
        total: the steps it takes (None: unknown).
        done: the steps done so far.
    """

    def __init__(self, name: str, total: int | None, how: Style, done: int = 0) -> None:
        self.name, self.total, self.done = name, total, done
        self.detail = ""
        self._style, self._stream, self._settings = how, _stream(), _settings
        self._started = self._last = self._settings.clock()
        self._said_at = time.monotonic()  # real time of its last line: See Note [never silent for long]
        self._timed_from = done  # the steps done before the clock of the time left started
        self._bar: Any = None
        if how == "bar":
            from tqdm import tqdm  # imported here: a bar is the only use of tqdm

            fmt = None if total else "{desc} ({elapsed})"
            self._bar = tqdm(
                total=total, desc=name, file=self._stream, leave=False, dynamic_ncols=True, unit="step",
                bar_format=fmt, initial=done,
            )  # fmt: skip
        elif how == "lines":
            _write(self._stream, f"memfit: {name}" + (f": {done}/{total}" if total else ""))
        if how != "off":
            _start_heartbeat()

    def advance(self, n: int = 1, detail: str | None = None, timed: bool = True) -> None:
        """``n`` more steps done; ``detail`` (what was just done: a mode, a strategy) shows after
        the count. ``timed=False``: these steps were not typical (a compiled model's first step,
        which compiled it), and the time left is estimated from the steps after them."""
        with _lock:
            self.done += n
            self.detail = self.detail if detail is None else detail
            if not timed:
                self._timed_from, self._started = self.done, self._settings.clock()
            if self._bar is not None:
                if detail is not None:
                    self._bar.set_postfix_str(detail, refresh=False)
                self._bar.update(n)
                if not timed:
                    self._bar.reset(total=self.total)  # its rate starts again from here
                    self._bar.update(self.done)
                return
            if self._style != "lines" or not _stack or _stack[-1] is not self:
                return  # See Note [lines a log can read]
            now = self._settings.clock()
            if now - self._last >= self._settings.interval or not timed:
                self._last, self._said_at = now, time.monotonic()
                _write(self._stream, self._line(now))

    def over(self, items: Iterable[T]) -> Iterator[T]:
        """Each of ``items``, advancing one step after each (``[run(x) for x in ph.over(xs)]``)."""
        for item in items:
            yield item
            self.advance()

    def _line(self, now: float) -> str:
        elapsed = now - self._started
        if self.total is None and not self.done:
            return f"memfit: {self.name}: {_duration(elapsed)} so far"
        count = f"{self.done}/{self.total}" if self.total else f"{self.done} done"
        text = f"memfit: {self.name}: {count}" + (f" ({self.detail})" if self.detail else "")
        timed = self.done - self._timed_from
        if self.total and timed > 0 and self.done < self.total:
            return text + f", about {_duration(elapsed / timed * (self.total - self.done))} left"
        if self.total and timed == 0:
            return text  # nothing timed yet: no time to tell
        return text + f", {_duration(elapsed)} so far"

    def _end(self, finished: bool) -> None:
        if self._bar is not None:
            self._bar.close()
            return
        elapsed = self._settings.clock() - self._started
        if self._style != "lines" or elapsed < self._settings.interval:
            return
        count = f"{self.done}/{self.total} " if self.total else ""
        how = f"{count}done in" if finished else "stopped after"
        _write(self._stream, f"memfit: {self.name}: {how} {_duration(elapsed)}")


# Note [never silent for long]
# A phase advances where the code calls advance(); one strategy's measurement, a compilation
# or torchao's first step may take half a minute between two calls, and a log that says
# nothing for that long looks hung. One daemon thread looks at the innermost phase every
# second: if it has shown nothing for WAITING_INTERVAL seconds (real time, whatever clock the
# settings hold), it writes the phase's line again (the count, the time so far) or redraws
# its bar. The thread starts with the first phase shown and lives as long as the process.

_heartbeat: list[threading.Thread] = []


def _start_heartbeat() -> None:
    with _lock:
        if not _heartbeat:
            _heartbeat.append(threading.Thread(target=_beat, name="memfit-progress", daemon=True))
            _heartbeat[0].start()


def _beat() -> None:
    while True:
        time.sleep(min(1.0, WAITING_INTERVAL / 4))
        with _lock:
            ph = _stack[-1] if _stack else None
            if ph is None or time.monotonic() - ph._said_at < WAITING_INTERVAL:
                continue
            ph._said_at = time.monotonic()
            if ph._bar is not None:
                ph._bar.refresh()
            elif ph._style == "lines":
                _write(ph._stream, ph._line(ph._settings.clock()))


@contextmanager
def phase(name: str, total: int | None = None, done: int = 0) -> Iterator[Phase]:
    """A phase of work called ``name`` of ``total`` steps (None: not counted; 0: nothing to do,
    nothing shown) while the body runs; ``done`` of them are done already (training resumed).

    Phases nest: a terminal shows a bar per phase, a log the innermost phase's lines. An
    exception in the body ends the phase (``stopped after`` in a log) and goes on.
    """
    with _lock:
        ph = Phase(name, total, style() if total != 0 else "off", done)  # no steps: nothing to show
        _stack.append(ph)
    finished = False
    try:
        yield ph
        finished = True
    finally:
        with _lock:
            if ph in _stack:
                _stack.remove(ph)
            ph._end(finished)


def note(message: str) -> None:
    """One line of progress (``memfit: <message>``), shown as phases are."""
    how = style()
    if how == "lines":
        _write(_stream(), f"memfit: {message}")
    elif how == "bar":
        from tqdm import tqdm

        with _lock:
            _said[0] += 1
            tqdm.write(f"memfit: {message}", file=_stream())


@contextmanager
def waiting(name: str) -> Iterator[Phase]:
    """A phase that waits on one long call with nothing to count (a compilation): a line when it
    starts and, while it runs, one every :data:`WAITING_INTERVAL` seconds saying how long it has
    taken (See Note [never silent for long]).

    Example:
        >>> import io
        >>> log = io.StringIO()
        >>> with configured(quiet=False, stream=log), waiting("compiling the step"):
        ...     pass
        >>> print(log.getvalue(), end="")
        memfit: compiling the step
    """
    with phase(name) as ph:
        yield ph


@contextmanager
def starting(what: str, after: float = 5.0) -> Iterator[None]:
    """While the body runs and progress has shown nothing yet (no line, no phase), a note every
    ``after`` seconds: ``memfit: <what> (10 s so far)``. A command's first seconds (importing
    torch, reading data, building the model) then never pass in silence on a busy machine.

    Example:
        >>> import io
        >>> log = io.StringIO()
        >>> with configured(quiet=False, stream=log), starting("starting", after=0.01):
        ...     time.sleep(0.1)
        >>> first = log.getvalue().splitlines()[0]
        >>> first.startswith("memfit: starting (") and first.endswith(" s so far)")
        True
    """
    stop, started = threading.Event(), time.monotonic()

    def watch(expected: int) -> None:
        while not stop.wait(after):
            if _said[0] != expected or _stack:
                return  # the command speaks for itself from here on
            note(f"{what} ({_duration(time.monotonic() - started)} so far)")
            expected = _said[0]

    watcher = threading.Thread(target=watch, args=(_said[0],), name="memfit-starting", daemon=True)
    if style() != "off":
        watcher.start()
    try:
        yield
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
