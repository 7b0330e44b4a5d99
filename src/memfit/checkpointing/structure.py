"""What a module's own code says about it: a residual unit, a classifier head, a declared block.

:func:`~memfit.checkpointing.blocks.find_blocks` reads a model's module tree; some of what a
person sees when picking blocks is not in the tree but in the code: a residual unit adds its
input back in ``forward`` (a block of two sub-modules is a block, not a stage of two), a
classifier head ends in the model's class count (an auxiliary head beside the chain is not a
block), and Hugging Face models name the modules they keep whole (``_no_split_modules``).

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Residual(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = nn.Linear(4, 4)
    ...     def forward(self, x):
    ...         return x + self.fc(x)
    >>> adds_input_back(Residual), adds_input_back(nn.Sequential)
    (True, False)
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from torch import nn

__all__ = ["adapter_base", "adds_input_back", "declared_block_classes", "is_head"]

_RESIDUAL: dict[type, bool] = {}


def adds_input_back(cls: type[nn.Module]) -> bool:
    """Whether ``cls.forward`` adds its input (or a projection of it) back to what it computed.

    Read once per class from the source of ``forward``; ``False`` where there is none to read.
    """
    if cls not in _RESIDUAL:
        _RESIDUAL[cls] = _read_residual(cls)
    return _RESIDUAL[cls]


def _read_residual(cls: type[nn.Module]) -> bool:
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):  # builtin, generated or unreadable forward
        return False
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    args = fn.args.posonlyargs + fn.args.args
    if len(args) < 2:
        return False
    walker = _Residual(args[1].arg)
    walker.block(fn.body)
    return walker.found


class _Residual:
    """A walk of ``forward``'s statements in order, following the names that hold the input.

    See Note [residual units].
    """

    def __init__(self, name: str) -> None:
        self.identity = {name}  # the input itself, or a single-argument function of it
        self.tainted = {name}  # anything computed from the input
        self.found = False

    def block(self, body: list[ast.stmt]) -> None:
        for stmt in body:
            if self.found:
                return
            self.statement(stmt)

    def statement(self, stmt: ast.stmt) -> None:
        for node in ast.walk(stmt):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
                self.check(node.left, node.right)
            elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add):
                self.check(node.target, node.value)
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                self.assign(target, stmt.value)
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            self.assign(stmt.target, stmt.value)
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            call = stmt.value  # ``outs.append(y)``: the list now holds what y was computed from
            func = call.func
            receiver = func.value if isinstance(func, ast.Attribute) else None
            if isinstance(receiver, ast.Name) and any(self.uses(a) for a in call.args):
                self.tainted.add(receiver.id)
        elif isinstance(stmt, ast.For) and isinstance(stmt.target, ast.Name) and self.uses(stmt.iter):
            self.tainted.add(stmt.target.id)  # ``for chunk in x.chunk(2)``
        for field in ("body", "orelse", "finalbody"):
            inner = getattr(stmt, field, None)
            if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                self.block(inner)

    def assign(self, target: ast.expr, value: ast.expr) -> None:
        if not isinstance(target, ast.Name):
            return
        for names, holds in ((self.identity, self.is_identity(value)), (self.tainted, self.uses(value))):
            if holds:
                names.add(target.id)
            else:
                names.discard(target.id)

    def check(self, a: ast.expr, b: ast.expr) -> None:
        if self.uses(a) and self.uses(b) and (self.is_identity(a) or self.is_identity(b)):
            self.found = True

    def is_identity(self, e: ast.expr) -> bool:
        if isinstance(e, ast.Name):
            return e.id in self.identity
        if isinstance(e, ast.Call):
            return len(e.args) == 1 and not e.keywords and self.is_identity(e.args[0])
        if isinstance(e, ast.IfExp):
            return self.is_identity(e.body) or self.is_identity(e.orelse)
        return False

    def uses(self, e: ast.expr) -> bool:
        return any(isinstance(n, ast.Name) and n.id in self.tainted for n in ast.walk(e))


# Note [residual units]
# A residual unit adds its input back: ``x + f(x)``, ``shortcut = x; ...; x += shortcut``,
# ``out += self.identity(x)``. Read from ``forward``'s source, statement by statement: the
# input's name and names copied from it (or passed through one single-argument call, a
# shortcut projection or drop-path) are the identity; anything computed from the input is
# tainted. An addition of two tainted values, one of them the identity, is the residual
# connection. A stage (``x = self.downsample(x); x = self.blocks(x)``) adds nothing, a
# fusion of several inputs (HRNet's ``y = y + fuse(x[j])``) adds no identity, and a position
# embedding added to a stage's output is not computed from its input.


def adapter_base(module: nn.Module) -> nn.Module | None:
    """The layer an adapter wraps (peft's ``lora.Linear`` around a ``Linear``), else ``None``.

    See Note [adapters wrap a layer].

    Example:
        >>> adapter_base(nn.Linear(4, 4)) is None
        True
    """
    base = getattr(module, "base_layer", None)
    if isinstance(base, nn.Module) and hasattr(type(module), "adapter_layer_names"):
        return base
    return None


# Note [adapters wrap a layer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# peft replaces each targeted layer by a tuner layer that holds the original as
# ``base_layer`` beside its adapters (``lora_A``, ``lora_B``, ...), so the tree grows a level
# where the user's model has a bare layer. Block finding reads a tuner layer as the layer it
# wraps: ``self.fc1``/``self.fc2`` wrapped by LoRA are still a model's own two layers, not two
# repeated blocks, and adapters never change which blocks a model has.


def is_head(module: nn.Module, model: nn.Module) -> bool:
    """Whether ``module`` is a classifier head beside the model's own (an auxiliary classifier).

    It is one when its last layer with parameters is a ``Linear`` producing as many outputs as
    the model's last ``Linear`` (its classifier), and that classifier is not inside it. A
    residual unit is never one: it adds its input back, so its width is the stream's, which may
    equal the classes by chance (a byte-level GPT 256 wide).
    """
    final = _last_linear(model)
    if final is None or module is model or any(m is final for m in module.modules()):
        return False
    if adds_input_back(type(module)):
        return False
    leaves = [m for m in module.modules() if not list(m.children()) and any(True for _ in m.parameters())]
    last = leaves[-1] if leaves else None
    return isinstance(last, nn.Linear) and last.out_features == final.out_features


def _last_linear(model: nn.Module) -> nn.Linear | None:
    found = None
    for m in model.modules():
        if isinstance(m, nn.Linear):
            found = m
    return found


def declared_block_classes(model: nn.Module) -> set[type[nn.Module]]:
    """Classes of ``model``'s modules that it names in ``_no_split_modules`` (Hugging Face, timm)."""
    names: set[str] = set()
    for m in model.modules():
        declared = getattr(type(m), "_no_split_modules", None)
        if isinstance(declared, list | tuple | set):
            names.update(n for n in declared if isinstance(n, str))
    return {type(m) for m in model.modules() if type(m).__name__ in names}
