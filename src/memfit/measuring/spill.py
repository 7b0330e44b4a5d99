"""Weights, gradients and optimizer state kept in a file while measuring runs, and read back
into the tensors they came from: a snapshot that costs no address space.

:func:`memfit.measuring.preserve.preserved` copies what a measurement may change and puts it
back afterwards. On a CPU whose address space is limited (``RLIMIT_AS``), those copies would
take room the measured steps need, and reading them back whole would need it again at the
end (while an exception's traceback may still hold a failed step's tensors). So each tensor's
bytes are written to a temporary file, and read back straight into the live tensor of the
same name and shape (``readinto``: no new allocation); only a tensor the body replaced or
resized is allocated anew. See Note [address space under RLIMIT_AS] in memfit/devices.py.

Trade-off: writing and reading the state costs a pass over it on disk (a fraction of a
second for hundreds of MiB), paid only under such a limit.

Example:
    >>> import torch
    >>> from torch import nn
    >>> m = nn.Linear(2, 2)
    >>> before = m.weight.detach().clone()
    >>> spillable(m, None)
    True
    >>> with spilled(m, None):
    ...     _ = m.weight.data.add_(1.0)
    >>> bool(torch.equal(m.weight, before))
    True
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Iterator
from typing import IO, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["spillable", "spilled"]


def _plain(t: torch.Tensor) -> bool:
    """A dense CPU tensor whose bytes can be written and read back in place (no subclass,
    such as torchao's low-bit optimizer state)."""
    return type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided and t.device.type == "cpu"


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What a measurement may change, as live tensors (nothing copied)."""
    return {
        "model": model.state_dict(),
        "grads": [p.grad for p in model.parameters()],
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
    }


def spillable(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether every tensor of the model's and optimizer's state can be spilled."""
    leaves, _ = tree_flatten(_state(model, optimizer))
    return all(_plain(t) for t in leaves if isinstance(t, torch.Tensor))


def _bytes(t: torch.Tensor) -> Any:
    """``t``'s bytes as a writable buffer (``t`` contiguous)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _write(f: IO[bytes], leaves: list[Any]) -> list[Any]:
    """Write every tensor's bytes; the leaves with each tensor replaced by its meta twin."""
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.numel():
                f.write(memoryview(_bytes(leaf.contiguous())))
            leaf = torch.empty_like(leaf, device="meta")
        out.append(leaf)
    return out


def _into(leaf: torch.Tensor, now: Any) -> torch.Tensor:
    """Where ``leaf``'s bytes go back: ``now`` where it is a contiguous plain tensor of the same
    shape and dtype, else a new tensor."""
    same = isinstance(now, torch.Tensor) and now.shape == leaf.shape and now.dtype == leaf.dtype
    if same and _plain(now) and now.is_contiguous():
        return now
    return torch.empty(leaf.shape, dtype=leaf.dtype)


def _read(f: io.BufferedReader, kept: list[Any], live: list[Any] | None) -> list[Any]:
    """The leaves back: each tensor read into its live counterpart where that has the same
    place, shape and dtype (and is contiguous), else into a new tensor."""
    out = []
    for i, leaf in enumerate(kept):
        if isinstance(leaf, torch.Tensor):
            now = _into(leaf, live[i] if live is not None else None)
            if leaf.numel():
                f.readinto(memoryview(_bytes(now.detach())))
            leaf = now
        out.append(leaf)
    return out


_Kept = dict[str, tuple[list[Any], Any]]


def _restored(f: io.BufferedReader, kept: _Kept, now: dict[str, Any]) -> dict[str, Any]:
    """Each part read back, into the live tensors where the part kept its structure."""
    back = {}
    for part, (leaves, spec) in kept.items():
        live, live_spec = tree_flatten(now[part])
        back[part] = tree_unflatten(_read(f, leaves, live if live_spec == spec else None), spec)
    return back


@contextlib.contextmanager
def spilled(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """Run the body with the model's weights, buffers and gradients and the optimizer's state
    kept in a temporary file, put back afterwards (:func:`spillable` must be True)."""
    state = _state(model, optimizer)
    metadata = getattr(state["model"], "_metadata", None)  # See _model_snapshot in preserve.py
    fd, path = tempfile.mkstemp(prefix="memfit-snapshot-", suffix=".bin")
    try:
        with os.fdopen(fd, "wb") as f:
            kept: _Kept = {}
            for part, tree in state.items():
                leaves, spec = tree_flatten(tree)
                kept[part] = (_write(f, leaves), spec)
        del state, leaves
        try:
            yield
        finally:
            with open(path, "rb") as f:
                back = _restored(f, kept, _state(model, optimizer))
            if metadata is not None:
                back["model"]._metadata = metadata
            _put_back(model, optimizer, back)
    finally:
        os.unlink(path)


def _put_back(model: nn.Module, optimizer: torch.optim.Optimizer | None, back: dict[str, Any]) -> None:
    """Load what was read back (a tensor read into its own place loads as itself)."""
    model.load_state_dict(back["model"])
    for p, g in zip(model.parameters(), back["grads"], strict=True):
        p.grad = g
    if optimizer is not None and back["optimizer"] is not None:
        optimizer.load_state_dict(back["optimizer"])
