"""Find a model's repeated blocks: the unit a person would checkpoint, at any depth.

A block is a module that repeats in sequence: a transformer layer, a ResNet or ConvNeXt
block, a DenseNet layer. Models hold them in ``nn.ModuleList``, ``nn.Sequential``,
``nn.ModuleDict`` or plain attributes (``s1.b1``, ``s1.b2``), often grouped in stages of
different widths, and put stems, heads, classifiers and down-sampling layers around them.

How :func:`find_blocks` decides:

1. Generic containers (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict`` themselves,
   not subclasses) are looked through: a module's *sequence* is its children with those
   containers opened, so ResNet's ``layer1 ... layer4`` form one sequence of blocks. A run
   of identical generic containers that repeat nothing inside (``ModuleList`` of
   ``Sequential(Linear, GELU)``) stays a sequence of blocks.
   A container around a single module that is more than a bare layer (HRNet's
   ``Sequential(Bottleneck)``) is looked through too.
2. A *run* is two or more consecutive items of one kind (class) with parameters in a
   sequence; runs of classifier heads (GoogLeNet's two auxiliary classifiers) are not.
   Kinds that form runs are candidates, ranked by height (how many levels of
   parameterised modules they hold): blocks are built from layers, so runs of multi-level
   modules win over runs of single layers (a stem of two conv-norm-act layers), which win
   over runs of bare layers (``Linear``, ``Linear``). A residual unit (its ``forward``
   adds its input back, read from its source) ranks as a block whatever its height.
3. A candidate whose own sequence is mostly (by parameters, bare layers such as embeddings
   and norms left out) other candidates is a stage,
   not a block: its children are the blocks (stages, encoder and decoder stacks). A block
   with a run of smaller candidates inside (MaxViT: a conv block, then window and grid
   attention) is told apart by holding the same number of them in every instance; a
   residual unit (timm GhostNet's bottleneck of two ghost modules) or a module of a fixed
   set of named parts (timm EfficientViT's context and local modules) is never a stage.
4. A candidate found mostly inside another candidate is a part of a block (an attention
   module's projections, a mixture of experts' experts, timm FastViT's conv units that its
   stem also uses), not a block.
5. The blocks are the outermost modules of the remaining kinds, anywhere in the model, in
   module order: a stage with a single block still contributes it, and both stacks of an
   encoder-decoder contribute theirs. A stage (generic container) beside other stages of
   blocks contributes its multi-level modules even when their class does not repeat
   (timm EfficientNet's first block).
6. A block type that occurs once per stage, in the same container as the blocks found
   (Inception-v3's reduction blocks, EdgeNeXt's transposed-attention block), is a block
   too; heads never are (see Note [once per stage]).

Classes that Hugging Face itself checkpoints (subclasses of its ``GradientCheckpointingLayer``)
are taken as the blocks when a model has them, else the classes a model names in
``_no_split_modules``. :func:`block_reasons` says, per block, which rule chose it.

Example:
    >>> from torch import nn
    >>> find_blocks(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    ['0', '1']
    >>> mlp = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(3))
    >>> find_blocks(mlp)
    ['0', '1', '2']
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from memfit.checkpointing.hf import hf_block_classes
from memfit.checkpointing.structure import adapter_base, adds_input_back, declared_block_classes, is_head
from memfit.errors import ConfigError

__all__ = ["block_reasons", "find_blocks", "resolve_blocks"]

_GENERIC = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
#: A candidate is a stage when other candidates hold at least this share of its parameters.
_STAGE_SHARE = 0.9


def _generic(m: nn.Module) -> bool:
    return type(m) in _GENERIC


class _Tree:
    """Per-model facts the steps share: parameter counts, heights, kinds and sequences."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params: dict[int, int] = {}
        self.height: dict[int, int] = {}
        self._measure(model)
        self.opaque: set[int] = set()
        self.attributes: set[int] = set()  # modules held as plain attributes, not in a container
        self._seq: dict[int, list[nn.Module]] = {}
        self.roots = {id(m) for m in model.modules() if not _generic(m) or m is model}

    def _measure(self, m: nn.Module) -> None:
        self.params[id(m)] = sum(p.numel() for p in m.parameters())
        heights = []
        for c in m.children():
            self._measure(c)
            if self.params[id(c)]:
                heights.append(self.height[id(c)])
        self.height[id(m)] = 1 + max(heights) if heights else 0
        base = adapter_base(m)
        if base is not None:  # See Note [adapters wrap a layer]
            self.height[id(m)] = self.height[id(base)]

    def sequence(self, m: nn.Module) -> list[nn.Module]:
        if id(m) not in self._seq:
            self._seq[id(m)] = list(self._items(m))
        return self._seq[id(m)]

    def _items(self, m: nn.Module) -> Iterator[nn.Module]:
        """``m``'s sequence: children, generic containers opened unless they are repeated blocks."""
        children = list(m.children())
        i = 0
        while i < len(children):
            c = children[i]
            if not _generic(c):
                if not _generic(m):
                    self.attributes.add(id(c))
                yield c
                i += 1
                continue
            j = i
            while j + 1 < len(children) and _kind_key(children[j + 1]) == _kind_key(c):
                j += 1
            group = children[i : j + 1]
            if len(group) > 1 and not any(_runs(self.sequence(g)) or self.wrapper(g) for g in group):
                self.opaque.update(id(g) for g in group)
                yield from group
            else:
                for g in group:
                    yield from self._items(g)
            i = j + 1

    def wrapper(self, m: nn.Module) -> bool:
        """A generic container around one module that is more than a bare layer (HRNet's
        ``Sequential(Bottleneck)``): looked through, never a block itself."""
        held = [c for c in m.children() if self.params[id(c)]]
        return len(held) == 1 and self.height[id(held[0])] > 0

    def residual(self, m: nn.Module) -> bool:
        """Whether ``m`` is a residual unit; see Note [residual units]."""
        return not _generic(m) and adds_input_back(type(m))

    def sequences(self) -> Iterator[list[nn.Module]]:
        sealed = {
            id(d) for m in self.model.modules() if adapter_base(m) is not None for d in m.modules()
        }  # See Note [adapters wrap a layer]
        for m in self.model.modules():
            if (id(m) in self.roots or id(m) in self.opaque) and id(m) not in sealed:
                yield self.sequence(m)


def _runs(items: list[nn.Module]) -> list[list[nn.Module]]:
    out = []
    for _, group in itertools.groupby(items, key=lambda m: _kind_key(m)):
        run = list(group)
        if len(run) > 1 and any(True for _ in run[0].parameters()):
            out.append(run)
    return out


def _kind_key(m: nn.Module) -> Any:
    if _generic(m):
        return (type(m), tuple(_kind_key(c) for c in m.children()))
    return type(m)


def _candidates(tree: _Tree) -> tuple[set[Any], set[Any]]:
    """Kinds that form runs: those of the highest tier of height (blocks > layers > bare
    layers), and those of the lower tiers."""
    found: dict[Any, list[nn.Module]] = {}
    for items in tree.sequences():
        for run in _runs(items):
            # Two bare layers side by side as attributes (``self.fc1``, ``self.fc2``) are a
            # model's own layers, not repeated blocks; in a container they may be.
            if all(tree.height[id(m)] == 0 and id(m) in tree.attributes for m in run):
                continue
            if all(is_head(m, tree.model) for m in run):  # GoogLeNet's two auxiliary classifiers
                continue
            found.setdefault(_kind_key(run[0]), []).extend(run)
    if not found:
        return set(), set()

    def tier(k: Any) -> int:
        # A residual unit of single layers (a ResNet BasicBlock) is a block, not a layer.
        floor = 2 if tree.residual(found[k][0]) else 0
        return max(floor, min(2, max(tree.height[id(m)] for m in found[k])))

    top = max(tier(k) for k in found)
    return {k for k in found if tier(k) == top}, {k for k in found if tier(k) < top}


def _instances(model: nn.Module, kinds: set[Any]) -> list[tuple[str, nn.Module]]:
    """Outermost modules of the given kinds, in module order."""
    out: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if name and _kind_key(m) in kinds and not any(name.startswith(p + ".") for p, _ in out):
            out.append((name, m))
    return out


def _inside(tree: _Tree, kind: Any, outer: set[Any]) -> tuple[int, int]:
    """How many modules of ``kind`` sit inside a module of the ``outer`` kinds, of how many."""
    prefixes = [n + "." for n, _ in _instances(tree.model, outer)]
    names = [n for n, _ in _instances(tree.model, {kind})]
    return sum(any(n.startswith(p) for p in prefixes) for n in names), len(names)


def _stage_shape(tree: _Tree, kind: Any, inner_kinds: set[Any]) -> tuple[float, bool, bool]:
    """The largest share of a ``kind`` module's content held by ``inner_kinds`` modules,
    whether their number differs from one ``kind`` module to another, and whether they are
    a fixed set of named parts (plain attributes, as many everywhere)."""
    shares, counts, contained = [0.0], set(), False
    for _, m in _instances(tree.model, {kind}):
        # Bare layers (embeddings, norms, a down-sampling conv) are glue, not content.
        parts = [c for c in tree.sequence(m) if tree.height[id(c)] > 0]
        inner = [c for c in parts if _kind_key(c) in inner_kinds]
        shares.append(sum(tree.params[id(c)] for c in inner) / max(1, sum(tree.params[id(c)] for c in parts)))
        counts.add(len(inner))
        contained |= any(id(c) not in tree.attributes for c in inner)
    return max(shares), len(counts) > 1, len(counts) == 1 and not contained


def _select(tree: _Tree, top: set[Any], lower: set[Any]) -> set[Any]:
    # A candidate is a stage when other candidates hold 90% of its content (a stage of
    # blocks after a small down-sampling layer). A block can also hold a run of smaller
    # candidates (MaxViT: a conv block, then window and grid attention), up to ~85% of it;
    # it differs from a stage by holding the same number of them everywhere, while stages
    # hold as many blocks as their depth, which differs from stage to stage. Blocks of one
    # level (timm MambaOut) rank below their stages by height: a lower-tier kind found only
    # inside a candidate, in varying numbers, makes the candidate a stage of them.
    # A residual unit is never a stage, however much of it its parts hold (timm GhostNet's
    # bottleneck is two ghost modules and a shortcut), and neither is a module made of a
    # fixed set of named parts (timm EfficientViT's block: a context and a local module).
    kinds, stages = set(top), set()
    for k in top:
        if tree.residual(_instances(tree.model, {k})[0][1]):
            continue
        share, varies, named = _stage_shape(tree, k, top - {k})
        if (share >= _STAGE_SHARE and not named) or (share >= 0.5 and varies):
            stages.add(k)
            continue
        only_inside = {low for low in lower if _inside(tree, low, {k})[0] == _inside(tree, low, {k})[1]}
        share, varies, _ = _stage_shape(tree, k, only_inside)
        if share >= 0.5 and varies:
            stages.add(k)
            kinds |= only_inside
    kinds -= stages
    # 4. parts: most of their modules sit inside a module of another remaining kind.
    parts = set()
    for k in kinds:
        inside, total = _inside(tree, k, kinds - {k})
        if total and 2 * inside > total:
            parts.add(k)
    return kinds - parts


def _odd_blocks(tree: _Tree, blocks: list[tuple[str, nn.Module]]) -> set[int]:
    """Blocks of another class in a stage of their own (timm EfficientNet's first block).

    A generic container whose children are stages (generic containers) of blocks: every
    multi-level module in such a stage is a block too, even if its class does not repeat.
    """
    found = {id(m) for _, m in blocks}
    odd: set[int] = set()
    for m in tree.model.modules():
        stages = [c for c in m.children() if _generic(c)]
        holding = [s for s in stages if any(id(x) in found for x in tree.sequence(s))]
        if len(holding) < 2:
            continue
        for s in stages:
            items = [x for x in tree.sequence(s) if tree.params[id(x)]]
            if items and all(tree.height[id(x)] >= 2 for x in items):
                odd.update(id(x) for x in items if id(x) not in found)
    return odd


def _siblings(tree: _Tree, blocks: list[tuple[str, nn.Module]]) -> dict[str, str]:
    """Blocks of a type that occurs once per stage, beside the repeated ones (Inception-v3's
    reduction blocks, timm EdgeNeXt's ``SplitTransposeBlock``), with why each was taken.

    See Note [once per stage].
    """
    found = {id(m) for _, m in blocks}
    modules = dict(tree.model.named_modules())
    classifier = [m for m in tree.model.modules() if isinstance(m, nn.Linear)][-1:]
    places: set[tuple[type[nn.Module], str]] = set()  # (class of the owner, path from it to the container)
    for name, _ in blocks:
        holder = name.rpartition(".")[0]
        owner = holder
        while owner and _generic(modules[owner]):
            owner = owner.rpartition(".")[0]
        places.add((type(modules[owner]), holder[len(owner) :].lstrip(".")))
    out: dict[str, str] = {}
    for prefix, m in modules.items():
        for cls, rel in places:
            if type(m) is not cls:
                continue
            try:
                container = m.get_submodule(rel)
            except AttributeError:
                continue
            where = ".".join(p for p in (prefix, rel) if p) or "the model"
            if any(id(c) in found for c in container.children()):
                why = f"in {where} beside its repeated blocks (a block type once per stage)"
            else:
                why = f"in {where}, the place of the repeated blocks in other {cls.__name__} modules"
            for child, c in container.named_children():
                if _generic(c) or not tree.params[id(c)] or any(id(x) in found for x in c.modules()):
                    continue  # a container, nothing to keep, or a block (or one holding blocks: DLA's trees)
                if not (tree.height[id(c)] >= 2 or tree.residual(c)):
                    continue
                if is_head(c, tree.model) or any(f is x for f in classifier for x in c.modules()):
                    continue
                out[".".join(p for p in (prefix, rel, child) if p)] = why
    return out


# Note [once per stage]
# A stage may hold one block of another type beside its repeated ones: Inception-v3's
# reduction blocks between its runs of Inception blocks, EdgeNeXt's transposed-attention
# block at the end of each stage, EfficientViT's down-sampling block at the start. A person
# checkpoints those too. They are the multi-level modules (or residual units) in the same
# container as the blocks found, and in the same place in every module of the same class
# (each ``EfficientVitStage``'s ``blocks``, whether or not it held a repeated block); never
# a container, a head (auxiliary classifier), or the module holding the model's classifier.
# A stage's own down-sampling layer beside its ``blocks`` container is not in that container.


def _reason(tree: _Tree, m: nn.Module, count: int) -> str:
    cls = type(m).__name__
    if tree.residual(m):
        return f"residual unit ({cls}.forward adds its input back), {count} in the model"
    return f"repeated {count}x ({cls}), the largest unit that repeats"


def block_reasons(model: nn.Module) -> dict[str, str]:
    """Why each block :func:`find_blocks` finds was chosen: qualified name -> a short reason.

    Example:
        >>> from torch import nn
        >>> block_reasons(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))["1"]
        'repeated 2x (Linear), the largest unit that repeats'
    """
    for declared, why in (
        (hf_block_classes(model), "Hugging Face checkpoints this class itself (GradientCheckpointingLayer)"),
        (declared_block_classes(model), "declared in the model's _no_split_modules"),
    ):
        if declared and sum(1 for m in model.modules() if type(m) in declared) > 1:
            return {n: why for n, _ in _instances(model, set(declared))}
    tree = _Tree(model)
    top, lower = _candidates(tree)
    if not top:
        return {}
    blocks = _instances(model, _select(tree, top, lower))
    counts: dict[Any, int] = {}
    for _, m in blocks:
        counts[_kind_key(m)] = counts.get(_kind_key(m), 0) + 1
    reasons = {n: _reason(tree, m, counts[_kind_key(m)]) for n, m in blocks}
    odd = _odd_blocks(tree, blocks)
    for n, m in model.named_modules():
        if id(m) in odd:
            reasons[n] = "a stage of its own beside stages of blocks (its first block, of another class)"
    for n, why in _siblings(tree, blocks).items():
        reasons.setdefault(n, why)
    ordered = [n for n, _ in model.named_modules() if n in reasons]
    # A block is never inside another: checkpointed twice, it would be recomputed twice.
    return {n: reasons[n] for n in ordered if not any(n.startswith(o + ".") for o in ordered)}


def find_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the model's repeated blocks, in module order.

    :func:`block_reasons` says why each was chosen.

    Args:
        model: any ``nn.Module``.

    Returns:
        Qualified module names, e.g. ``["blocks.0", "blocks.1"]``; empty if nothing repeats.

    Example:
        >>> seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        >>> find_blocks(seq)
        []
    """
    return list(block_reasons(model))


def resolve_blocks(model: nn.Module, blocks: str | Sequence[str]) -> list[str]:
    """Block names from ``"auto"``, qualified module names, or class names (``"LlamaDecoderLayer"``).

    Raises:
        ConfigError: nothing repeats (``"auto"``), or a name is neither a module nor a class in it.
    """
    if blocks == "auto":
        names = find_blocks(model)
        if not names:
            raise ConfigError(
                f"found no repeated blocks in {type(model).__name__} (looked for two or more "
                "consecutive same-class modules with parameters, in any container); pass "
                "blocks=[...] with the qualified names or the class name of the blocks to checkpoint."
            )
        return names
    if isinstance(blocks, str):
        blocks = [blocks]
    modules = dict(model.named_modules())
    classes = {type(m).__name__ for m in modules.values()}
    out: list[str] = []
    missing = []
    for b in blocks:
        if b and b in modules:
            out.append(b)
        elif b in classes:
            out.extend(
                n for n, _ in _instances(model, {type(m) for m in modules.values() if type(m).__name__ == b})
            )
        else:
            missing.append(b)
    if missing:
        hints = []
        for m in missing:
            close = difflib.get_close_matches(m, [n for n in modules if n] + sorted(classes), n=1)
            hints.append(f"{m!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(
            f"no module named {', '.join(hints)} in {type(model).__name__} (nor a class of its modules); "
            f"blocks found by find_blocks: {find_blocks(model) or 'none'}."
        )
    return list(dict.fromkeys(out))
