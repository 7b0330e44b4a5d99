"""The optimizer a lever set trains with: torchao's low-precision AdamW, same hyper-parameters.

``state_8bit`` and ``state_4bit`` use torchao's ``AdamW8bit`` / ``AdamW4bit`` (``Adam*`` for
``torch.optim.Adam``): block-wise quantized moments, each tensor of at least 4096 values
(a multiple of the block size) in 8 or 4 bits, smaller ones at the parameter's dtype, as
bitsandbytes does. ``state_bf16`` keeps both moments in bf16, and ``weights_bf16`` without a
state lever keeps them in fp32: both run torchao's same single-parameter AdamW step (it
computes in fp32 and writes back into whatever dtype the state has).

Compensation for bf16 weights: **stochastic rounding** (torchao's ``bf16_stochastic_round``),
not a Kahan buffer. Rounded to nearest, an update smaller than half a bf16 ulp of the weight
(2^-9 relative) is lost every step; rounded stochastically it lands with the right
probability, so updates are kept in expectation, for 0 extra bytes, where a Kahan buffer
costs 2 more bytes per parameter (the 6-bytes-per-parameter goal would not leave room).

Trade-off: torchao's step is ``torch.compile(fullgraph=True)``, which cannot run inside
MemTracker's dispatch mode; memfit's trackers run it eagerly (``force_eager``), as it runs
where dynamo is off (``TORCHDYNAMO_DISABLE=1``). The eager step holds every intermediate, so
it steps in slices of at most 65,536 elements (more launches: slower on a GPU); the compiled
one in slices of :data:`memfit.stepmodel.state_bytes.STEP_SLICE_ELEMENTS`
(Note [the step in slices], Note [pricing the step that runs]).

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(64, 64)
    >>> opt = lever_optimizer(torch.optim.AdamW(lin.parameters(), lr=0.01), "8bit", weights_bf16=False)
    >>> type(opt).__name__, opt.param_groups[0]["weight_decay"]
    ('MemfitAdamW8bit', 0.01)
    >>> from memfit.stepmodel.state_bytes import state_bytes
    >>> state_bytes(65536, 4, "8bit")  # codes + block scales + two 256-entry maps + the step count
    135172
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from memfit import progress
from memfit.errors import LeverRefused
from memfit.levers.needs import ADAM_LIKE, torchao_available
from memfit.levers.quiet import import_torchao, quiet_dependencies
from memfit.stepmodel import state_bytes
from memfit.vocab import WEIGHTS

__all__ = ["is_lever_optimizer", "lever_optimizer", "step_runs_eagerly"]

_BLOCK = ("8bit", "4bit")
#: torch.optim flags torchao's optimizers do not take (memfit drops the speed-only ones).
_DROPPED = ("foreach", "fused", "capturable", "differentiable", "maximize", "decoupled_weight_decay")


def is_lever_optimizer(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether ``optimizer`` was made by :func:`lever_optimizer`."""
    return optimizer is not None and hasattr(optimizer, "memfit_state")


def step_runs_eagerly(*, training: bool = False) -> bool:
    """Whether torchao's optimizer step runs eagerly here: dynamo is disabled
    (``TORCHDYNAMO_DISABLE=1`` or ``TORCH_COMPILE_DISABLE=1``) or, unless ``training``, under
    the ``force_eager`` stance memfit measures in (See Note [pricing the step that runs] in
    :mod:`memfit.stepmodel.state_bytes`).

    ``training=True`` asks how the step will run in training, where memfit's own measuring
    stance is not in force.

    Example:
        >>> import torch
        >>> with torch.compiler.set_stance("force_eager"):
        ...     step_runs_eagerly()
        True
    """
    # torch.compile returns the function itself under either variable (torch 2.13's eval_frame)
    if torch._dynamo.config.disable or os.environ.get("TORCHDYNAMO_DISABLE", "") == "1":
        return True
    if training:
        return False
    stance = getattr(getattr(torch._dynamo, "eval_frame", None), "_stance", None)
    return getattr(stance, "stance", "default") == "force_eager"


def _lr_as_tensor(optimizer: torch.optim.Optimizer) -> None:
    # torchao keeps the learning rate as a tensor (no recompile when it changes); a scheduler
    # or a user that writes a float is turned back into one here.
    for group in optimizer.param_groups:
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)


# Note [the step in slices]
# torchao's AdamW steps one parameter at a time, in fp32: for a 39M-element tied embedding
# (Qwen2's 152k x 256) the eager step holds about 24 bytes per element of fp32 temporaries,
# nearly 1 GB, more than the low-bit state saves. The update is elementwise, so stepping a
# parameter in slices of rows (views of the parameter, its gradient and its moments; torchao's
# quantized moments slice along their first dimension at block boundaries) gives the same
# numbers with one slice's temporaries. Sharded (DTensor) parameters step whole. The slice
# is smaller when the step runs eagerly (See Note [pricing the step that runs] in
# memfit.stepmodel.state_bytes).


def _slices(p: torch.Tensor, moments: list[Any]) -> list[tuple[int, int]]:
    """Row ranges of ``p`` to step one at a time (Note [the step in slices])."""
    size = state_bytes.step_slice_elements(step_runs_eagerly())
    sharded = getattr(p, "device_mesh", None) is not None  # a DTensor (FSDP2) steps whole
    if p.dim() == 0 or p.numel() <= size or sharded:
        return [(0, p.shape[0] if p.dim() else 0)]
    stride = p[0].numel()
    unit = 1
    for m in moments:
        block = getattr(m, "block_size", None)
        if block:
            unit = math.lcm(unit, block // math.gcd(block, stride))
    rows = max(unit, size // stride // unit * unit)
    return [(s, min(s + rows, p.shape[0])) for s in range(0, p.shape[0], rows)]


def _step_param(opt: Any, group: dict[str, Any], p: torch.Tensor) -> None:
    """One parameter's AdamW step with torchao's ``single_param_adam``, slice by slice."""
    from torchao.optim.adam import single_param_adam

    state = opt.state[p]
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = opt._new_buffer(p, True)
        state["exp_avg_sq"] = opt._new_buffer(p, False)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = opt._new_buffer(p, False)
    state["step"] += 1
    moments = [state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq")]
    fn = torch.compile(single_param_adam, fullgraph=True, dynamic=False)
    rounding = bool(opt.bf16_stochastic_round and p.dtype is torch.bfloat16)
    whole = p.detach()
    for a, b in _slices(p, moments):
        sl = slice(None) if p.dim() == 0 else slice(a, b)
        parts = [None if t is None else t[sl] for t in (whole, p.grad, *moments)]
        fn(parts[0], parts[1], state["step"], *parts[2:], group["lr"], group["betas"][0], group["betas"][1],
           group["weight_decay"], group["eps"], opt.is_adamw, rounding)  # fmt: skip


#: Optimizers whose step has run once (its compilation said so: :func:`_quietly`).
_COMPILED: weakref.WeakSet[Any] = weakref.WeakSet()


@contextlib.contextmanager
def _quietly(opt: Any) -> Iterator[None]:
    """torchao's step without its noise (:mod:`memfit.levers.quiet`) and, while the first one
    compiles (a minute on a CPU), a progress line that says so."""
    first = opt not in _COMPILED and not step_runs_eagerly()
    _COMPILED.add(opt)
    name = type(opt).__name__.removeprefix("Memfit")
    waiting = f"compiling torchao's {name} step for each parameter shape (slow only on the first step)"
    with quiet_dependencies(), progress.waiting(waiting) if first else contextlib.nullcontext():
        yield


def _sliced_step(opt: Any, closure: Any = None) -> Any:
    """torchao's ``step``, each large parameter in slices (Note [the step in slices])."""
    _lr_as_tensor(opt)
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    with _quietly(opt), torch.no_grad(), torch._dynamo.utils.disable_cache_limit():
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("torchao's AdamW does not take sparse gradients; use dense ones.")
                _step_param(opt, group, p)
    return loss


@functools.cache
def _classes() -> dict[tuple[str, bool], type[torch.optim.Optimizer]]:
    import_torchao()  # quietly: See memfit.levers.quiet
    from torchao.optim import Adam4bit, Adam8bit, AdamW4bit, AdamW8bit, _AdamW

    def make(base: type[Any], name: str) -> type[torch.optim.Optimizer]:
        def step(self: Any, closure: Any = None) -> Any:
            return _sliced_step(self, closure)

        def _new_buffer(self: Any, p: torch.Tensor, signed: bool) -> torch.Tensor:
            # bf16 or fp32 moments whatever the weights' dtype (torchao's _AdamW follows the weights)
            if self.memfit_state in WEIGHTS:  # moments kept as floats
                return torch.zeros_like(
                    p, dtype=torch.float32 if self.memfit_state == "fp32" else torch.bfloat16
                )
            return base._new_buffer(self, p, signed)

        def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
            # torch.optim casts loaded floating state to the parameter's dtype; moments kept
            # in bf16 go back to bf16 so a resumed run computes as the saved one did.
            base.load_state_dict(self, state_dict)
            if self.memfit_state == "bf16":
                for per in self.state.values():
                    for key, value in per.items():
                        if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                            per[key] = value.to(torch.bfloat16)

        methods = {"step": step, "_new_buffer": _new_buffer, "load_state_dict": load_state_dict}
        return type(name, (base,), {**methods, "__module__": __name__})

    return {
        ("8bit", True): make(AdamW8bit, "MemfitAdamW8bit"),
        ("8bit", False): make(Adam8bit, "MemfitAdam8bit"),
        ("4bit", True): make(AdamW4bit, "MemfitAdamW4bit"),
        ("4bit", False): make(Adam4bit, "MemfitAdam4bit"),
        ("float", True): make(_AdamW, "MemfitAdamW"),
    }


def _family(optimizer: torch.optim.Optimizer) -> str:
    return str(getattr(optimizer, "memfit_family", type(optimizer).__name__))


def _decoupled(optimizer: torch.optim.Optimizer) -> bool:
    if _family(optimizer) == "AdamW":
        return True
    return bool(optimizer.defaults.get("decoupled_weight_decay", False))


def lever_optimizer(
    optimizer: torch.optim.Optimizer, kind: str, *, weights_bf16: bool
) -> torch.optim.Optimizer:
    """A torchao AdamW over the same parameters, param groups and hyper-parameters as ``optimizer``.

    Args:
        optimizer: a torch.optim.Adam / AdamW (or one this function made) without state yet.
        kind: the moments' kind: ``fp32``, ``bf16``, ``8bit`` or ``4bit``.
        weights_bf16: the weights are (or will be) bf16: round them stochastically.

    Raises:
        LeverRefused: torchao is missing, the optimizer is not Adam-like, it asks for
            ``maximize``, or it already holds state (moments would be lost).
    """
    family = _family(optimizer)
    lever = "weights_bf16" if kind == "fp32" else f"state_{kind}"
    if not torchao_available():
        raise LeverRefused(
            f"{lever} needs torchao: `pip install 'memfit[levers]'` adds it; or leave {lever} out.", lever
        )
    if family not in ADAM_LIKE:
        raise LeverRefused(f"{lever} needs torch.optim.Adam or AdamW; the optimizer is {family}.", lever)
    if len(optimizer.state):
        raise LeverRefused(
            f"{lever} makes a new optimizer, but this one already holds state that would be lost; call "
            "memfit.prepare before the first step (resume loads its state afterwards).",
            lever,
        )
    groups = []
    for group in optimizer.param_groups:
        if group.get("maximize") or group.get("differentiable"):
            raise LeverRefused(f"{lever}: torchao's AdamW has no maximize or differentiable mode.", lever)
        g = {k: v for k, v in group.items() if k not in _DROPPED}
        g["params"] = list(group["params"])
        g["lr"] = float(g["lr"]) if isinstance(g["lr"], torch.Tensor) else g["lr"]
        groups.append(g)
    d = optimizer.defaults
    lr = float(d["lr"]) if isinstance(d["lr"], torch.Tensor) else d["lr"]
    common: dict[str, Any] = {
        "lr": lr,
        "betas": tuple(d["betas"]),
        "eps": d["eps"],
        "weight_decay": d["weight_decay"],
        "amsgrad": d.get("amsgrad", False),
        "bf16_stochastic_round": weights_bf16,
    }
    adamw = _decoupled(optimizer)
    if kind in _BLOCK:
        cls = _classes()[(kind, adamw)]
        new = cls(groups, **common)
    else:
        cls = _classes()[("float", True)]
        if not adamw:
            raise LeverRefused(f"{lever} with torch.optim.Adam is not supported; use AdamW.", lever)
        new = cls(groups, **common)
    new.memfit_state = kind  # type: ignore[attr-defined]
    new.memfit_family = family  # type: ignore[attr-defined]
    return new
