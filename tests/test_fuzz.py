"""Property-based tests: every input to the user-facing parsers gives a valid result or a
:class:`memfit.MemfitError`, never another exception (issue 15).

Seven inputs are fuzzed: ``memfit.budget.parse_bytes``, the config loader with random ``--set``
keys and values, ``Plan.from_json`` with random JSON, the command line (parsing plus each
command's ``check``, which validates every input before any work), and (issue 26) config
files (random TOML, deep nesting, large values, FIFOs and devices), plan files read by
``memfit check --plan``, and the Python API (batches, optimizers, micro-batches and loss
functions given to ``memfit.train_step``). The runs are derandomized, so ``make test`` sees
the same inputs every time; set ``MEMFIT_FUZZ_SCALE`` (e.g. 10) and ``MEMFIT_FUZZ_RANDOM=1``
for a longer, fresh search.

Bound: about 3,200 inputs in all, about a minute on a busy 2-core machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memfit.api_input import check_plan_inputs
from memfit.app.config import Config, load_config
from memfit.budget import parse_bytes
from memfit.cli.main import _parser, parse_args
from memfit.errors import MemfitError
from memfit.records import Plan

SCALE = max(1, int(os.environ.get("MEMFIT_FUZZ_SCALE", "1")))
COUNTS: dict[str, int] = {}


def _settings(n: int) -> Callable[[Any], Any]:
    return settings(
        max_examples=n * SCALE,
        deadline=None,
        derandomize=not os.environ.get("MEMFIT_FUZZ_RANDOM"),
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


def _run(name: str, n: int, body: Callable[[], None]) -> None:
    """Run a ``@given`` property and check it saw at least ``n`` inputs."""
    COUNTS[name] = 0
    body()
    assert COUNTS[name] >= n * SCALE, f"{name} saw only {COUNTS[name]} inputs"


def _count(name: str) -> None:
    COUNTS[name] += 1


# -- parse_bytes ------------------------------------------------------------------------

_UNITS = [
    "",
    "b",
    "B",
    "kb",
    "MB",
    "gb",
    "TB",
    "KiB",
    "mib",
    "GiB",
    "tib",
    "k",
    "M",
    "g",
    "T",
    "%",
    "xb",
    "e3",
]
_BUDGET_TEXT = st.builds(
    lambda sign, digits, frac, space, unit: f"{space}{sign}{digits}{frac}{space}{unit}",
    st.sampled_from(["", "+", "-", "--"]),
    st.one_of(st.text("0123456789", max_size=400), st.just("9" * 400)),
    st.one_of(st.just(""), st.text(".0123456789", max_size=6)),
    st.sampled_from(["", " ", "\t", " \n"]),
    st.sampled_from(_UNITS),
)
_BUDGET = st.one_of(
    _BUDGET_TEXT,
    st.text(max_size=30),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=0, max_value=2),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=2),
)


def test_parse_bytes_fuzz() -> None:
    @_settings(900)
    @given(value=_BUDGET, reference=st.one_of(st.none(), st.integers(min_value=-(2**10), max_value=2**70)))
    def prop(value: Any, reference: int | None) -> None:
        _count("parse_bytes")
        try:
            result = parse_bytes(value, reference=reference)
        except MemfitError:
            return
        assert type(result) is int and 0 < result < 2**63

    _run("parse_bytes", 900, prop)


# -- the config loader with random --set keys and values -----------------------------------


def _valid_keys() -> list[str]:
    cfg = Config()
    return [
        f"{s.name}.{f.name}"
        for s in dataclasses.fields(cfg)
        for f in dataclasses.fields(getattr(cfg, s.name))
    ]


_VALUE_TEXT = st.one_of(
    st.integers().map(str),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.just("9" * 5000),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "true", "false", "1e400", "-0.0", "0", "1979-05-27", "[[[[1]]]]"]),
    st.text(max_size=20).map(lambda t: json.dumps(t)),  # a TOML basic string
    st.text(max_size=20),  # raw text
    st.lists(st.one_of(st.integers(-5, 5), st.floats(-2, 2), st.text(max_size=3)), max_size=3).map(
        lambda xs: json.dumps(xs)
    ),
    st.sampled_from(
        ["'auto'", "'every:2'", "'every:0'", "'every:²'", "'60%'", "'cuda:9'", "'fp16'", "{a = 1}"]
    ),
    st.just("[" * 2000),
)
_KEY = st.one_of(
    st.sampled_from(_valid_keys()), st.text(max_size=15), st.sampled_from(["model.kwargs.x", "train"])
)


def test_config_overrides_fuzz() -> None:
    @_settings(700)
    @given(items=st.lists(st.tuples(_KEY, _VALUE_TEXT), min_size=1, max_size=4))
    def prop(items: list[tuple[str, str]]) -> None:
        _count("config")
        try:
            cfg = load_config(None, [f"{k}={v}" for k, v in items])
        except MemfitError:
            return
        assert isinstance(cfg, Config)

    _run("config", 700, prop)


# -- Plan.from_json with random JSON -----------------------------------------------------

_JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_PLAN_FIELDS = [f.name for f in dataclasses.fields(Plan)]
_PLAN_LIKE = st.dictionaries(
    st.one_of(st.sampled_from(_PLAN_FIELDS), st.text(max_size=6)),
    st.one_of(
        _JSON, st.dictionaries(st.text(max_size=6), st.sampled_from(["keep", "full", "selective", 3, None]))
    ),
    max_size=6,
)


def test_plan_from_json_fuzz() -> None:
    @_settings(600)
    @given(
        text=st.one_of(
            _JSON.map(json.dumps),
            _PLAN_LIKE.map(json.dumps),
            st.text(max_size=40),
            st.just("[" * 100_000),
        )
    )
    def prop(text: str) -> None:
        _count("plan")
        try:
            plan = Plan.from_json(text)
        except MemfitError:
            return
        assert isinstance(plan, Plan) and isinstance(plan.blocks, dict)
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in plan.blocks.items())
        assert type(plan.micro_batches) is int and isinstance(plan.notes, list)

    _run("plan", 600, prop)


# -- the command line: parsing and each command's check ---------------------------------------


def _options() -> dict[str, list[str]]:
    sub = next(a for a in _parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return {
        name: [s for a in p._actions for s in a.option_strings if s not in ("-h", "--help")]
        for name, p in sub.choices.items()  # type: ignore[attr-defined]
    }


_OPTIONS = _options()
# NOTE: argv cannot hold NUL bytes, and values stay relative (no "/"), so the checks' probe
# of the output directory only ever touches the test's own temporary directory.
_ARG = st.text(
    alphabet=st.characters(blacklist_characters="\x00/", blacklist_categories=("Cs",)), max_size=12
)
_VALUE = st.one_of(
    _ARG,
    st.integers(-3, 10**6).map(str),
    st.sampled_from(["-1GB", "60%", "2GiB", "0", "9" * 400, "fp16", "all", "bf16/*", "x.toml", "--", "-h"]),
    st.builds(
        lambda k, v: f"{k}={v}", st.sampled_from(_valid_keys()), _VALUE_TEXT.filter(lambda t: "\x00" not in t)
    ),
)


@st.composite
def _argv(draw: st.DrawFn) -> list[str]:
    command = draw(st.one_of(st.sampled_from(sorted(_OPTIONS)), _ARG))
    options = _OPTIONS.get(command, ["--set", "--out"])
    tokens = draw(st.lists(st.one_of(st.sampled_from(options), _VALUE), max_size=6))
    return [command, *tokens]


def test_command_line_fuzz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEMFIT_STATE_KEY", str(tmp_path / "state.key"))

    @_settings(450)
    @given(argv=_argv())
    def prop(argv: list[str]) -> None:
        _count("cli")
        sink = io.StringIO()
        try:
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                args = parse_args(argv)
                if args._check is not None:
                    args._check(args)
        except MemfitError:
            return
        except SystemExit as exit_:  # --help: printed, exit code 0
            assert exit_.code == 0 and any(t in ("-h", "--help") or t.startswith("--h") for t in argv), argv

    _run("cli", 450, prop)


# -- config files: random TOML, nesting, sizes and files that are not regular (issue 26) ------

_TOML_VALUE = st.one_of(
    _VALUE_TEXT.filter(lambda t: "\n" not in t and "\x00" not in t),
    st.integers(0, 6000).map(lambda n: "[" * n + "]" * n),
    st.integers(0, 6000).map(lambda n: "{ a = " * n + "1" + " }" * n),
    st.just('"' + "x" * 40_000 + '"'),
    st.just("9" * 5000),
)
_TOML_LINE = st.one_of(
    st.builds(lambda k, v: f"{k.rpartition('.')[2]} = {v}", _KEY, _TOML_VALUE),
    st.sampled_from(["[model]", "[train]", "[data]", "[memory]", "[optimizer]", "[[train]]", "[x.y.z]", "["]),
    st.text(max_size=30),
)


def test_config_files_fuzz(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    special = [str(fifo), "/dev/zero", "/dev/null", str(tmp_path), str(tmp_path / "missing.toml")]

    @_settings(300)
    @given(lines=st.lists(_TOML_LINE, max_size=8), other=st.one_of(st.none(), st.sampled_from(special)))
    def prop(lines: list[str], other: str | None) -> None:
        _count("config file")
        path = tmp_path / "run.toml"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        try:
            cfg = load_config(other or path)
        except MemfitError:
            return
        assert isinstance(cfg, Config)

    _run("config file", 300, prop)


# -- plan files as memfit check --plan reads them (issue 26) -------------------------------------

_PLAN_TEXT = st.one_of(
    _PLAN_LIKE.map(lambda d: json.dumps({"memfit": "plan", **d})),
    st.builds(
        lambda mb, blocks: json.dumps({"memfit": "plan", "blocks": blocks, "micro_batches": mb}),
        st.one_of(st.integers(), st.integers(min_value=-(10**40), max_value=10**40), st.floats(), st.none()),
        st.dictionaries(
            st.text(max_size=6), st.sampled_from(["none", "full", "selective", "keep", "x"]), max_size=3
        ),
    ),
    st.integers(0, 100_000).map(lambda n: "[" * n),
    st.text(max_size=40),
    st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
)


def test_plan_files_fuzz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)

    @_settings(200)
    @given(
        text=_PLAN_TEXT, other=st.one_of(st.none(), st.sampled_from([str(fifo), "/dev/zero", str(tmp_path)]))
    )
    def prop(text: str, other: str | None) -> None:
        _count("plan file")
        path = tmp_path / "plan.json"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        args = parse_args(["check", "--plan", other or str(path), "--out", "c"])
        try:
            args._check(args)
        except MemfitError:
            return

    _run("plan file", 200, prop)


# -- the Python API: memfit.train_step with random batches, plans and losses (issue 26) -----------


class _AnyShape(torch.nn.Module):
    """A model that runs on a float tensor of any shape, so the fuzz tests memfit, not the model."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0] if x.ndim else 1, -1).sum(-1, keepdim=True) * self.w


_LOSSES: list[Callable[[Any, Any], Any]] = [
    lambda m, b: m(b[0] if isinstance(b, tuple | list) else b).mean(),
    lambda m, b: 3,
    lambda m, b: 2.5,
    lambda m, b: None,
    lambda m, b: m(b[0] if isinstance(b, tuple | list) else b),
    lambda m, b: m(b[0] if isinstance(b, tuple | list) else b).mean() * float("nan"),
    lambda m, b: m(b[0] if isinstance(b, tuple | list) else b).mean() * float("inf"),
    lambda m, b: torch.tensor(1.0),
]


@st.composite
def _api_batch(draw: st.DrawFn) -> Any:
    rows = draw(st.integers(0, 9))
    width = draw(st.sampled_from([4, 4, 4, 3]))
    shape = draw(st.sampled_from([(rows, width), (rows,), ()]))
    x = torch.randn(shape)
    kind = draw(st.sampled_from(["tensor", "tuple", "list", "dict", "int", "mixed"]))
    return {
        "tensor": x,
        "tuple": (x, torch.randn(rows)),
        "list": [x, torch.randn(max(rows - 1, 0))],
        "dict": {"x": x},
        "int": 7,
        "mixed": (x, 3),
    }[kind]


def test_python_api_fuzz() -> None:
    import memfit

    @_settings(250)
    @given(
        batch=_api_batch(),
        loss=st.sampled_from(range(len(_LOSSES))),
        micro=st.integers(1, 12),
        foreign=st.booleans(),
    )
    def prop(batch: Any, loss: int, micro: int, foreign: bool) -> None:
        _count("api")
        model = _AnyShape()
        params = _AnyShape().parameters() if foreign else model.parameters()
        plan = Plan(blocks={}, micro_batches=micro)
        with contextlib.suppress(MemfitError):
            check_plan_inputs(model, batch, torch.optim.SGD(params, lr=0.1))
        model, opt = memfit.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), plan)
        try:
            value = memfit.train_step(model, batch, _LOSSES[loss], opt, plan)
        except MemfitError:
            return
        assert isinstance(value, float) and math.isfinite(value)

    _run("api", 250, prop)


def test_the_fuzz_saw_at_least_2000_inputs() -> None:
    """The suite's bound, from the other way: enough inputs (each property checks its own)."""
    assert 900 + 700 + 600 + 450 + 300 + 200 + 250 >= 3000
    if len(COUNTS) == 7:
        assert sum(COUNTS.values()) >= 3000 * SCALE, COUNTS
