"""What a lever set's bytes rest on, counted and measured: :func:`lever_facts`.

Parameter counts per part are read from the model (exact). The temporaries of one
parameter's optimizer step are measured once per optimizer kind on a parameter of its own
(:data:`PROBE_NUMEL` elements, MemTracker, the step run eagerly as under every memfit
tracker) and kept per element: a fused step (:mod:`memfit.levers.fused`) holds one
parameter's step temporaries inside the backward, and torchao steps one parameter at a time.

Trade-off: the per-element cost is measured on one size and scaled linearly; torchao's
block-wise (de)quantization allocates in proportion to the elements, so the error is the
few fixed-size buffers (at most a few KiB).

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(64, 64)
    >>> facts = lever_facts(lin, torch.optim.AdamW(lin.parameters()), [], kinds=["orig"])
    >>> facts.params, facts.optimizer, facts.step_temp_per_element["orig/fp32"] > 0
    ({'': [4096, 64]}, 'AdamW', True)
    >>> facts.step_seconds_per_element["orig/fp32"] > 0
    True
"""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.applying.frozen import FROZEN_BF16, FROZEN_NF4
from memfit.applying.offload import OFFLOAD
from memfit.applying.tiled_mlp import TILED_MLP
from memfit.applying.weights_bf16 import WEIGHTS_BF16
from memfit.checkpointing.compile import eager
from memfit.devices import model_device, unwrap
from memfit.levers.frozen import (
    NF4_BLOCK,
    NF4_SCALER_BLOCK,
    FrozenSaved,
    cast_frozen,
    frozen_params,
    is_nf4,
    nf4_available,
    nf4_linears,
    quantize_frozen,
    restore_frozen,
    to_nf4,
)
from memfit.levers.head import (
    HeadSpec,
    chunked_head_of,
    chunked_head_on,
    find_head,
    install_chunked_head,
    remove_chunked_head,
)
from memfit.levers.loss_head import default_chunk_tokens, linear_cross_entropy, plain_cross_entropy
from memfit.levers.needs import torchao_available
from memfit.levers.optim import lever_optimizer, step_runs_eagerly
from memfit.levers.weights import cast_weights, restore_weights, weights_dtype
from memfit.measuring.long_context import attach_tiled_floor, host_link_facts, tiled_mlp_facts
from memfit.measuring.tracker import MemoryWatch, PhaseTracker
from memfit.models.gpt import gpt_loss
from memfit.precision import Precision
from memfit.records import HeadCost, HeadFacts, LeverFacts, Profile
from memfit.records.lever_facts import FrozenFacts
from memfit.stepmodel.head_chunks import chunk_ladder
from memfit.stepmodel.state_bytes import temp_key
from memfit.vocab import WEIGHTS

__all__ = [
    "PROBE_NUMEL",
    "attach_lever_facts",
    "frozen_facts",
    "head_cost",
    "head_facts",
    "lever_facts",
    "step_temp_per_element",
    "weights_saved_delta",
]

#: Elements of the parameter an optimizer kind's step temporaries are measured on (one eager
#: slice of the step, :data:`memfit.stepmodel.state_bytes.EAGER_STEP_SLICE_ELEMENTS`).
PROBE_NUMEL = 65536
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _family(optimizer: torch.optim.Optimizer | None) -> str:
    if optimizer is None:
        return "none"
    return str(getattr(optimizer, "memfit_family", type(optimizer).__name__))


def _probe_optimizer(
    optimizer: torch.optim.Optimizer | None, param: nn.Parameter, kind: str, weights: str
) -> torch.optim.Optimizer:
    """An optimizer like ``optimizer`` (its defaults) over ``param`` alone, of state ``kind``."""
    defaults = dict(optimizer.defaults) if optimizer is not None else {}
    cls: type[torch.optim.Optimizer] = torch.optim.AdamW
    if optimizer is not None and not hasattr(optimizer, "memfit_state"):
        cls = type(optimizer)
    if optimizer is not None and hasattr(optimizer, "memfit_state"):
        defaults = {k: v for k, v in defaults.items() if k != "bf16_stochastic_round"}
        defaults["lr"] = float(defaults["lr"])
    if kind == "orig":
        takes = inspect.signature(cls.__init__).parameters
        return cls([param], **{k: v for k, v in defaults.items() if k in takes})
    base = torch.optim.AdamW([param], **_adam(defaults))
    return lever_optimizer(base, kind, weights_bf16=weights == "bf16")


def _adam(defaults: dict[str, Any]) -> dict[str, Any]:
    keys = ("lr", "betas", "eps", "weight_decay", "amsgrad")
    return {k: defaults[k] for k in keys if k in defaults}


def step_temp_per_element(
    optimizer: torch.optim.Optimizer | None, kind: str, weights: str, numel: int = PROBE_NUMEL
) -> tuple[float, float]:
    """Bytes and seconds per element of a single parameter's optimizer step: the bytes it holds
    beyond the parameter, its gradient and its state, and the median time of 3 steps (both
    measured eagerly; ``kind`` ``orig`` is ``optimizer``'s own class)."""
    torch.manual_seed(0)
    holder = nn.Module()
    holder.p = nn.Parameter(torch.zeros(numel, dtype=_DTYPES[weights]))
    opt = _probe_optimizer(optimizer, holder.p, kind, weights)
    # See Note [compiled code runs eagerly when tracked]; here the compile would also cost
    # more than the measurement.
    with eager():
        holder.p.grad = torch.randn_like(holder.p) * 1e-3
        opt.step()  # creates the state
        holder.p.grad = torch.randn_like(holder.p) * 1e-3
        with MemoryWatch(holder, opt) as watch:
            opt.step()
        times = []
        for _ in range(3):
            started = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - started)
    held = sum(watch.breakdown.get(k, 0) for k in ("params", "grads"))
    state = 0
    for per in opt.state.values():
        for v in per.values():
            if isinstance(v, torch.Tensor):
                state += _nbytes(v)
    return max(0, watch.peak_bytes - held - state) / numel, statistics.median(times) / numel


def _nbytes(t: torch.Tensor) -> int:
    inner = getattr(t, "__tensor_flatten__", None)
    if inner is not None:
        names, _ = inner()
        return sum(_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def lever_facts(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    blocks: Sequence[str],
    kinds: Sequence[str] = ("orig", "fp32", "bf16", "8bit", "4bit"),
) -> LeverFacts:
    """Parameter counts per part of ``model`` and the step temporaries of each kind asked for.

    Kinds that need torchao are skipped when it is missing (their levers are refused anyway).
    """
    owner: dict[int, str] = {}
    for name in blocks:
        for p in model.get_submodule(name).parameters():
            owner.setdefault(id(p), name)
    params: dict[str, list[int]] = {}
    frozen = other = 0
    seen: set[int] = set()
    floats = [p for p in model.parameters() if p.is_floating_point()]
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if not p.is_floating_point():
            other += p.numel() * p.element_size()
        elif p.requires_grad:
            params.setdefault(owner.get(id(p), ""), []).append(p.numel())
        else:
            frozen += p.numel()
    other += sum(b.numel() * b.element_size() for b in model.buffers())
    weights = weights_dtype(model)
    temps: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for kind in kinds:
        if kind != "orig" and (not torchao_available() or _family(optimizer) not in ("Adam", "AdamW")):
            continue
        if kind == "orig" and optimizer is None:
            continue
        for w in WEIGHTS:
            if kind == "orig" and w != weights:
                continue
            temps[temp_key(kind, w)], seconds[temp_key(kind, w)] = step_temp_per_element(optimizer, kind, w)
    amsgrad = bool(optimizer is not None and optimizer.defaults.get("amsgrad", False))
    return LeverFacts(
        params=params,
        frozen_numel=frozen,
        other_bytes=other,
        weight_bytes=floats[0].element_size() if floats else 4,
        amsgrad=amsgrad,
        optimizer=_family(optimizer),
        step_eager=step_runs_eagerly(training=True),
        step_temp_per_element=temps,
        step_seconds_per_element=seconds,
    )


# Note [the head measured alone]
# The chunked head's bytes are predicted, not measured on the whole step: the head (the
# model's own Linear, scale and soft-cap) runs alone on hidden states of the step's shape,
# plain and chunked, under MemTracker, and the differences replace the plain head's part of
# the outside's numbers (memfit.applying.chunked_loss). The step's shape comes from one
# forward of the loss function under no_grad, stopped where the head is called. Every byte
# of both heads is linear in the tokens (logits, their fp32 copies, softmax and gradients:
# tokens x vocab; hidden-state gradients: tokens x hidden; chunks and the weight's gradient:
# constant), so above 4 chunks the head is measured at 2 and 4 chunks of tokens and
# extrapolated: a 150k-vocabulary head is never made whole to be measured. The peak is a
# maximum of such lines, one per moment, and the moment moves: on Llama 3's head (4,096 x
# 128,256) 130 and 260 tokens peak where the weight's gradient is made, 12,288 tokens where
# the fp32 logits, their log-softmax and its gradient are alive, so a line through the two
# peaks under-predicts the long head 6x. The plain head runs the same operations at every
# length, so the bytes after each operation are extrapolated one by one and the peak taken
# over them: exact (tests/test_head_at_length.py). The chunked head runs one more chunk per
# chunk of tokens; its line through the peaks is kept (its long-run bytes are the hidden
# states' gradient, one line). The probe is made as the head is: a frozen head (LoRA) makes
# no weight gradient, and the plain head keeps its head's-dtype logits beside their fp32
# copy, as the models' forward does. The chunked head is measured at two chunk sizes, the
# default and the planner's smallest.


class _Stop(Exception):
    """Raised at the head's input to end the shape-finding forward there."""


def _step_shape(
    model: nn.Module, spec: HeadSpec, batch: Any, loss_fn: Callable[..., Any], precision: str
) -> tuple[torch.Size, torch.dtype, bool] | None:
    """The head input's shape and dtype in one step, and whether the loss went through the
    model's own loss (``labels=`` / ``targets=``); None when the head was not reached."""
    seen: dict[str, Any] = {}

    def top(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        seen.setdefault("labels", kwargs.get("labels", kwargs.get("targets")) is not None)

    def head(module: nn.Module, args: Any) -> None:
        seen["hidden"] = args[0]
        raise _Stop

    hooks = [
        unwrap(model).register_forward_pre_hook(top, with_kwargs=True),
        spec.head.register_forward_pre_hook(head),
    ]
    chunk = chunked_head_of(model)
    remove_chunked_head(model)  # the plain head is the one called
    try:
        with torch.no_grad(), Precision(precision, spec.head.weight.device).autocast():  # type: ignore[arg-type]
            loss_fn(model, batch)
    except _Stop:
        pass
    finally:
        for h in hooks:
            h.remove()
        if chunk is not None:
            install_chunked_head(model, chunk)
    if "hidden" not in seen:
        return None
    hidden = seen["hidden"]
    # memfit's gpt_loss takes the model's own loss once the lever is on
    # (See Note [the built-in loss outside the forward])
    own = loss_fn is gpt_loss and hasattr(unwrap(model), "loss_chunk_tokens")
    return hidden.shape, hidden.dtype, own or bool(seen.get("labels"))


def head_cost(spec: HeadSpec, tokens: int, dtype: torch.dtype, precision: str, chunk: int | None) -> HeadCost:
    """MemTracker's bytes of the head alone on ``tokens`` hidden states (``chunk`` None: plain)."""
    return _head_run(spec, tokens, dtype, precision, chunk)[0]


def _head_run(
    spec: HeadSpec, tokens: int, dtype: torch.dtype, precision: str, chunk: int | None
) -> tuple[HeadCost, list[tuple[str, int]]]:
    """:func:`head_cost` and the bytes above the start after every operation, by phase."""
    w = spec.head.weight
    probe = nn.Linear(w.shape[1], w.shape[0], bias=spec.head.bias is not None, device=w.device, dtype=w.dtype)
    for mine, theirs in ((probe.weight, w), (probe.bias, spec.head.bias)):
        if mine is not None and theirs is not None:
            mine.requires_grad_(theirs.requires_grad)  # a frozen head makes no weight gradient
    torch.manual_seed(0)
    h0 = torch.randn(tokens, w.shape[1], device=w.device, dtype=dtype, requires_grad=True)
    y = torch.randint(0, w.shape[0], (tokens,), device=w.device)
    scale, cap = spec.logit_scale, spec.softcap
    tracker = PhaseTracker(w.device, {}, {})
    tracker.track_external(probe)
    with eager(), tracker:
        with Precision(precision, w.device).autocast():  # type: ignore[arg-type]
            h = h0 * 1.0
            tracker.enter_phase("head forward")
            start = tracker.total()
            tracker.timeline = []
            if chunk is None:
                loss = plain_cross_entropy(h, probe.weight, y, probe.bias, logit_scale=scale, softcap=cap)
            else:
                loss = linear_cross_entropy(
                    h, probe.weight, y, probe.bias, logit_scale=scale, softcap=cap, chunk_tokens=chunk
                )
            del h
            kept = tracker.total()
        tracker.enter_phase("head backward")
        loss.backward()
    peaks, line = tracker.phase_peak, [(phase, total - start) for phase, total in tracker.timeline]
    return HeadCost(kept - start, peaks["head forward"] - start, peaks["head backward"] - start), line


def _at_tokens(
    spec: HeadSpec, tokens: int, dtype: torch.dtype, precision: str, chunk: int | None, unit: int
) -> HeadCost:
    """:func:`head_cost` at ``tokens``; above 4 ``unit`` extrapolated from 2 and 4 of them
    (Note [the head measured alone])."""
    if tokens <= 4 * unit:
        return head_cost(spec, tokens, dtype, precision, chunk)
    (a, line_a), (b, line_b) = (_head_run(spec, n * unit, dtype, precision, chunk) for n in (2, 4))
    f = (tokens - 2 * unit) / (2 * unit)
    ends = ((c.saved_bytes, c.forward_peak_bytes, c.backward_peak_bytes) for c in (a, b))
    chord = HeadCost(*(round(x + (y - x) * f) for x, y in zip(*ends, strict=True)))
    if [p for p, _ in line_a] != [p for p, _ in line_b]:
        return chord  # the chunked head: a different number of chunks at 2 and 4 units
    # the plain head runs the same operations at every length: each moment's bytes is a line
    # in the tokens, extrapolated by itself (the peak may move to another moment)
    peaks = {"head forward": 0, "head backward": 0}
    for (phase, x), (_, y) in zip(line_a, line_b, strict=True):
        peaks[phase] = max(peaks[phase], round(x + (y - x) * f))
    return HeadCost(chord.saved_bytes, peaks["head forward"], peaks["head backward"])


def head_facts(model: nn.Module, batch: Any, loss_fn: Callable[..., Any], precision: str) -> HeadFacts | None:
    """The loss head of one step of ``loss_fn(model, batch)``, plain and chunked; None when the
    model has no head the ``chunked_loss`` lever knows (:func:`memfit.levers.head.head_refusal`)."""
    spec = find_head(model)
    if spec is None:
        return None
    shape = _step_shape(model, spec, batch, loss_fn, precision)
    if shape is None:
        return HeadFacts(
            refused="the loss function never called the model's head, so chunked_loss has nothing to chunk."
        )
    size, dtype, through = shape
    tokens, (vocab, hidden) = size[:-1].numel(), spec.head.weight.shape
    chunk = default_chunk_tokens(vocab)
    facts = HeadFacts(tokens=tokens, hidden=hidden, vocab=vocab, chunk_tokens=chunk)
    if not through:
        facts.refused = (
            "the loss function computes the loss from the model's logits itself; chunked_loss chunks the "
            "model's own loss: call the model with labels= (Hugging Face) or use memfit's gpt_loss."
        )
        return facts
    facts.plain = _at_tokens(spec, tokens, dtype, precision, None, chunk)
    facts.chunked = _at_tokens(spec, tokens, dtype, precision, chunk, chunk)
    # the ladder's ends, which every chunk size between is predicted from
    # (See Note [the head's bytes are affine in the chunk])
    facts.default_chunk_tokens, facts.default_cost = min(chunk, tokens), facts.chunked
    small = chunk_ladder(facts.default_chunk_tokens)[-1]
    if small < facts.default_chunk_tokens:
        facts.small_chunk_tokens = small
        facts.small_cost = _at_tokens(spec, tokens, dtype, precision, small, small)
    facts.weight_grad_bytes = vocab * hidden * 4 if spec.head.weight.requires_grad else 0
    return facts


# Note [the frozen weights measured]
# What the frozen levers change is counted or measured, never assumed: the frozen elements
# are counted on the model; NF4's bytes are those of two converted probe weights (linear in
# the elements, so exact for every weight 64 x 256 divides); the temporaries of one NF4
# Linear's forward and backward (torchao dequantizes the whole weight, then casts it to the
# input's dtype) are measured per element on a probe under MemTracker; and what autograd
# saves changes (under autocast a frozen fp32 weight's bf16 cast is saved by every matmul
# whose input needs a gradient, a bf16 or NF4 weight saves nothing; a bf16 embedding makes
# bf16 activations), so one forward of the step is run with each frozen lever set applied
# and the saved bytes per part are compared with the model's own (mode none; the
# checkpointed modes keep their measured numbers, an upper bound).

#: Elements of the NF4 probe weights (a multiple of 64 x 256).
_NF4_PROBE = 2 * NF4_BLOCK * NF4_SCALER_BLOCK
_FROZEN_LEVERS = {FROZEN_BF16.name: FROZEN_BF16, FROZEN_NF4.name: FROZEN_NF4}
_FROZEN_SETS = (("frozen_bf16",), ("frozen_nf4",), ("frozen_bf16", "frozen_nf4"))


def _nf4_probe_temps(device: torch.device, precision: str) -> tuple[float, float]:
    """Forward and backward temporaries of one NF4 Linear per weight element (the larger of
    fp32 and bf16 inputs), above its input and output."""
    torch.manual_seed(0)
    weight = to_nf4(torch.randn(2 * NF4_SCALER_BLOCK, _NF4_PROBE // (2 * NF4_SCALER_BLOCK), device=device))
    forward = backward = 0
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4, weight.shape[1], device=device, dtype=dtype, requires_grad=True)
        tracker = PhaseTracker(device, {}, {})
        with eager(), tracker:
            with Precision(precision, device).autocast():  # type: ignore[arg-type]
                tracker.enter_phase("nf4 forward")
                start = tracker.total()
                y = F.linear(x, weight)
                out = tracker.total() - start
            tracker.enter_phase("nf4 backward")
            y.sum().backward()
        forward = max(forward, tracker.phase_peak["nf4 forward"] - start - out)
        backward = max(backward, tracker.phase_peak["nf4 backward"] - start - 2 * out)
    return forward / _NF4_PROBE, backward / _NF4_PROBE


def _nf4_bytes(numels: list[int], device: torch.device) -> int:
    """Bytes of weights of ``numels`` elements in NF4, from two converted probes."""
    rows = 2 * NF4_SCALER_BLOCK
    a, b = (_nbytes(to_nf4(torch.zeros(rows, k * _NF4_PROBE // rows, device=device))) for k in (1, 2))
    return sum(a + (b - a) * (n - _NF4_PROBE) // _NF4_PROBE for n in numels)


def _saved_by_part(
    model: nn.Module, blocks: Sequence[str], step: tuple[Any, Callable[..., Any]], precision: str
) -> dict[str, int]:
    """Bytes autograd saves in one forward of ``step``, per part (parameters not counted)."""
    device = next(model.parameters()).device
    held = {_ptr(p) for p in model.parameters() if not is_nf4(p)}
    seen: set[int] = set()
    by_part: dict[str, int] = {}
    where = [""]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not is_nf4(t) and t.device == device and _ptr(t) not in held and _ptr(t) not in seen:
            seen.add(_ptr(t))
            by_part[where[-1]] = by_part.get(where[-1], 0) + t.untyped_storage().nbytes()
        return t

    def enter(name: str) -> Callable[..., None]:
        return lambda module, args: where.append(name)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        where.pop()

    hooks = []
    for name in blocks:
        module = model.get_submodule(name)
        hooks += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave)]
    try:
        hooked = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with torch.enable_grad(), hooked, Precision(precision, device).autocast():  # type: ignore[arg-type]
            loss = step[1](model, step[0])
        del loss
    finally:
        for h in hooks:
            h.remove()
    return by_part


def _ptr(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def frozen_facts(
    model: nn.Module, blocks: Sequence[str], step: tuple[Any, Callable[..., Any]] | None, precision: str
) -> FrozenFacts | None:
    """The frozen weights' facts of ``model`` (Note [the frozen weights measured]); None when
    it has no frozen floating weights. Without ``step`` (or torchao) only the counts."""
    frozen = frozen_params(model)
    if not frozen:
        return None
    device = frozen[0].device
    owner = {id(p): name for name in reversed(blocks) for p in model.get_submodule(name).parameters()}
    facts = FrozenFacts(numel=sum(p.numel() for p in frozen), held_bytes=sum(_nbytes(p) for p in frozen))
    for _, lin in nf4_linears(model) if nf4_available() else []:
        facts.nf4.setdefault(owner.get(id(lin.weight), ""), []).append(lin.weight.numel())
    if facts.nf4:
        facts.nf4_bytes = _nf4_bytes([n for ns in facts.nf4.values() for n in ns], device)
    if facts.nf4 and FROZEN_NF4.runs_at(precision):  # frozen_nf4's precisions are the lever's
        fwd, bwd = _nf4_probe_temps(device, precision)
        facts.nf4_forward_temp_per_element, facts.nf4_backward_temp_per_element = fwd, bwd
    if step is None or not FROZEN_NF4.runs_at(precision):
        return facts
    plain = _saved_by_part(model, blocks, step, precision)
    # the NF4 weights made once: frozen_nf4, then frozen_bf16 on top; then frozen_bf16 alone
    passes = [_FROZEN_SETS[1:], _FROZEN_SETS[:1]] if facts.nf4 else [_FROZEN_SETS[:1]]
    # a set with a lever that does not run at this precision is never predicted at it (frozen_bf16
    # at fp32: its forwards would run the bf16 weights, 20x slower on a CPU without bf16 units)
    runs = [[s for s in sets if all(_FROZEN_LEVERS[n].runs_at(precision) for n in s)] for sets in passes]
    for sets in runs:
        saved = FrozenSaved()
        try:
            for levers in sets:
                if "frozen_nf4" in levers:
                    quantize_frozen(model, None, saved)
                if "frozen_bf16" in levers:
                    cast_frozen(model, saved)
                now = _saved_by_part(model, blocks, step, precision)
                facts.saved_delta[",".join(levers)] = {
                    part: now.get(part, 0) - plain.get(part, 0) for part in {*plain, *now}
                }
        finally:
            restore_frozen(saved)
    return facts


# Note [the weights measured in bf16]
# Under bf16 autocast every matmul whose input needs a gradient saves the bf16 cast of its
# fp32 weight; with bf16 weights (the weights_bf16 lever) it saves the weight itself, a
# parameter. The difference is measured, not assumed: one forward of the step with the
# weights cast to bf16 and one as they are, autograd's saved bytes compared per part.


def weights_saved_delta(
    model: nn.Module, blocks: Sequence[str], step: tuple[Any, Callable[..., Any]], precision: str
) -> dict[str, int]:
    """Per part: the bytes autograd saves in one forward of ``step`` with bf16 weights minus
    with the weights as they are (Note [the weights measured in bf16]); empty unless the
    precision is bf16 and the weights are not."""
    if not WEIGHTS_BF16.runs_at(precision) or weights_dtype(model) == "bf16":
        return {}
    plain = _saved_by_part(model, blocks, step, precision)
    saved = cast_weights(model)
    try:
        now = _saved_by_part(model, blocks, step, precision)
    finally:
        restore_weights(saved)
    return {part: now.get(part, 0) - plain.get(part, 0) for part in {*plain, *now}}


# Note [the step's forwards with the head in chunks]
# The frozen weights' and bf16 weights' facts run whole forwards of the step (autograd's
# saved bytes per part). Where the plain step does not fit (a long sequence's plan), such a
# forward with the plain loss head holds its logits and their log-softmax: at 37k tokens of
# a 32k vocabulary 9.6 GB, for a plan of 512 MiB (a LoRA search's answer was killed for it).
# There, when chunked_loss may be used, they run with the head in chunks: the blocks' and
# the stem's saved bytes are the same, and the head's part loses what only the plain head
# saves under a lever (under bf16 autocast, a frozen fp32 head weight's bf16 cast, which
# frozen_bf16 removes): a set with frozen_bf16 and without chunked_loss is then predicted
# up to that cast (vocabulary x hidden x 2 bytes) over, the safe side.


def attach_lever_facts(
    profile: Profile,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    blocks: Sequence[str],
    step: tuple[Any, Callable[..., Any]] | None = None,
    levers: Sequence[str] = (),
    head_chunked: bool = False,
    head: HeadFacts | None = None,
) -> Profile:
    """Set ``profile.lever_facts`` and ``profile.weights`` from ``model`` (returns ``profile``);
    with ``step=(batch, loss_fn)`` also the loss head's (:func:`head_facts`), and with
    ``tiled_mlp`` among ``levers`` one MLP's, plain and tiled
    (:func:`memfit.measuring.long_context.tiled_mlp_facts`: a few runs of one MLP, measured
    only where the lever may be chosen), and with ``offload`` the host link's speeds
    (:func:`memfit.measuring.long_context.host_link_facts`). ``head_chunked``: the step's
    forwards run with the loss head in chunks
    (See Note [the step's forwards with the head in chunks]). ``head``: the head's facts where
    they were measured already (for this step and precision)."""
    profile.lever_facts = lever_facts(model, optimizer, blocks)
    if step is not None:
        profile.lever_facts.head = head or head_facts(model, step[0], step[1], profile.precision)
    if step is not None and TILED_MLP.name in levers:
        profile.lever_facts.tiled_mlp = tiled_mlp_facts(model, step[0], step[1], profile.precision)
        attach_tiled_floor(profile, model, optimizer, blocks, step)
    if OFFLOAD.name in levers:
        profile.lever_facts.host_link = host_link_facts(model_device(model))
    # See Note [the step's forwards with the head in chunks]
    with chunked_head_on(model) if head_chunked and step is not None else nullcontext():
        profile.lever_facts.frozen = frozen_facts(model, blocks, step, profile.precision)
        if step is not None:
            delta = weights_saved_delta(model, blocks, step, profile.precision)
            profile.lever_facts.weights_saved_delta = delta
    profile.weights = weights_dtype(model)
    return profile
