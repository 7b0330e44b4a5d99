"""The levers, listed once (:data:`REGISTRY`), and what is read off the list: names, refusals,
the lever sets the planner tries, and a profile under a lever set (:func:`with_levers`).

``levers=None`` (the default everywhere) uses none: each lever changes the numerics or the
step's structure, so it is used only when asked. ``"all"`` allows every lever this device,
optimizer, precision and model can run; a list names them. A new lever is one module (a
:class:`~memfit.applying.lever.Lever`) and one line below; :func:`register` adds one at run
time (a test's, a plug-in's).

Example:
    >>> normalize_levers("state_8bit,fused_step")
    ['fused_step', 'state_8bit']
    >>> [sorted(s) for s in lever_sets(["fused_step", "state_8bit"])]
    [[], ['fused_step'], ['state_8bit'], ['fused_step', 'state_8bit']]
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from memfit.applying.chunked_loss import CHUNKED_LOSS
from memfit.applying.frozen import FROZEN_BF16, FROZEN_NF4
from memfit.applying.fused_step import FUSED_STEP
from memfit.applying.lever import Lever, Predicting, Site
from memfit.applying.offload import OFFLOAD
from memfit.applying.state import STATE_4BIT, STATE_8BIT, STATE_BF16
from memfit.applying.weights_bf16 import WEIGHTS_BF16
from memfit.errors import ConfigError, LeverRefused
from memfit.levers.needs import TORCHAO_INSTALL, torchao_available
from memfit.records import Profile

__all__ = [
    "REGISTRY",
    "allowed_levers",
    "check_levers",
    "lever",
    "lever_names",
    "lever_sets",
    "levers_in_order",
    "missing_torchao_hint",
    "normalize_levers",
    "optimizer_family",
    "optimizer_lever",
    "register",
    "site_of",
    "unregister",
    "usable_levers",
    "with_levers",
]

#: Every lever, by name, in the order plans list them (the order of equal risk, too).
REGISTRY: dict[str, Lever] = {
    lv.name: lv
    for lv in (
        FUSED_STEP,
        STATE_BF16,
        STATE_8BIT,
        STATE_4BIT,
        WEIGHTS_BF16,
        OFFLOAD,
        CHUNKED_LOSS,
        FROZEN_BF16,
        FROZEN_NF4,
    )
}


def register(new: Lever) -> Lever:
    """Add a lever (after the others); returns it.

    Raises:
        ConfigError: it has no name, or one a lever has already.
    """
    if not new.name or new.name in REGISTRY or new.name == "all":
        raise ConfigError(f"a lever needs a name of its own; {new.name!r} is empty or taken.")
    REGISTRY[new.name] = new
    return new


def unregister(name: str) -> None:
    """Take a lever :func:`register` added off the list again."""
    REGISTRY.pop(name, None)


def lever_names() -> tuple[str, ...]:
    """Every lever's name, in the registry's order."""
    return tuple(REGISTRY)


def lever(name: str) -> Lever:
    """The lever called ``name``.

    Raises:
        ConfigError: no lever has that name.
    """
    found = REGISTRY.get(name)
    if found is None:
        raise ConfigError(f"unknown lever {name!r}; the levers are {', '.join(REGISTRY)} (or 'all').")
    return found


def normalize_levers(levers: str | Iterable[str] | None) -> list[str]:
    """Lever names in the registry's order from None, ``"all"``, ``"a,b"`` or a list.

    Raises:
        ConfigError: an unknown lever name.
    """
    if levers is None:
        return []
    if isinstance(levers, str):
        if levers.strip() in ("all", ""):
            return list(REGISTRY) if levers.strip() == "all" else []
        names = [n.strip() for n in levers.split(",") if n.strip()]
    else:
        names = [str(n).strip() for n in levers]
    for name in names:
        lever(name)
    return [n for n in REGISTRY if n in names]


def levers_in_order(levers: Iterable[str]) -> list[Lever]:
    """The levers named, in the order they are applied and predicted (``Lever.order``)."""
    return sorted((lever(n) for n in normalize_levers(list(levers))), key=lambda lv: lv.order)


def optimizer_family(optimizer: torch.optim.Optimizer | None) -> str:
    """The optimizer's family as refusals read it (one memfit carried over keeps its family)."""
    if optimizer is None:
        return "none"
    return str(getattr(optimizer, "memfit_family", type(optimizer).__name__))


def site_of(
    device: str | torch.device,
    optimizer: torch.optim.Optimizer | None,
    precision: str,
    model: nn.Module | None = None,
) -> Site:
    """Where levers would run, as their refusals read it."""
    return Site(torch.device(device), optimizer_family(optimizer), precision, model)


def allowed_levers(levers: str | Iterable[str] | None, site: Site) -> tuple[list[str], dict[str, str]]:
    """The levers asked for that can run at ``site``, and ``{lever: why not}`` for the rest."""
    kept, refused = [], {}
    for name in normalize_levers(levers):
        why = lever(name).refusal(site)
        if why is None:
            kept.append(name)
        else:
            refused[name] = why
    return kept, refused


def check_levers(levers: Sequence[str], site: Site) -> None:
    """Refuse a lever set that cannot run at ``site``.

    Raises:
        LeverRefused: the first lever that cannot run, with the reason.
        ConfigError: an unknown lever, or two levers of one group.
    """
    names = normalize_levers(levers)
    groups: dict[str, list[str]] = {}
    for name in names:
        if lever(name).group:
            groups.setdefault(lever(name).group, []).append(name)
    for members in groups.values():
        if len(members) > 1:
            raise ConfigError(f"levers {members} each set the optimizer state's precision; keep one.")
    _, refused = allowed_levers(names, site)
    for name, why in refused.items():
        raise LeverRefused(why, name)


def missing_torchao_hint(levers: str | Iterable[str] | None) -> str | None:
    """What of ``levers`` is left out for want of torchao, and the command that adds it; None if nothing.

    For a command's output where ``levers="all"`` quietly plans without the state levers.

    Example:
        >>> missing_torchao_hint("fused_step") is None
        True
    """
    missing = [n for n in normalize_levers(levers) if lever(n).optimizer_kind is not None]
    if not missing or torchao_available():
        return None
    names = ", ".join(missing[:-1]) + (" and " if len(missing) > 1 else "") + missing[-1]
    return (
        f"{names} {'were' if len(missing) > 1 else 'was'} left out: "
        f"{'they need' if len(missing) > 1 else 'it needs'} torchao's low-precision AdamW, which is not "
        f"installed; `{TORCHAO_INSTALL}` adds it"
    )


# Note [lever sets in risk order]
# The planner tries lever sets from the least numeric risk to the most and keeps the first
# whose plan fits. A set's risk is the sum of its levers' risks (the frozen weights in bf16
# 1; the optimizer state in bf16, 8 bits, 4 bits 2, 4, 6; bf16 weights 7; the frozen
# weights in NF4 20: See Note [NF4 last]); among sets of one risk, those without the exact
# levers (risk 0: the fused step, whose clipping runs the backward twice, then the chunked
# loss head, in the registry's order) come first; then the set whose riskiest levers are
# less risky (the state in 4 bits and the frozen base in bf16 before bf16 weights). At most
# one lever of a group (the optimizer state's kinds) is in a set, and none a lever
# excludes (bf16 weights are bf16 frozen weights too). Every set is predicted from the same
# profiles (with_levers, a pure function): no lever set costs a step.


def lever_sets(allowed: Sequence[str]) -> list[list[str]]:
    """Every lever set the planner may use from ``allowed``, least numeric risk first
    (See Note [lever sets in risk order]); levers it does not choose (``planned=False``) are left out."""
    chosen = [lever(n) for n in normalize_levers(list(allowed)) if lever(n).planned]
    exact = [lv.name for lv in chosen if lv.risk == 0]
    sets = []
    for flags in itertools.product((False, True), repeat=len(chosen)):
        members = [lv for lv, on in zip(chosen, flags, strict=True) if on]
        if not _compatible(members):
            continue
        names = {lv.name for lv in members}
        risks = sorted((lv.risk for lv in members), reverse=True)
        key = (sum(risks), tuple(n in names for n in exact), risks)
        sets.append((key, [n for n in REGISTRY if n in names]))
    return [names for _, names in sorted(sets, key=lambda kv: kv[0])]


def _compatible(members: Sequence[Lever]) -> bool:
    names = {lv.name for lv in members}
    groups = [lv.group for lv in members if lv.group]
    return len(groups) == len(set(groups)) and not any(set(lv.excludes) & names for lv in members)


def usable_levers(
    profiles: Mapping[str, Profile], allowed: Sequence[str]
) -> tuple[list[str], dict[str, str]]:
    """``allowed`` less the levers the profiles cannot predict, with the reason (e.g. the loss
    does not go through the model's head; the model has no frozen weights)."""
    refused: dict[str, str] = {}
    for name in allowed:
        for prof in profiles.values():
            why = lever(name).unpredictable(prof.lever_facts)
            if why:
                refused[name] = why
                break
    return [n for n in allowed if n not in refused], refused


def with_levers(profile: Profile, levers: Sequence[str]) -> Profile:
    """``profile`` with ``levers`` applied (a copy; an empty lever list returns it unchanged): each
    lever's :meth:`~memfit.applying.lever.Lever.predict` in turn, a pure function over records.

    Raises:
        ConfigError: an unknown lever, a profile without lever facts, or a lever whose facts
            cannot predict it (e.g. ``weights_bf16`` on a profile not measured in bf16).
    """
    ordered = levers_in_order(levers)
    if not ordered:
        return profile
    facts = profile.lever_facts
    if facts is None:
        raise ConfigError("this profile has no lever facts (made before levers existed); profile again.")
    out = copy.deepcopy(profile)
    out.levers = normalize_levers([lv.name for lv in ordered])
    ctx = _predicting(profile, out.levers)
    for lv in ordered:
        lv.predict(out, ctx)
    return out


def _predicting(profile: Profile, names: Sequence[str]) -> Predicting:
    assert profile.lever_facts is not None
    members = [lever(n) for n in names]
    bf16 = any(lv.bf16_weights for lv in members)
    weights = "bf16" if bf16 else profile.weights
    by = optimizer_lever(names)
    return Predicting(
        levers=tuple(names),
        base=profile,
        facts=profile.lever_facts,
        weights=weights,
        bf16_weights=bf16,
        weight_bytes=2 if weights == "bf16" else profile.lever_facts.weight_bytes,
        optimizer_kind=(lever(by).optimizer_kind or "orig") if by else "orig",
        optimizer_lever=by,
    )


def optimizer_lever(levers: Sequence[str]) -> str:
    """The lever of a set that replaces the optimizer: its state lever (a group member), else the
    first that needs torchao's AdamW (``weights_bf16``: fp32 moments), else ""."""
    members = [lever(n) for n in levers]
    grouped = [lv for lv in members if lv.optimizer_kind is not None and lv.group]
    anyone = [lv for lv in members if lv.optimizer_kind is not None]
    return (grouped or anyone)[0].name if anyone else ""
