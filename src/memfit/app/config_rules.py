"""The rules a run configuration must follow, checked when a :class:`memfit.app.config.Config` is built.

Every value that would fail later (in torch, numpy or the data loader) is refused here,
before any work, with one sentence that names the key and what it accepts.

Example:
    >>> from memfit.app.config import load_config
    >>> load_config(None, ["optimizer.lr=nan"])
    Traceback (most recent call last):
    ...
    memfit.errors.ConfigError: optimizer.lr must be a finite number above 0, got nan.
"""

from __future__ import annotations

import math
import re
from typing import Any

from memfit.budget import Budget
from memfit.errors import ConfigError, shown
from memfit.vocab import CHECKPOINT_MODES, PRECISION_CHOICES

__all__ = ["MAX_PARAMETERS", "MAX_SEED", "MAX_TOKENS", "is_every", "validate_config"]

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


def validate_config(cfg: Any) -> None:
    """Refuse values and combinations that cannot run, with one sentence naming the fix.

    ``cfg`` is a :class:`memfit.app.config.Config` (not imported here: config imports this module).

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
    if cfg.optimizer.schedule not in ("constant", "cosine"):
        raise ConfigError(
            f"optimizer.schedule {shown(cfg.optimizer.schedule)} is not one of constant, cosine."
        )
    _memory(cfg.memory)
    if cfg.model.name != "gpt" and not cfg.model.name.startswith(("import:", "hf:")):
        raise ConfigError(
            f"model.name {shown(cfg.model.name)} is not 'gpt', 'hf:NAME' (e.g. hf:gpt2) or "
            "'import:package.module:factory'."
        )
    if cfg.train.distributed not in ("none", "ddp", "fsdp2"):
        raise ConfigError(f"train.distributed {shown(cfg.train.distributed)} is not one of none, ddp, fsdp2.")
    if not _DEVICE.match(cfg.train.device):
        raise ConfigError(
            f"train.device {shown(cfg.train.device)} is not one of auto, cpu, cuda, cuda:N, mps."
        )
    if not cfg.train.out.strip():
        raise ConfigError("train.out is empty; give the directory to write the run to.")
    _sizes(cfg)


def _memory(mem: Any) -> None:
    """The ``[memory]`` section's rules (checkpointing, budget, precision, overflow guard)."""
    ckpt = mem.checkpointing
    if ckpt not in (*CHECKPOINT_MODES, "auto") and not is_every(ckpt):
        raise ConfigError(
            f"memory.checkpointing {shown(ckpt)} is not one of {', '.join(CHECKPOINT_MODES)}, every:K, auto."
        )
    if ckpt == "auto" and not mem.budget:
        raise ConfigError('memory.checkpointing = "auto" needs memory.budget, e.g. "60%" or "2GiB".')
    if mem.budget:
        # NOTE: only the syntax is checked here; a percentage is resolved against the
        # baseline peak once that is measured.
        Budget.parse(mem.budget, what="memory.budget")
    if mem.precision not in PRECISION_CHOICES:
        raise ConfigError(
            f"memory.precision {shown(mem.precision)} is not one of {', '.join(PRECISION_CHOICES)}."
        )
    if mem.on_overflow not in ("stop", "fallback"):
        raise ConfigError(f"memory.on_overflow {shown(mem.on_overflow)} is not one of stop, fallback.")


#: More tokens than any step (or evaluation) trains on: batch_size x block_size.
MAX_TOKENS = 2**28
#: More parameters than any machine holds (4 TiB in fp32).
MAX_PARAMETERS = 2**40


def _sizes(cfg: Any) -> None:
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
