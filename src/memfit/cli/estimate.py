"""``memfit estimate``: a training step's memory for every precision x checkpointing mode, allocating nothing.

With a ``[model.lora]`` table (adapters), it also prints the adapter step on rows of its own
(frozen base, adapters, their gradients and optimizer state, activations, temporaries) for
each way of storing the frozen base: fp32, bf16 and NF4 (:mod:`memfit.report.adapter_table`).

Example:
    memfit estimate --set model.n_layer=12 --set model.n_embd=768 --device-memory 24GiB
    memfit estimate --set model.name=import:memfit.models.llama:llama --set model.kwargs.preset=7b \\
        --set train.batch_size=1 --device-memory 80GiB
    memfit estimate --set model.name=import:memfit.models.llama:llama --set model.kwargs.preset=8b \\
        --set model.kwargs.block_size=131072 --set train.batch_size=1 --precision bf16 \\
        --device-memory 80GiB --maximize seq_len --levers chunked_loss,tiled_mlp,offload

With ``--maximize seq_len`` it answers, for each lever tier, the longest sequence whose step fits
``--device-memory`` instead (:func:`memfit.planning.longest_estimate.longest_estimate`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from memfit.app.build import build_model
from memfit.app.config import FROZEN_BASES, Config
from memfit.applying import Site, allowed_levers, lever, missing_torchao_hint, normalize_levers, usable_levers
from memfit.applying.offload import OFFLOAD
from memfit.budget import format_bytes, parse_bytes
from memfit.cli.advice import speed_order
from memfit.cli.common import config_from_args, zero_grads_note
from memfit.cli.model_args import batch_for, describe, optimizer_fn, spec_for
from memfit.devices import DeviceFacts, device_facts, resolve_device, slow_precisions
from memfit.errors import ConfigError
from memfit.measuring.estimate import estimate
from memfit.planning.lever_sets import lever_profiles, smallest_with_levers
from memfit.planning.longest_estimate import DEFAULT_GRAIN, check_grain, longest_estimate
from memfit.records import Estimate, EstimateEntry, Profile
from memfit.report.adapter_table import adapter_table
from memfit.report.memory_tables import head_table, longest_line, longest_table, strategy_table, verdict_line
from memfit.step import Batch, LossFn
from memfit.stepmodel import simulate
from memfit.vocab import PRECISIONS

__all__ = ["AdapterColumns", "adapter_columns", "adapter_lines", "check", "run"]


def check(args: argparse.Namespace) -> None:
    """Refuse a bad config, ``--device-memory`` or ``--maximize`` before estimating."""
    if args.device_memory is not None:
        parse_bytes(args.device_memory, what="device memory")
    normalize_levers(args.levers)
    _check_maximize(args)
    config_from_args(args)


def _check_maximize(args: argparse.Namespace) -> None:
    if args.maximize is None:
        if args.grain is not None or args.max_seq_len is not None:
            raise ConfigError(
                "--grain and --max-seq-len go with --maximize seq_len; add it or leave them out."
            )
        return
    if args.maximize != "seq_len":
        raise ConfigError(
            f"memfit estimate --maximize takes seq_len only, not {args.maximize}; the largest batch is "
            "memfit plan --maximize batch_size."
        )
    if args.device_memory is None:
        raise ConfigError(
            "memfit estimate --maximize seq_len needs --device-memory, the memory the step must fit "
            "(e.g. 24GiB)."
        )
    check_grain(DEFAULT_GRAIN if args.grain is None else args.grain, args.max_seq_len)


def lever_line(est: Estimate, memory: int | None, refused: dict[str, str] | None = None) -> str:
    """The smallest step with levers, its peak and bytes per parameter, and whether it fits."""
    e = est.with_levers
    if e is None:
        why = "; ".join((refused or {}).values()) or "the optimizer is not AdamW, or no lever facts"
        return f"with levers: none of the levers asked for can be predicted here ({why.rstrip('.')})."
    state = sum(e.breakdown.get(k, 0) for k in ("params", "grads", "optimizer"))
    fits = (
        ""
        if memory is None
        else f"; {'fits' if e.peak_bytes <= memory else 'does not fit'} {format_bytes(memory)}"
    )
    return (
        f"smallest plan with levers {', '.join(e.levers)}: {e.precision}, {e.mode} checkpointing, peak "
        f"{format_bytes(e.peak_bytes)} ({e.peak_bytes / est.param_count:.2f} bytes per parameter; "
        f"model state {state / est.param_count:.2f}){fits}"
    )


def run(args: argparse.Namespace) -> int:
    """Build the model under fake tensors, estimate, print the table and the verdict."""
    memory = None
    if args.device_memory is not None:
        memory = parse_bytes(args.device_memory, what="device memory")
    cfg = config_from_args(args)
    spec = spec_for(cfg, meta=True)
    batch = batch_for(spec, cfg)
    if args.maximize == "seq_len":
        assert memory is not None  # check refused it without
        return _run_longest(args, cfg, spec.loss_fn, batch, memory)
    lora = cfg.model.lora.rank > 0
    est = estimate(
        lambda: build_model(cfg.model).model,
        batch,
        spec.loss_fn,
        optimizer_fn(cfg),
        device_memory=memory,
        precisions=args.precision or PRECISIONS,
        # an adapter step's rows need the frozen weights' facts; with --device-memory, the
        # levers are what can fit when nothing else does
        levers=bool(args.levers) or lora or memory is not None,
    )
    # Issue 37: the 7B estimate ended in "nothing fits in 80.00 GiB" without a word on what would
    levers = args.levers or ("all" if memory is not None and _nothing_fits(est.ordered(), memory) else None)
    refused: dict[str, str] = {}
    if levers:
        # offload is priced per plan over the step's events (memfit.planning.offloaded), not per
        # profile, so the smallest step with levers (uniform modes) leaves it out, as it does the
        # levers the planner does not choose
        asked = [n for n in normalize_levers(levers) if lever(n).planned and n != OFFLOAD.name]
        allowed, refused = allowed_levers(asked, Site(torch.device("cpu"), est.optimizer or "none", "auto"))
        est.with_levers = smallest_with_levers(est.profiles, allowed)
    if args.json:
        print(est.to_json())
        return 0
    print(
        f"{est.model}: {est.param_count:,} parameters, batch {describe(batch)}, "
        f"{est.optimizer}; estimated on {est.device} in {est.seconds:.1f} s"
    )
    print()
    facts = _speed_facts(cfg.train.device)
    ordered = speed_order(est.ordered(), facts)
    print(strategy_table(ordered, memory))
    grads = zero_grads_note(e.breakdown for e in ordered)
    if grads:
        print(f"({grads}.)")
    if lora:
        print()
        print("\n".join(adapter_lines(est, cfg, "chunked_loss" in normalize_levers(args.levers), memory)))
    for precision, prof in est.profiles.items() if args.levers or lora else ():
        table = head_table(prof.lever_facts.head if prof.lever_facts else None, precision)
        if table is not None and precision != "fp16":  # fp16's head is bf16's (Note [fp16 is bf16's memory])
            print()
            print(table)
    print()
    print("assumptions:")
    for line in est.assumptions:
        print(f"  - {line}")
    if memory is not None:
        print(f"device memory: {format_bytes(memory)}")
    note = _speed_note(ordered, facts)
    if note:
        print(note)
    verdict = verdict_line(ordered, memory)
    print(f"without levers, {verdict}" if levers else verdict)
    if levers:
        print(lever_line(est, memory, refused) + ("" if args.levers else " (memfit estimate --levers all)"))
        hint = missing_torchao_hint(levers)
        if hint is not None and est.with_levers is not None:
            print(f"{hint[0].upper()}{hint[1:]}.")
    return 0


def _run_longest(args: argparse.Namespace, cfg: Config, loss_fn: LossFn, batch: Batch, memory: int) -> int:
    """``--maximize seq_len``: the longest sequence of each lever tier, as a table and one line each."""
    found = longest_estimate(
        lambda: build_model(cfg.model).model, batch, loss_fn, optimizer_fn(cfg), device_memory=memory,
        precisions=args.precision or PRECISIONS, levers=args.levers,
        grain=DEFAULT_GRAIN if args.grain is None else args.grain, max_seq_len=args.max_seq_len,
    )  # fmt: skip
    if args.json:
        print(found.to_json())
        return 0
    probes = f"{len(found.probes)} estimate{'s' if len(found.probes) > 1 else ''}"
    print(
        f"{found.model}: {found.param_count:,} parameters, {found.batch_size} x the sequence, "
        f"{found.optimizer}; the longest sequence in {format_bytes(memory)}, in grains of "
        f"{found.grain:,} tokens, from {probes} on fake tensors ({sum(found.probe_seconds):.0f} s)"
    )
    print()
    print(longest_table(found))
    print()
    print("assumptions:")
    for line in found.assumptions:
        print(f"  - {line}")
    for name, why in found.refused.items():
        print(f"  - {name} is left out: {why}.")
    for answer in found.answers:
        print(longest_line(answer, memory))
    return 0


def _nothing_fits(entries: list[EstimateEntry], memory: int) -> bool:
    return not any(e.peak_bytes <= memory for e in entries)


def _smallest(prof: Profile, levers: list[str]) -> EstimateEntry:
    """The smallest uniform checkpointing mode of ``prof`` (levers applied), as an entry."""
    best: EstimateEntry | None = None
    for mode in sorted({m for b in prof.blocks for m in b.saved_bytes} or {"none"}):
        sim = simulate(prof, mode)
        if best is None or sim.peak_bytes < best.peak_bytes:
            best = EstimateEntry(prof.precision, mode, sim.peak_bytes, sim.breakdown, levers=list(levers))
    assert best is not None
    return best


@dataclass
class AdapterColumns:
    """The adapter step's predicted entries, one per frozen-base choice (:func:`adapter_columns`)."""

    columns: list[tuple[str, EstimateEntry]] = field(default_factory=list)
    trained: int = 0
    """Trainable elements (the adapters)."""
    adapter_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    """Choices that could not be predicted, and why."""


def adapter_columns(est: Estimate, chunked: bool) -> AdapterColumns | None:
    """At bf16, the smallest uniform-mode step for each of the config's frozen bases
    (``FROZEN_BASES`` of :mod:`memfit.app.config`; each also with ``chunked_loss`` if ``chunked``); None
    when the estimate has no bf16 profile with lever facts (``memfit.estimate(levers=True)``).

    Example (what ``memfit estimate`` prints with ``--set model.lora.rank=16``):
        ``adapter_columns(memfit.estimate(model_fn, batch, loss_fn, opt_fn, levers=True), True)``
        has the columns ``fp32 base``, ``fp32 + chunked``, ... ``nf4 + chunked``.
    """
    prof = est.profiles.get("bf16")
    if prof is None or prof.lever_facts is None:
        return None
    facts = prof.lever_facts
    out = AdapterColumns(trained=sum(sum(v) for v in facts.params.values()))
    out.adapter_bytes = out.trained * facts.weight_bytes
    unpredicted: dict[str, list[str]] = {}
    for base, frozen in FROZEN_BASES.items():
        for chunk in (False, True) if chunked else (False,):
            levers = [*frozen, *(["chunked_loss"] if chunk else [])]
            label = f"{base} {'+ chunked' if chunk else 'base'}"
            _, refused = usable_levers({"bf16": prof}, levers)
            why = "; ".join(refused.values())
            if not why:
                try:
                    out.columns.append(
                        (label, _smallest(lever_profiles({"bf16": prof}, levers)["bf16"], levers))
                    )
                except ConfigError as exc:
                    why = str(exc)
            if why:
                unpredicted.setdefault(why.rstrip("."), []).append(label)
    out.notes = [f"{', '.join(labels)}: not predicted, {why}" for why, labels in unpredicted.items()]
    return out


def adapter_lines(est: Estimate, cfg: Config, chunked: bool, memory: int | None) -> list[str]:
    """The adapter step's table (:func:`adapter_columns`) and the lines under it.

    Example: ``print("\\n".join(adapter_lines(est, cfg, chunked=True, memory=None)))``.
    """
    got = adapter_columns(est, chunked)
    if got is None:
        return [
            "adapter step: estimated at bf16, where the bf16 and NF4 bases compute; add --precision bf16."
        ]
    lines = (
        [adapter_table(got.columns, got.adapter_bytes, memory, "adapter step, bf16")] if got.columns else []
    )
    state = got.columns[0][1].breakdown.get("optimizer", 0) if got.columns else 0
    lines.append(
        f"({got.trained:,} of {est.param_count:,} parameters train; their whole gradient, "
        f"{format_bytes(got.adapter_bytes)} in fp32, lives from the backward to the optimizer step, their "
        f"{est.optimizer} state is {format_bytes(state)}, the frozen base has neither; "
        + ("chunked: with chunked_loss; " if any("chunked" in c for c, _ in got.columns) else "")
        + f"memfit train stores the base as model.lora.base says, {cfg.model.lora.base!r})"
    )
    return lines + [f"({n})" for n in got.notes]


def _speed_facts(device: str) -> DeviceFacts | None:
    """What ``train.device`` runs fast, when it is on this machine (None: not here, e.g. a GPU elsewhere)."""
    try:
        return device_facts(resolve_device(device))
    except ConfigError:
        return None


def _speed_note(ordered: list[EstimateEntry], facts: DeviceFacts | None) -> str | None:
    """Why the emulated precisions come last (their memory is still what it says)."""
    slow = [p for p in (slow_precisions(facts) if facts else []) if any(e.precision == p for e in ordered)]
    if not slow or facts is None:
        return None
    one = len(slow) == 1
    return (
        f"speed: {' and '.join(slow)} {'is' if one else 'are'} not native on {facts.name} (see memfit "
        "doctor): not reliably faster than fp32, so listed after it; "
        f"{'it saves' if one else 'they save'} memory as shown."
    )
