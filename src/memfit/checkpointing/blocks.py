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
2. A *run* is two or more consecutive items of one kind (class) with parameters in a
   sequence. Kinds that form runs are candidates, ranked by height (how many levels of
   parameterised modules they hold): blocks are built from layers, so runs of multi-level
   modules win over runs of single layers (a stem of two conv-norm-act layers), which win
   over runs of bare layers (``Linear``, ``Linear``).
3. A candidate whose own sequence is mostly (by parameters, bare layers such as embeddings
   and norms left out) other candidates is a stage,
   not a block: its children are the blocks (stages, encoder and decoder stacks). A block
   with a run of smaller candidates inside (MaxViT: a conv block, then window and grid
   attention) is told apart by holding the same number of them in every instance.
4. A candidate found mostly inside another candidate is a part of a block (an attention
   module's projections, a mixture of experts' experts, timm FastViT's conv units that its
   stem also uses), not a block.
5. The blocks are the outermost modules of the remaining kinds, anywhere in the model, in
   module order: a stage with a single block still contributes it, and both stacks of an
   encoder-decoder contribute theirs. A stage (generic container) beside other stages of
   blocks contributes its multi-level modules even when their class does not repeat
   (timm EfficientNet's first block).

Classes that Hugging Face itself checkpoints (subclasses of its ``GradientCheckpointingLayer``)
are taken as the blocks when a model has them.

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
from memfit.errors import ConfigError

__all__ = ["find_blocks", "resolve_blocks"]

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
            if len(group) > 1 and not any(_runs(self.sequence(g)) for g in group):
                self.opaque.update(id(g) for g in group)
                yield from group
            else:
                for g in group:
                    yield from self._items(g)
            i = j + 1

    def sequences(self) -> Iterator[list[nn.Module]]:
        for m in self.model.modules():
            if id(m) in self.roots or id(m) in self.opaque:
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
            # Note [bare layers are not blocks]
            # Two bare layers side by side as attributes (``self.fc1``, ``self.fc2``) are a
            # model's own layers, not repeated blocks; in a container they may be.
            if all(tree.height[id(m)] == 0 and id(m) in tree.attributes for m in run):
                continue
            found.setdefault(_kind_key(run[0]), []).extend(run)
    if not found:
        return set(), set()

    def tier(k: Any) -> int:
        return min(2, max(tree.height[id(m)] for m in found[k]))

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


def _stage_shape(tree: _Tree, kind: Any, inner_kinds: set[Any]) -> tuple[float, bool]:
    """The largest share of a ``kind`` module's content held by ``inner_kinds`` modules, and
    whether their number differs from one ``kind`` module to another."""
    shares, counts = [0.0], set()
    for _, m in _instances(tree.model, {kind}):
        # Bare layers (embeddings, norms, a down-sampling conv) are glue, not content.
        parts = [c for c in tree.sequence(m) if tree.height[id(c)] > 0]
        inner = [c for c in parts if _kind_key(c) in inner_kinds]
        shares.append(sum(tree.params[id(c)] for c in inner) / max(1, sum(tree.params[id(c)] for c in parts)))
        counts.add(len(inner))
    return max(shares), len(counts) > 1


def _select(tree: _Tree, top: set[Any], lower: set[Any]) -> set[Any]:
    # Note [stages and blocks]
    # A candidate is a stage when other candidates hold 90% of its content (a stage of
    # blocks after a small down-sampling layer). A block can also hold a run of smaller
    # candidates (MaxViT: a conv block, then window and grid attention), up to ~85% of it;
    # it differs from a stage by holding the same number of them everywhere, while stages
    # hold as many blocks as their depth, which differs from stage to stage. Blocks of one
    # level (timm MambaOut) rank below their stages by height: a lower-tier kind found only
    # inside a candidate, in varying numbers, makes the candidate a stage of them.
    kinds, stages = set(top), set()
    for k in top:
        share, varies = _stage_shape(tree, k, top - {k})
        if share >= _STAGE_SHARE or (share >= 0.5 and varies):
            stages.add(k)
            continue
        only_inside = {low for low in lower if _inside(tree, low, {k})[0] == _inside(tree, low, {k})[1]}
        share, varies = _stage_shape(tree, k, only_inside)
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


def find_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the model's repeated blocks, in module order.

    Args:
        model: any ``nn.Module``.

    Returns:
        Qualified module names, e.g. ``["blocks.0", "blocks.1"]``; empty if nothing repeats.

    Example:
        >>> seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        >>> find_blocks(seq)
        []
    """
    hf = hf_block_classes(model)
    if hf and sum(1 for m in model.modules() if type(m) in hf) > 1:
        return [n for n, _ in _instances(model, set(hf))]
    tree = _Tree(model)
    top, lower = _candidates(tree)
    if not top:
        return []
    blocks = _instances(model, _select(tree, top, lower))
    odd = _odd_blocks(tree, blocks)
    if not odd:
        return [n for n, _ in blocks]
    names = {n for n, _ in blocks} | {n for n, m in model.named_modules() if id(m) in odd}
    return [n for n, _ in model.named_modules() if n in names]


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
