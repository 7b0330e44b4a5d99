"""The run configuration: a TOML file plus ``--set section.key=value`` overrides.

One keyword-only dataclass per section, each field with a one-line docstring. Unknown keys
are refused with the closest valid name, wrong types with the expected type, and
impossible combinations when the config is built.

Example:
    >>> cfg = load_config(None, ["model.n_layer=2", "train.steps=5"])
    >>> cfg.model.n_layer, cfg.train.steps
    (2, 5)
    >>> load_config(None, ["model.n_layers=2"])
    Traceback (most recent call last):
    ...
    memfit.errors.ConfigError: unknown config key 'model.n_layers' (did you mean 'model.n_layer'?).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from memfit.app.config_rules import validate_config
from memfit.errors import ConfigError, shown
from memfit.reading import read_bounded

__all__ = [
    "Config",
    "DataConfig",
    "MemoryConfig",
    "ModelConfig",
    "OptimizerConfig",
    "TrainConfig",
    "check_depth",
    "config_from_dict",
    "load_config",
    "read_toml",
]

#: TOML's integers are 64-bit; larger ones are typing mistakes that would overflow later.
_MAX_INT = 2**63 - 1
#: The largest config file read (a config is a few kilobytes of TOML).
MAX_CONFIG_BYTES = 4 * 2**20
#: The deepest nesting of tables and arrays a config may hold (``[[[...]]]``).
MAX_DEPTH = 32


@dataclass(kw_only=True)
class ModelConfig:
    """Which model to build (never downloads weights)."""

    name: str = "gpt"
    """``"gpt"`` (built-in), ``"hf:gpt2"``-style (Hugging Face, from config) or ``"import:mod:factory"``."""
    n_layer: int = 4
    """Built-in GPT: transformer blocks."""
    n_embd: int = 128
    """Built-in GPT: width."""
    n_head: int = 4
    """Built-in GPT: attention heads."""
    block_size: int = 128
    """Built-in GPT: context length, also the training sequence length."""
    dropout: float = 0.0
    """Built-in GPT: dropout probability."""
    mlp_ratio: int = 4
    """Built-in GPT: MLP hidden width as a multiple of n_embd."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to an imported factory."""


@dataclass(kw_only=True)
class DataConfig:
    """The text the model trains on."""

    path: str = "stdlib"
    """A text file, a directory of text files, or ``"stdlib"`` (Python's own sources)."""
    val_fraction: float = 0.05
    """Fraction of the bytes held out for validation (the last part)."""
    max_bytes: int = 8_000_000
    """Read at most this many bytes of text."""


@dataclass(kw_only=True)
class OptimizerConfig:
    """AdamW settings."""

    lr: float = 1e-3
    """Learning rate."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam's beta1 and beta2."""
    eps: float = 1e-8
    """Adam's epsilon."""
    clip_norm: float = 1.0
    """Clip the gradient norm to this (0 turns clipping off)."""
    schedule: str = "constant"
    """Learning-rate schedule after warm-up: ``"constant"`` or ``"cosine"`` (to 10% of lr)."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up from 0."""


@dataclass(kw_only=True)
class TrainConfig:
    """How long and how to train."""

    batch_size: int = 8
    """Sequences per optimizer step (the effective batch)."""
    grad_accum: int = 1
    """Split each batch into this many micro-batches with gradient accumulation."""
    steps: int = 200
    """Optimizer steps."""
    eval_every: int = 50
    """Evaluate validation loss every this many steps (0: only at the end)."""
    eval_batches: int = 4
    """Validation batches per evaluation."""
    seed: int = 0
    """Seed of weights and data order."""
    out: str = "memfit-out"
    """Output directory."""
    checkpoint_every: int = 50
    """Save the training state every this many steps (0: only at the end)."""
    device: str = "auto"
    """``"auto"``, ``"cpu"`` or ``"cuda"``/``"cuda:N"``."""
    distributed: str = "none"
    """Under torchrun: ``"ddp"`` or ``"fsdp2"`` (``"none"``: one process)."""
    compile: bool = False
    """Compile the model with ``torch.compile`` once the plan is applied (plans are made eagerly)."""


@dataclass(kw_only=True)
class MemoryConfig:
    """Precision and checkpointing."""

    precision: str = "auto"
    """``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"auto"`` (fp32 and what the device runs natively;
    the default of ``memfit.plan`` and ``memfit.Precision`` too)."""
    checkpointing: str = "none"
    """``"none"``, ``"full"``, ``"selective"``, ``"every:K"`` or ``"auto"`` (needs budget)."""
    budget: str = ""
    """Memory budget for ``checkpointing = "auto"``: ``"6GiB"``, ``"500MB"``, ``"60%"``."""
    fp32_modules: list[str] = field(default_factory=list)
    """Qualified module names kept in fp32 under autocast."""
    on_overflow: str = "stop"
    """Guard: ``"stop"`` (on a non-finite loss) or ``"fallback"`` (switch precision where it can)."""


@dataclass(kw_only=True)
class Config:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    def __post_init__(self) -> None:
        validate_config(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dicts, e.g. for a report."""
        return dataclasses.asdict(self)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against the field type; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(key, arg, value)
            except ConfigError:
                continue
        raise ConfigError(f"{key} must be {tp}, got {shown(value)}.")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {shown(value)}.")
        (item,) = typing.get_args(tp)
        return [_coerce(key, item, v) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table, got {shown(value)}.")
        return value
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"{key} must be an integer, got {shown(value)}.")
    if tp is int and isinstance(value, int) and abs(value) > _MAX_INT:
        raise ConfigError(f"{key} is too large ({len(str(value))} digits); give at most {_MAX_INT}.")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{key} must be {_type_name(tp)}, got {shown(value)} ({type(value).__name__}).")
    return value


def _parse_value(text: str) -> Any:
    """Read an override's value as TOML (numbers, booleans, lists, quoted strings) or text."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, ValueError, RecursionError, KeyError):
        # NOTE: ValueError: an integer of more than 4300 digits; KeyError: text that is a
        # whole TOML document of its own ("1\n[v]" defines no key v).
        return text


def _set(tree: dict[str, Any], key: str, value: Any) -> None:
    section, dot, name = key.partition(".")
    if not dot or not name:
        raise ConfigError(f"--set {key}=... must name section.key, e.g. model.n_layer=8.")
    tree.setdefault(section, {})
    if not isinstance(tree[section], dict):
        raise ConfigError(f"{section} must be a table, got {shown(tree[section])}.")
    if "." in name and section == "model" and name.startswith("kwargs."):
        kwargs, arg = tree[section].setdefault("kwargs", {}), name.split(".", 1)[1]
        if not arg:
            raise ConfigError(f"--set {key}=... must name an argument, e.g. model.kwargs.preset='7b'.")
        if not isinstance(kwargs, dict):
            raise ConfigError(
                f"model.kwargs is a {type(kwargs).__name__}, not a table, so --set {key}=... cannot add "
                "to it; drop the other model.kwargs setting or make it a table."
            )
        kwargs[arg] = value
    else:
        tree[section][name] = value


def _budget_text(value: Any) -> Any:
    """A budget given as a number of bytes (``budget = 2000000``) becomes its text."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"memory.budget must be a finite number of bytes, got {shown(value)}.")
    return str(value) if isinstance(value, int) else format(value, "f")


def _build(tree: dict[str, Any]) -> Config:
    sections = {f.name: f for f in dataclasses.fields(Config)}
    hints = typing.get_type_hints(Config)
    built: dict[str, Any] = {}
    for section, values in tree.items():
        if section not in sections:
            close = difflib.get_close_matches(section, list(sections), n=1)
            hint = f" (did you mean {shown(close[0])}?)" if close else f"; sections are {', '.join(sections)}"
            raise ConfigError(f"unknown config section {shown(section)}{hint}.")
        if not isinstance(values, dict):
            raise ConfigError(f"config section {shown(section)} must be a table, got {shown(values)}.")
        cls = hints[section]
        field_types = typing.get_type_hints(cls)
        kwargs = {}
        for name, value in values.items():
            key = f"{section}.{name}"
            if name not in field_types:
                valid = [f"{section}.{n}" for n in field_types]
                close = difflib.get_close_matches(key, valid, n=1)
                hint = f" (did you mean {shown(close[0])}?)" if close else f"; valid keys: {', '.join(valid)}"
                raise ConfigError(f"unknown config key {shown(key)}{hint}.")
            if key == "memory.budget":
                value = _budget_text(value)
            kwargs[name] = _coerce(key, field_types[name], value)
        built[section] = cls(**kwargs)
    return Config(**built)


def config_from_dict(tree: dict[str, Any], overrides: list[str] | None = None) -> Config:
    """Build a Config from nested dicts (a parsed TOML file, or ``Config.to_dict()``) and overrides.

    Raises:
        ConfigError: a key is unknown, a value has the wrong type, or the combination is
            impossible.
    """
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    for item in overrides or []:
        key, eq, text = item.partition("=")
        if not eq:
            raise ConfigError(f"--set {shown(item)} must look like section.key=value.")
        _set(tree, key.strip(), _parse_value(text.strip()))
    check_depth(tree, "the config")
    return _build(tree)


def read_toml(path: str | Path) -> dict[str, Any]:
    """The parsed TOML file at ``path``; a ConfigError naming the problem if it cannot be read.

    The file must be a regular file of at most :data:`MAX_CONFIG_BYTES`, nested at most
    :data:`MAX_DEPTH` tables or arrays deep.
    """
    p = Path(path)
    where = f"config file {str(p)!r}"
    text = read_bounded(p, "config file", MAX_CONFIG_BYTES, hint="give the path of a TOML file.")
    try:
        tree = tomllib.loads(text.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        # NOTE: ValueError is TOMLDecodeError, or an integer of more than 4300 digits
        raise ConfigError(f"{where} is not valid TOML: {shown(str(exc).rstrip('.'), 200)[1:-1]}.") from None
    except RecursionError:
        raise _too_deep(where, MAX_DEPTH) from None
    check_depth(tree, where)
    return tree


def _too_deep(where: str, limit: int) -> ConfigError:
    return ConfigError(f"{where} nests tables or arrays more than {limit} levels deep; a config needs a few.")


def check_depth(tree: Any, where: str, limit: int = MAX_DEPTH) -> None:
    """Refuse tables and arrays nested deeper than ``limit``, walking level by level (no recursion).

    Raises:
        ConfigError: one sentence naming ``where``.
    """
    level: list[Any] = [tree]
    for _ in range(limit):
        level = [
            v for x in level for v in (x.values() if isinstance(x, dict) else x) if isinstance(v, dict | list)
        ]
        if not level:
            return
    raise _too_deep(where, limit)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a TOML config (or the defaults, for ``None``) and apply ``section.key=value`` overrides.

    Raises:
        ConfigError: the file is missing, unreadable or not TOML, a key is unknown, a value
            has the wrong type, or the combination is impossible.
    """
    return config_from_dict(read_toml(path) if path is not None else {}, overrides)
