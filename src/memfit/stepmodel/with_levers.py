"""A profile's numbers under a lever set: exact state bytes, the fused step's gradients.

:func:`with_levers` turns a measured (or estimated) :class:`memfit.records.Profile` into
the profile of the same step with levers (:mod:`memfit.levers`), a pure function over
records: :func:`memfit.stepmodel.events` then reads it like any other (``fused_step`` in
``Profile.levers`` changes where gradients live).

- Optimizer state: exact bytes per parameter of each kind (:func:`state_bytes`: torchao's
  block-wise codes, scales and maps; the step counter); its step's temporaries from a
  measured per-element cost (:class:`memfit.records.LeverFacts`), for the largest slice
  of a parameter the step works on at once, as the step will run: eagerly or compiled
  (Note [pricing the step that runs]).
- ``fused_step``: gradients are freed as they complete; each part's backward holds instead
  its largest parameter's gradient and step temporaries (``Profile.lever_step_bytes``).
- Time: a state lever's optimizer step costs its measured seconds per element instead of the
  user's optimizer's (``Profile.step_seconds`` moves by the difference); the fused step adds
  no work without clipping (with clipping the last backward runs twice: not predicted).
- ``chunked_loss``: the loss head's part of the outside's numbers (forward and backward
  peaks, what it keeps) moves from the plain head's bytes to the chunked head's, both
  measured on the head alone at the step's shape (:class:`memfit.records.HeadFacts`; see
  Note [the head measured alone] in :mod:`memfit.measuring.lever_facts`); the chunked
  head's fp32 weight gradient, made in its forward, does not shrink with micro-batches, nor
  does one chunk's logits when the chunk is smaller than the step's tokens; at the chunk
  size the head facts name (:func:`memfit.stepmodel.head_chunks.at_chunk` moves it).
- ``weights_bf16``: exact when the profile was measured with bf16 weights; from an fp32
  profile (an estimate), parameters and gradients are halved and autocast's cached weight
  casts (held to the forward's end beyond what is saved) taken out, bf16 weights make none;
  what autograd saves (mode ``none``: the casts too) moves by the difference measured in one
  forward with bf16 weights (:attr:`memfit.records.LeverFacts.weights_saved_delta`), else is
  kept, an upper bound.
- ``frozen_bf16`` / ``frozen_nf4``: the frozen weights' bytes from their counts and NF4's
  measured bytes; what autograd saves moves by the measured difference (mode ``none``; the
  checkpointed modes keep theirs, an upper bound); every part's forward and backward peaks
  grow by its largest NF4 weight's measured dequantization temporaries
  (:class:`memfit.records.lever_facts.FrozenFacts`; See Note [the frozen weights measured]
  in :mod:`memfit.measuring.lever_facts`).

Example:
    >>> from memfit.records import BlockStats, LeverFacts, Profile
    >>> facts = LeverFacts(params={"b0": [8192], "": [4096]}, optimizer="AdamW",
    ...                    step_temp_per_element={"8bit/fp32": 8.0, "orig/fp32": 4.0})
    >>> blk = BlockStats("b0", param_bytes=32768, grad_bytes=32768, saved_bytes={"none": 100},
    ...                  backward_peak_bytes={"none": 32768 + 50})
    >>> prof = Profile("fp32", "cpu", 1, [blk], BlockStats("outside"), 49152, 49152, 98328, 0,
    ...                lever_facts=facts)
    >>> lev = with_levers(prof, ["fused_step", "state_8bit"])
    >>> lev.optimizer_bytes, lev.lever_step_bytes["b0"]
    (29064, 98304)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from memfit.errors import ConfigError
from memfit.records import BlockStats, LeverFacts, Profile
from memfit.stepmodel.head_chunks import chunk_fixed_bytes
from memfit.vocab import LEVERS, WEIGHTS

__all__ = [
    "EAGER_STEP_SLICE_ELEMENTS",
    "STEP_SLICE_ELEMENTS",
    "state_bytes",
    "state_kind_of",
    "step_slice_elements",
    "step_slice_numel",
    "temp_key",
    "with_levers",
]

#: torchao's AdamW steps a parameter larger than this in slices of about this many elements
#: (:mod:`memfit.levers.optim`), so its step's fp32 temporaries are those of one slice.
STEP_SLICE_ELEMENTS = 2**22
#: The slice when the step runs eagerly (never more than :data:`STEP_SLICE_ELEMENTS`): the
#: eager step holds about 24 bytes of fp32 temporaries per element of its slice.
EAGER_STEP_SLICE_ELEMENTS = 2**16

# Note [pricing the step that runs]
# torchao's step is torch.compile(fullgraph=True); it runs eagerly where dynamo is off
# (TORCHDYNAMO_DISABLE=1, torch._dynamo.config.disable) or under the force_eager stance, as
# under every memfit tracker. The eager step materializes every intermediate of the update
# (measured: 24 bytes per element at fp32 weights, 41 at bf16, for every state kind), so it
# steps in slices of EAGER_STEP_SLICE_ELEMENTS, where they are 1.5 MiB; the compiled step
# (one fused kernel, few launches) in slices of STEP_SLICE_ELEMENTS. The step model prices
# the one that will run in training (LeverFacts.step_eager, read when the facts are
# measured): the eager step exactly, its per-element cost measured eagerly on one eager
# slice; the compiled step at the same per-element cost on a compiled slice, an upper bound
# (the fused kernel holds a subset of the eager intermediates). CUDA follows the same rule:
# the allocator counts the same tensors MemTracker does on a CPU; only the CPU is tested.

_BLOCK = {"8bit": 256, "4bit": 128}
_MIN_QUANTIZED = 4096
_STATES = {"state_bf16": "bf16", "state_8bit": "8bit", "state_4bit": "4bit"}


def state_bytes(numel: int, param_bytes: int, kind: str, amsgrad: bool = False) -> int:
    """Exact bytes of one parameter's AdamW state (moments and step count) of a kind.

    ``fp32`` is also torch.optim.AdamW's own state (a 4-byte step tensor, two fp32 moments).
    ``8bit`` / ``4bit``: torchao quantizes a tensor of at least 4096 elements that its block
    size divides (codes, one fp32 scale per block, a 256- or 16-entry map); smaller ones stay
    at the parameter's dtype.
    """
    buffers = 3 if amsgrad else 2
    if kind in _BLOCK:
        block = _BLOCK[kind]
        if numel >= _MIN_QUANTIZED and numel % block == 0:
            codes = numel if kind == "8bit" else numel // 2
            qmap = 256 if kind == "8bit" else 16
            per = codes + (numel // block) * 4 + qmap * 4
        else:
            per = numel * param_bytes
        return 4 + buffers * per
    if kind not in WEIGHTS:
        raise ConfigError(f"unknown optimizer state kind {kind!r}; use fp32, bf16, 8bit or 4bit.")
    return 4 + buffers * numel * (4 if kind == "fp32" else 2)


def state_kind_of(levers: Sequence[str]) -> str:
    """``orig`` (the user's optimizer as it is), or the kind torchao's AdamW keeps the moments in."""
    kinds = [_STATES[n] for n in levers if n in _STATES]
    if kinds:
        return kinds[0]
    return "fp32" if "weights_bf16" in levers else "orig"


def step_slice_elements(eager: bool) -> int:
    """The most elements torchao's AdamW steps at once, run eagerly or compiled
    (Note [pricing the step that runs]).

    Example:
        >>> step_slice_elements(True), step_slice_elements(False)
        (65536, 4194304)
    """
    return min(STEP_SLICE_ELEMENTS, EAGER_STEP_SLICE_ELEMENTS) if eager else STEP_SLICE_ELEMENTS


def step_slice_numel(numel: int, kind: str, eager: bool = False) -> int:
    """The elements one step of a ``numel``-element parameter works on at once: all of them for
    the user's optimizer (``orig``), at most :func:`step_slice_elements` for torchao's AdamW.

    Example:
        >>> step_slice_numel(10_000_000, "4bit"), step_slice_numel(10_000_000, "orig")
        (4194304, 10000000)
        >>> step_slice_numel(10_000_000, "4bit", eager=True)
        65536
    """
    return numel if kind == "orig" else min(numel, step_slice_elements(eager))


def temp_key(kind: str, weights: str) -> str:
    """The key of :attr:`memfit.records.LeverFacts.step_temp_per_element`."""
    return f"{kind}/{weights}"


def with_levers(profile: Profile, levers: Sequence[str]) -> Profile:
    """``profile`` with ``levers`` applied (a copy; an empty lever list returns it unchanged).

    Raises:
        ConfigError: an unknown lever, a profile without :class:`LeverFacts`, or
            ``weights_bf16`` on a profile not measured in bf16.
    """
    names: list[str] = [n for n in LEVERS if n in levers]
    unknown = [n for n in levers if n not in LEVERS]
    if unknown:
        raise ConfigError(f"unknown lever {unknown[0]!r}; the levers are {', '.join(LEVERS)}.")
    if not names:
        return profile
    facts = profile.lever_facts
    if facts is None:
        raise ConfigError("this profile has no lever facts (made before levers existed); profile again.")
    out = copy.deepcopy(profile)
    out.levers = list(names)
    bf16 = "weights_bf16" in names
    weights = "bf16" if bf16 else profile.weights
    if bf16 and profile.precision != "bf16":
        raise ConfigError(f"weights_bf16 computes in bf16; this profile is at {profile.precision}.")
    wbytes = 2 if weights == "bf16" else facts.weight_bytes
    if weights != profile.weights:
        _bf16_weights(out, profile, facts, wbytes)
    kind = state_kind_of(names)
    numels = [n for ns in facts.params.values() for n in ns]
    if kind != "orig":
        out.optimizer_bytes = sum(state_bytes(n, wbytes, kind, facts.amsgrad) for n in numels)
        out.optimizer = f"torchao AdamW ({kind} state)"
        per = facts.step_temp_per_element.get(temp_key(kind, weights), 0.0)
        # See Note [pricing the step that runs]
        sliced = (step_slice_numel(n, kind, facts.step_eager) for n in numels)
        out.optimizer_temp_bytes = round(per * max(sliced, default=0))
        out.optimizer_bytes_by_dtype = {}
        # the step's time: every trained element at the kind's measured cost instead of the
        # user's optimizer's (both measured eagerly: an upper bound;
        # see Note [compiled code runs eagerly when tracked] in memfit.measuring.tracker)
        sec = facts.step_seconds_per_element
        new, old = sec.get(temp_key(kind, weights)), sec.get(temp_key("orig", profile.weights))
        if new is not None and old is not None and profile.step_seconds > 0:
            out.step_seconds = max(0.0, profile.step_seconds + (new - old) * sum(numels))
    if "chunked_loss" in names:
        _chunked_head(out, facts)
    if "frozen_bf16" in names or "frozen_nf4" in names:
        _frozen(out, facts, names)
    if "fused_step" in names:
        per = facts.step_temp_per_element.get(temp_key(kind, weights), 0.0)
        out.lever_step_bytes = {
            part: max(
                (n * wbytes + round(per * step_slice_numel(n, kind, facts.step_eager)) for n in ns), default=0
            )
            for part, ns in facts.params.items()
        }
    return out


def _bf16_weights(out: Profile, profile: Profile, facts: LeverFacts, wbytes: int) -> None:
    """``out`` with the fp32 weights of ``profile`` in bf16 (in place)."""
    half = facts.weight_bytes // wbytes
    trained = sum(n for ns in facts.params.values() for n in ns)
    out.param_bytes = (trained + facts.frozen_numel) * wbytes + facts.other_bytes
    out.grad_bytes = profile.grad_bytes // half
    out.early_grad_bytes = profile.early_grad_bytes // half
    delta = facts.weights_saved_delta
    for b in out.blocks:
        b.grad_bytes //= half
        b.param_bytes = sum(facts.params.get(b.name, [])) * wbytes
        for mode, value in b.backward_peak_bytes.items():
            b.backward_peak_bytes[mode] = value - profile_grad(profile, b.name) + b.grad_bytes
        _without_casts(b)
        _saved_moved(b, delta.get(b.name, 0))
        # a full block's recompute makes the casts mode none saves again: none with bf16 weights
        if "full" in b.backward_peak_bytes:
            recast = max(0, -delta.get(b.name, 0))
            b.backward_peak_bytes["full"] = max(b.grad_bytes, b.backward_peak_bytes["full"] - recast)
    _saved_moved(out.outside, delta.get("", 0))
    out.activation_bytes = max(0, out.activation_bytes + sum(delta.values()))
    out.weights = "bf16"
    what = "what autograd saves measured with bf16 weights" if delta else "other activations as measured"
    out.notes = [
        *out.notes,
        "weights_bf16 predicted from a profile with fp32 weights: parameters and gradients halved, "
        f"autocast's cached weight casts out (bf16 weights are not cast), {what}.",
    ]


def _saved_moved(part: BlockStats, delta: int) -> None:
    """``part``'s mode ``none`` saving ``delta`` more bytes, in place.

    See Note [the weights measured in bf16] in :mod:`memfit.measuring.lever_facts`.
    """
    if not delta or "none" not in part.saved_bytes:
        return
    part.saved_bytes["none"] = max(0, part.saved_bytes["none"] + delta)
    if "none" in part.held_bytes:
        part.held_bytes["none"] = max(0, part.held_bytes["none"] + delta)
    if "none" in part.forward_peak_bytes:
        part.forward_peak_bytes["none"] = max(0, part.forward_peak_bytes["none"] + delta)


def _without_casts(block: BlockStats) -> None:
    """``block`` without autocast's cached bf16 casts of its fp32 weights (in place): what it
    holds to the forward's end beyond what it saves (Note [held and saved bytes] in
    :mod:`memfit.stepmodel.memory`), made in its forward, so out of its forward peak too."""
    for mode, held in block.held_bytes.items():
        saved = block.saved_bytes.get(mode, held)
        cache = max(0, held - saved)
        block.held_bytes[mode] = held - cache
        if mode in block.forward_peak_bytes:
            block.forward_peak_bytes[mode] = max(saved, block.forward_peak_bytes[mode] - cache)


def _chunked_head(out: Profile, facts: LeverFacts) -> None:
    """``out``'s outside with the chunked head instead of the plain one (in place)."""
    head = facts.head
    if head is None or head.refused:
        why = (
            head.refused
            if head is not None
            else "this profile has no loss-head facts; plan with the lever again"
        )
        raise ConfigError(f"chunked_loss cannot be predicted: {why}")
    plain, chunked = head.plain, head.chunked
    o = out.outside
    o.saved_bytes = {m: max(0, v + chunked.saved_bytes - plain.saved_bytes) for m, v in o.saved_bytes.items()}
    delta = chunked.forward_peak_bytes - plain.forward_peak_bytes
    o.forward_peak_bytes = {m: max(0, v + delta) for m, v in o.forward_peak_bytes.items()}
    delta = chunked.backward_peak_bytes - plain.backward_peak_bytes
    o.backward_peak_bytes = {m: max(0, v + delta) for m, v in o.backward_peak_bytes.items()}
    # one chunk's logits do not shrink with micro-batches:
    # See Note [the head's bytes are affine in the chunk]
    o.forward_fixed_bytes += head.weight_grad_bytes + chunk_fixed_bytes(head, head.chunk_tokens)
    out.activation_bytes = max(0, out.activation_bytes + chunked.saved_bytes - plain.saved_bytes)
    out.notes = [
        *out.notes,
        f"chunked_loss: the loss head in chunks of {head.chunk_tokens} tokens; the model's output has "
        "no logits when it computes the loss.",
    ]


def _frozen(out: Profile, facts: LeverFacts, names: Sequence[str]) -> None:
    """``out`` with the frozen weights in bf16 and/or NF4 (in place)."""
    fz = facts.frozen
    if fz is None:
        raise ConfigError(
            "frozen_bf16 and frozen_nf4 cannot be predicted: this profile has no frozen-weight facts "
            "(the model has no frozen weights, or they were not measured); plan with the lever again."
        )
    nf4 = "frozen_nf4" in names
    if nf4 and not fz.nf4:
        raise ConfigError(
            "frozen_nf4 cannot be predicted: this model has no frozen Linear weight to quantize."
        )
    per = 2.0 if "weights_bf16" in names else fz.held_bytes / max(1, fz.numel)
    quantized = sum(n for ns in fz.nf4.values() for n in ns) if nf4 else 0
    after = 2.0 if "frozen_bf16" in names else per
    out.param_bytes += round((fz.numel - quantized) * (after - per) - quantized * per) + (
        fz.nf4_bytes if nf4 else 0
    )
    delta = fz.saved_delta.get(",".join(n for n in ("frozen_bf16", "frozen_nf4") if n in names), {})
    parts = {b.name: b for b in out.blocks}
    for name, d in delta.items():
        part = parts.get(name, out.outside) if name else out.outside
        if "none" in part.saved_bytes:
            part.saved_bytes["none"] = max(0, part.saved_bytes["none"] + d)
            if part is not out.outside:
                part.held_bytes["none"] = max(0, part.held_bytes.get("none", 0) + d)
                peak = part.forward_peak_bytes.get("none", 0) + d
                part.forward_peak_bytes["none"] = max(part.held_bytes["none"], peak)
    out.activation_bytes = max(0, out.activation_bytes + sum(delta.values()))
    for name, ns in fz.nf4.items() if nf4 else []:
        part = parts.get(name, out.outside) if name else out.outside
        fwd, bwd = (
            round(max(ns) * fz.nf4_forward_temp_per_element),
            round(max(ns) * fz.nf4_backward_temp_per_element),
        )
        part.forward_peak_bytes = {m: v + fwd for m, v in part.forward_peak_bytes.items()}
        part.backward_peak_bytes = {m: v + bwd for m, v in part.backward_peak_bytes.items()}
    what = "frozen weights in bf16" if "frozen_bf16" in names else ""
    if nf4:
        what = f"frozen Linear weights in NF4 ({quantized:,} values){', the rest ' + what if what else ''}"
    out.notes = [*out.notes, f"{what}; embeddings, norms and the output head are not quantized."]


def profile_grad(profile: Profile, name: str) -> int:
    """A block's gradient bytes in ``profile`` (0 for a name it does not have)."""
    return next((b.grad_bytes for b in profile.blocks if b.name == name), 0)
