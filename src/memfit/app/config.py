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
import re
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib
import torch

from memfit.budget import Budget
from memfit.errors import ConfigError, shown
from memfit.reading import read_bounded
from memfit.vocab import (
    CHECKPOINT_MODES,
    DISTRIBUTED_MODES,
    GUARD_ACTIONS,
    PRECISION_CHOICES,
    SCHEDULES,
    DistributedMode,
    GuardAction,
    PrecisionChoice,
    Schedule,
)

__all__ = [
    "Config",
    "DataConfig",
    "LoraConfig",
    "MemoryConfig",
    "ModelConfig",
    "OptimizerConfig",
    "TrainConfig",
    "check_depth",
    "config_from_dict",
    "is_every",
    "load_config",
    "read_toml",
    "validate_config",
]

#: TOML's integers are 64-bit; larger ones are typing mistakes that would overflow later.
_MAX_INT = 2**63 - 1
#: The largest config file read (a config is a few kilobytes of TOML).
MAX_CONFIG_BYTES = 4 * 2**20
#: The deepest nesting of tables and arrays a config may hold (``[[[...]]]``).
MAX_DEPTH = 32


#: How ``[model.lora]`` may store the frozen base, and the levers that store it so.
# Note [the frozen base's storage]
# "fp32" keeps the base as built. "bf16" and "nf4" (QLoRA) are memfit.levers.frozen's levers,
# applied by memfit.app.build.store_frozen_base once the model is on its device, before the
# optimizer is built, so every step (and a plan, measuring the model as stored) sees the
# smaller base. "nf4", like QLoRA, holds the frozen nn.Linear weights in NF4 and the rest
# (embeddings, norms, the head: See Note [what NF4 replaces]) in bf16: both compute in bf16.
FROZEN_BASES: dict[str, tuple[str, ...]] = {
    "fp32": (),
    "bf16": ("frozen_bf16",),
    "nf4": ("frozen_nf4", "frozen_bf16"),
}


@dataclass(kw_only=True)
class LoraConfig:
    """Adapters on the model (peft's LoRA or DoRA): only they train, the base stays frozen."""

    rank: int = 0
    """LoRA rank r; 0: no adapters (the whole model trains)."""
    alpha: float = 16.0
    """LoRA scaling: the adapters' update is scaled by alpha / rank."""
    target_modules: list[str] = field(default_factory=list)
    """Names (or name suffixes) of the Linear layers to adapt; empty: peft's default for a Hugging Face
    architecture (q_proj and v_proj for Llama)."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    method: str = "lora"
    """``"lora"`` or ``"dora"`` (weight-decomposed LoRA)."""
    base: str = "fp32"
    """How the frozen base is stored: ``"fp32"`` (as built), ``"bf16"`` or ``"nf4"`` (QLoRA's 4-bit
    NormalFloat through torchao, the rest in bf16); See Note [the frozen base's storage]."""


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
    lora: LoraConfig = field(default_factory=LoraConfig)
    """``[model.lora]``: adapters to train instead of the whole model (docs/lora.md)."""


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
    schedule: Schedule = "constant"
    """Learning-rate schedule after warm-up: ``"constant"`` or ``"cosine"`` (to 10% of lr)."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up from 0."""

    def make(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """AdamW over ``params`` with these settings: the one optimizer built from a config.

        Example:
            >>> opt = OptimizerConfig(lr=0.01).make(torch.nn.Linear(2, 2).parameters())
            >>> type(opt).__name__, opt.defaults["lr"], opt.defaults["betas"]
            ('AdamW', 0.01, (0.9, 0.95))
        """
        betas = (float(self.betas[0]), float(self.betas[1]))
        return torch.optim.AdamW(
            params, lr=self.lr, betas=betas, eps=self.eps, weight_decay=self.weight_decay
        )


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
    distributed: DistributedMode = "none"
    """Under torchrun: ``"ddp"`` or ``"fsdp2"`` (``"none"``: one process)."""
    compile: bool = False
    """Compile the model with ``torch.compile`` once the plan is applied (plans are made eagerly)."""


@dataclass(kw_only=True)
class MemoryConfig:
    """Precision and checkpointing."""

    precision: PrecisionChoice = "auto"
    """``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"auto"`` (fp32 and what the device runs natively;
    the default of ``memfit.plan`` and ``memfit.Precision`` too)."""
    checkpointing: str = "none"
    """``"none"``, ``"full"``, ``"selective"``, ``"every:K"`` or ``"auto"`` (needs budget)."""
    budget: str = ""
    """Memory budget for ``checkpointing = "auto"``: ``"6GiB"``, ``"500MB"``, ``"60%"``."""
    fp32_modules: list[str] = field(default_factory=list)
    """Qualified module names kept in fp32 under autocast."""
    on_overflow: GuardAction = "stop"
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


#: Seeds go to torch, numpy and python alike; numpy takes 0 .. 2**32 - 1.
MAX_SEED = 2**32 - 1
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def _finite(key: str, value: float, low: float, strict: bool = False, high: float | None = None) -> None:
    """Refuse NaN, infinity and values outside ``[low, high)`` (``(low, ...)`` when strict)."""
    below = value <= low if strict else value < low
    if not math.isfinite(value) or below or (high is not None and value >= high):
        bound = (
            f"in [{low:g}, {high:g})" if high is not None else f"{'above' if strict else 'at least'} {low:g}"
        )
        raise ConfigError(f"{key} must be a finite number {bound}, got {shown(value)}.")


def validate_config(cfg: Config) -> None:
    """Refuse values and combinations that cannot run, with one sentence naming the fix.

    Raises:
        ConfigError: the first problem found.
    """
    positive = {
        "model.n_layer": cfg.model.n_layer,
        "model.n_embd": cfg.model.n_embd,
        "model.n_head": cfg.model.n_head,
        "model.block_size": cfg.model.block_size,
        "model.mlp_ratio": cfg.model.mlp_ratio,
        "data.max_bytes": cfg.data.max_bytes,
        "train.batch_size": cfg.train.batch_size,
        "train.grad_accum": cfg.train.grad_accum,
        "train.steps": cfg.train.steps,
        "train.eval_batches": cfg.train.eval_batches,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key} must be at least 1, got {shown(value)}.")
    for key, value in {
        "train.eval_every": cfg.train.eval_every,
        "train.checkpoint_every": cfg.train.checkpoint_every,
        "optimizer.warmup_steps": cfg.optimizer.warmup_steps,
    }.items():
        if value < 0:
            raise ConfigError(f"{key} must be 0 or more, got {shown(value)}.")
    if not 0 <= cfg.train.seed <= MAX_SEED:
        raise ConfigError(f"train.seed must be an integer from 0 to {MAX_SEED}, got {cfg.train.seed}.")
    if cfg.train.batch_size % cfg.train.grad_accum:
        raise ConfigError(
            f"train.batch_size ({cfg.train.batch_size}) must be divisible by train.grad_accum "
            f"({cfg.train.grad_accum})."
        )
    _finite("model.dropout", cfg.model.dropout, 0.0, high=1.0)
    _finite("data.val_fraction", cfg.data.val_fraction, 0.0, strict=True, high=1.0)
    _finite("optimizer.lr", cfg.optimizer.lr, 0.0, strict=True)
    _finite("optimizer.weight_decay", cfg.optimizer.weight_decay, 0.0)
    _finite("optimizer.eps", cfg.optimizer.eps, 0.0)
    _finite("optimizer.clip_norm", cfg.optimizer.clip_norm, 0.0)
    betas = cfg.optimizer.betas
    if len(betas) != 2 or not all(math.isfinite(b) and 0 <= b < 1 for b in betas):
        raise ConfigError(f"optimizer.betas must be two numbers in [0, 1), got {shown(betas)}.")
    if cfg.optimizer.schedule not in SCHEDULES:
        raise ConfigError(
            f"optimizer.schedule {shown(cfg.optimizer.schedule)} is not one of {', '.join(SCHEDULES)}."
        )
    _memory(cfg.memory)
    _lora(cfg.model)
    _base_precision(cfg)
    if cfg.model.name != "gpt" and not cfg.model.name.startswith(("import:", "hf:")):
        raise ConfigError(
            f"model.name {shown(cfg.model.name)} is not 'gpt', 'hf:NAME' (e.g. hf:gpt2) or "
            "'import:package.module:factory'."
        )
    if cfg.train.distributed not in DISTRIBUTED_MODES:
        raise ConfigError(
            f"train.distributed {shown(cfg.train.distributed)} is not one of {', '.join(DISTRIBUTED_MODES)}."
        )
    if not _DEVICE.match(cfg.train.device):
        raise ConfigError(
            f"train.device {shown(cfg.train.device)} is not one of auto, cpu, cuda, cuda:N, mps."
        )
    if not cfg.train.out.strip():
        raise ConfigError("train.out is empty; give the directory to write the run to.")
    _sizes(cfg)


def _memory(mem: MemoryConfig) -> None:
    """The ``[memory]`` section's rules (checkpointing, budget, precision, overflow guard)."""
    ckpt = mem.checkpointing
    if ckpt not in (*CHECKPOINT_MODES, "auto") and not is_every(ckpt):
        raise ConfigError(
            f"memory.checkpointing {shown(ckpt)} is not one of {', '.join(CHECKPOINT_MODES)}, every:K, auto."
        )
    if ckpt == "auto" and not mem.budget:
        raise ConfigError('memory.checkpointing = "auto" needs memory.budget, e.g. "60%" or "2GiB".')
    if mem.budget:
        # Only the syntax is checked here; a percentage is resolved against the baseline
        # peak once that is measured.
        Budget.parse(mem.budget, what="memory.budget")
    if mem.precision not in PRECISION_CHOICES:
        raise ConfigError(
            f"memory.precision {shown(mem.precision)} is not one of {', '.join(PRECISION_CHOICES)}."
        )
    if mem.on_overflow not in GUARD_ACTIONS:
        raise ConfigError(
            f"memory.on_overflow {shown(mem.on_overflow)} is not one of {', '.join(GUARD_ACTIONS)}."
        )


def _lora(model: ModelConfig) -> None:
    """The ``[model.lora]`` table's rules."""
    lora = model.lora
    if lora.rank < 0:
        raise ConfigError(f"model.lora.rank must be 0 (no adapters) or more, got {shown(lora.rank)}.")
    if lora.rank == 0:
        return
    _finite("model.lora.alpha", lora.alpha, 0.0, strict=True)
    _finite("model.lora.dropout", lora.dropout, 0.0, high=1.0)
    if lora.method not in ("lora", "dora"):
        raise ConfigError(f"model.lora.method {shown(lora.method)} is not one of lora, dora.")
    if lora.base not in FROZEN_BASES:
        raise ConfigError(
            f"model.lora.base {shown(lora.base)} is not one this memfit stores the frozen base in "
            f'({", ".join(FROZEN_BASES)}); set model.lora.base = "fp32", "bf16" or "nf4".'
        )
    if model.name == "gpt" and not lora.target_modules:
        raise ConfigError(
            "model.lora.target_modules is empty, and peft has no default for the built-in GPT; name its "
            'Linear layers, e.g. target_modules = ["qkv", "proj"].'
        )


def _base_precision(cfg: Config) -> None:
    """A bf16 or NF4 frozen base computes in bf16 (See Note [the frozen base's storage])."""
    base, precision = cfg.model.lora.base, cfg.memory.precision
    if cfg.model.lora.rank > 0 and FROZEN_BASES.get(base) and precision not in ("bf16", "auto"):
        raise ConfigError(
            f"model.lora.base = {shown(base)} keeps the frozen base in {base}, so the step computes in bf16, "
            f'not {precision}; set memory.precision = "bf16" (or model.lora.base = "fp32").'
        )


#: More tokens than any step (or evaluation) trains on: batch_size x block_size.
MAX_TOKENS = 2**28
#: More parameters than any machine holds (4 TiB in fp32).
MAX_PARAMETERS = 2**40


def _sizes(cfg: Config) -> None:
    """Refuse sizes no machine holds before anything is allocated (``batch_size = 2**63-1``)."""
    t, m = cfg.train, cfg.model
    for what, tokens in (
        ("train.batch_size x model.block_size", t.batch_size * m.block_size),
        (
            "train.eval_batches x train.batch_size x model.block_size",
            t.eval_batches * t.batch_size * m.block_size,
        ),
    ):
        if tokens > MAX_TOKENS:
            raise ConfigError(
                f"{what} is {tokens:.3g} tokens, more than any machine trains on at once (at most "
                f"{MAX_TOKENS:.3g}); make them smaller."
            )
    if m.name == "gpt" and m.kwargs:
        raise ConfigError(
            f"model.kwargs ({shown(', '.join(map(str, m.kwargs)))}) goes to an 'import:' or 'hf:' model; "
            "the built-in GPT is set by model.n_layer, n_embd, n_head, block_size, dropout and mlp_ratio."
        )
    params = m.n_layer * (4 + 2 * m.mlp_ratio) * m.n_embd**2 + (256 + m.block_size) * m.n_embd
    if m.name == "gpt" and params > MAX_PARAMETERS:
        raise ConfigError(
            f"a built-in GPT with model.n_layer = {m.n_layer}, n_embd = {m.n_embd} and mlp_ratio = "
            f"{m.mlp_ratio} has {params:.3g} parameters, more than any machine holds (at most "
            f"{MAX_PARAMETERS:.3g}); make it smaller."
        )


def is_every(value: str) -> bool:
    """Whether ``value`` is ``every:K`` with K an ASCII integer >= 1."""
    head, _, tail = value.partition(":")
    return head == "every" and re.fullmatch(r"[0-9]{1,9}", tail) is not None and int(tail) >= 1


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against the field type; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _table(key, tp, value)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(key, arg, value)
            except ConfigError:
                continue
        raise ConfigError(f"{key} must be {tp}, got {shown(value)}.")
    if origin is typing.Literal:  # which names: the rules below say, naming them all
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {shown(value)} ({type(value).__name__}).")
        return value
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
        # ValueError: an integer of more than 4300 digits; KeyError: text that is a
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
    elif section == "model" and name.startswith("lora."):
        lora = tree[section].setdefault("lora", {})
        if not isinstance(lora, dict):
            raise ConfigError(f"model.lora is {shown(lora)}, not a table, so --set {key}=... cannot set it.")
        lora[name.split(".", 1)[1]] = value
    else:
        tree[section][name] = value


def _budget_text(value: Any) -> Any:
    """A budget given as a number of bytes (``budget = 2000000``) becomes its text."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"memory.budget must be a finite number of bytes, got {shown(value)}.")
    return str(value) if isinstance(value, int) else format(value, "f")


def _table(where: str, cls: Any, values: Any) -> Any:
    """One section (or nested table, ``model.lora``) built from its values, each key checked."""
    if not isinstance(values, dict):
        raise ConfigError(f"config section {shown(where)} must be a table, got {shown(values)}.")
    field_types = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in values.items():
        key = f"{where}.{name}"
        if name not in field_types:
            valid = [f"{where}.{n}" for n in field_types]
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {shown(close[0])}?)" if close else f"; valid keys: {', '.join(valid)}"
            raise ConfigError(f"unknown config key {shown(key)}{hint}.")
        if key == "memory.budget":
            value = _budget_text(value)
        kwargs[name] = _coerce(key, field_types[name], value)
    return cls(**kwargs)


def _build(tree: dict[str, Any]) -> Config:
    sections = {f.name: f for f in dataclasses.fields(Config)}
    hints = typing.get_type_hints(Config)
    built: dict[str, Any] = {}
    for section, values in tree.items():
        if section not in sections:
            close = difflib.get_close_matches(section, list(sections), n=1)
            hint = f" (did you mean {shown(close[0])}?)" if close else f"; sections are {', '.join(sections)}"
            raise ConfigError(f"unknown config section {shown(section)}{hint}.")
        built[section] = _table(section, hints[section], values)
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
        # ValueError is TOMLDecodeError, or an integer of more than 4300 digits
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
