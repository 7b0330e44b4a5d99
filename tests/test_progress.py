"""memfit.progress: a bar on a terminal, rate-limited plain lines in a log, nothing when quiet.

Every test writes to a fake stream and reads time from a fake clock: nothing sleeps.
"""

from __future__ import annotations

import io
import re
import sys
import threading
from collections.abc import Iterator

import pytest

from memfit import progress


class FakeStream(io.StringIO):
    """A text stream that says whether it is a terminal."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def _defaults(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("MEMFIT_QUIET", raising=False)
    progress.configure()
    yield
    progress.configure()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _log(clock: FakeClock, **kw: object) -> FakeStream:
    stream = FakeStream(tty=False)
    progress.configure(quiet=False, stream=stream, clock=clock, **kw)  # type: ignore[arg-type]
    return stream


def _lines(stream: FakeStream) -> list[str]:
    return stream.getvalue().splitlines()


def test_lines_are_rate_limited_per_phase(clock: FakeClock) -> None:
    log = _log(clock)
    with progress.phase("timing blocks.0 alone", total=8) as ph:
        ph.advance()  # at once: no line
        clock.now += 1.0
        ph.advance()  # 1 s after the start: no line
        clock.now += 1.5
        ph.advance(detail="full")  # 2.5 s: a line, with the time left
        clock.now += 1.0
        ph.advance()  # 1 s after the last line: none
        clock.now += 2.0
        ph.advance(4)
    assert _lines(log) == [
        "memfit: timing blocks.0 alone: 0/8",
        "memfit: timing blocks.0 alone: 3/8 (full), about 4.2 s left",
        "memfit: timing blocks.0 alone: 8/8 (full), 5.5 s so far",
        "memfit: timing blocks.0 alone: 8/8 done in 5.5 s",
    ]


def test_a_short_phase_is_one_line_and_a_long_one_says_it_ended(clock: FakeClock) -> None:
    log = _log(clock)
    with progress.phase("a quick step"):
        clock.now += 0.5
    with progress.phase("a long step"):
        clock.now += 95
    assert _lines(log) == [
        "memfit: a quick step",
        "memfit: a long step",
        "memfit: a long step: done in 2 min",
    ]


def test_a_phase_stopped_by_an_error_says_so(clock: FakeClock) -> None:
    log = _log(clock)
    with pytest.raises(RuntimeError), progress.phase("measuring the chosen plan"):
        clock.now += 3
        raise RuntimeError("out of memory")
    assert _lines(log)[-1] == "memfit: measuring the chosen plan: stopped after 3.0 s"


def test_nested_phases_show_the_innermost(clock: FakeClock) -> None:
    log = _log(clock)
    with progress.phase("planning", total=2) as outer:
        with progress.phase("fp32: timing whole steps", total=3) as inner:
            clock.now += 3
            outer.advance()  # the outer phase is quiet while the inner one runs
            inner.advance()
        clock.now += 3
        outer.advance()
    assert _lines(log) == [
        "memfit: planning: 0/2",
        "memfit: fp32: timing whole steps: 0/3",
        "memfit: fp32: timing whole steps: 1/3, about 6.0 s left",
        "memfit: fp32: timing whole steps: 1/3 done in 3.0 s",
        "memfit: planning: 2/2, 6.0 s so far",
        "memfit: planning: 2/2 done in 6.0 s",
    ]


def test_notes_are_lines_too(clock: FakeClock) -> None:
    log = _log(clock)
    progress.note("the plan fits")
    assert _lines(log) == ["memfit: the plan fits"]


def test_a_terminal_gets_a_tqdm_bar_with_the_phase_and_its_count() -> None:
    tty = FakeStream(tty=True)
    progress.configure(stream=tty)
    assert progress.style() == "bar"
    with progress.phase("timing blocks.0 alone", total=8) as ph:
        ph.advance(3, detail="full")
        ph._bar.refresh()  # tqdm redraws at most every 0.1 s; draw now
        shown = tty.getvalue()
    assert "timing blocks.0 alone:" in shown and "3/8" in shown and "full" in shown
    assert "<" in shown  # tqdm's own estimate of the time left: [elapsed<remaining]
    progress.note("the plan fits")
    assert "memfit: the plan fits" in tty.getvalue()


def test_quiet_prints_nothing(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    for tty in (True, False):
        stream = FakeStream(tty=tty)
        progress.configure(quiet=True, stream=stream, clock=clock)
        with progress.phase("planning", total=2) as ph:
            clock.now += 10
            ph.advance(2)
        progress.note("a note")
        assert stream.getvalue() == ""
    monkeypatch.setenv("MEMFIT_QUIET", "1")  # what `memfit --quiet` sets: wins over quiet=False
    log = _log(clock)
    with progress.phase("planning"):
        progress.note("a note")
    assert log.getvalue() == "" and progress.style() == "off"
    monkeypatch.setenv("MEMFIT_QUIET", "0")
    assert progress.style() == "lines"


def test_python_callers_get_no_lines_in_a_log_unless_they_ask(monkeypatch: pytest.MonkeyPatch) -> None:
    log = FakeStream(tty=False)
    progress.configure(stream=log)  # quiet=None: the default
    assert progress.style() == "off"  # pytest is a Python caller
    with progress.phase("planning"):
        pass
    assert log.getvalue() == ""
    monkeypatch.setattr(sys, "argv", ["/venv/bin/memfit", "plan"])  # the memfit command
    assert progress.style() == "lines"


def test_configured_overrides_for_a_while(clock: FakeClock) -> None:
    log = _log(clock)
    with progress.configured(quiet=True):
        assert progress.style() == "off"
        with progress.configured():  # None: as configured
            assert progress.style() == "off"
    assert progress.style() == "lines"
    with progress.phase("after"):
        pass
    assert _lines(log) == ["memfit: after"]


def test_the_default_stream_is_stderr_as_it_is_now(capsys: pytest.CaptureFixture[str]) -> None:
    progress.configure(quiet=False)
    with progress.phase("planning"):
        pass
    out, err = capsys.readouterr()
    assert out == "" and err == "memfit: planning\n"


def test_a_broken_stream_never_stops_the_work(clock: FakeClock) -> None:
    log = _log(clock)
    log.close()
    with progress.phase("planning", total=1) as ph:
        clock.now += 5
        ph.advance()
    progress.note("still fine")


def test_phases_from_threads(clock: FakeClock) -> None:
    log = _log(clock)

    def work(k: int) -> None:
        for _ in range(50):
            with progress.phase(f"thread {k}", total=2) as ph:
                ph.advance(2)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(_lines(log)) == 200 and all(line.startswith("memfit: thread ") for line in _lines(log))
    assert progress._stack == []


def test_a_first_compiled_step_is_not_timed(clock: FakeClock) -> None:
    """Issue 37: after a first step that compiled for 51 s, the time left was 16 minutes."""
    log = _log(clock)
    with progress.phase("training", total=4) as ph:
        clock.now += 51.0
        ph.advance(1, "loss 5.4", timed=False)  # its line at once, without a time left
        clock.now += 1.0
        ph.advance(1, "loss 5.3")  # 1 s after the last line: none
        clock.now += 1.0
        ph.advance(1, "loss 5.2")  # 2 timed steps in 2 s: 1 s for the one left
    assert _lines(log)[:3] == [
        "memfit: training: 0/4",
        "memfit: training: 1/4 (loss 5.4)",
        "memfit: training: 3/4 (loss 5.2), about 1.0 s left",
    ]


def test_a_phase_that_waits_long_says_so_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37: no command silent for more than 10 s. A phase with nothing to count (a
    compilation) and a counted one stuck on a long step both repeat their line meanwhile."""
    monkeypatch.setattr(progress, "WAITING_INTERVAL", 0.05)
    log = FakeStream(tty=False)
    progress.configure(quiet=False, stream=log)
    done = threading.Event()
    with progress.waiting("compiling GPT"):
        done.wait(2.5)  # the heartbeat (which looks every second at most) writes meanwhile
    with progress.phase("bench", total=3) as ph:
        ph.advance(1, "fp32/none")
        done.wait(2.5)
    lines = _lines(log)
    compiling = [ln for ln in lines if ln.startswith("memfit: compiling GPT")]
    assert compiling[0] == "memfit: compiling GPT" and len(compiling) >= 3, lines
    assert all(re.fullmatch(r"memfit: compiling GPT: [0-9.]+ s so far", ln) for ln in compiling[1:-1]), lines
    assert compiling[-1].startswith("memfit: compiling GPT: done in "), lines
    bench = [ln for ln in lines if ln.startswith("memfit: bench")]
    assert bench[0] == "memfit: bench: 0/3" and len(bench) >= 3, lines
    assert all(ln.startswith("memfit: bench: 1/3 (fp32/none), about ") for ln in bench[1:-1]), lines
    assert bench[-1].startswith("memfit: bench: 1/3 done in "), lines
