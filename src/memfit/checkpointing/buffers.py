"""The buffers a checkpointed block's forward writes: written once per step, whatever the checkpointing.

A recompute runs the block's forward again, and with it every write the forward makes into
the block's buffers: BatchNorm's and InstanceNorm's running statistics, spectral norm's
power iteration, a step counter, an exponential moving average. :class:`WrittenBuffers`
finds those buffers generically, while the forward runs, and makes the recompute leave
them as it found them, and start from what the forward saw where the forward reads them.

See Note [buffers a forward writes]

Example:
    >>> import torch
    >>> from torch import nn
    >>> import memfit
    >>> model = memfit.checkpoint(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)),
    ...                           blocks=["1"])
    >>> model(torch.randn(8, 4)).sum().backward()  # the recompute updates nothing a second time
    >>> int(model[1].num_batches_tracked)
    1
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.checkpointing.writes import (
    arg_tensors,
    learn_hidden,
    learned_hidden,
    storage_key,
    values_unknown,
    written_by,
)
from memfit.errors import CheckpointError

__all__ = ["WrittenBuffers", "buffer_contexts"]

# Note [buffers a forward writes]
# A buffer counts as written by a block's forward when an op writes into its storage (the
# op's schema says so, or see Note [writes an op does not declare]), when its version
# counter moves, or when the forward assigns a new tensor to it. Nothing is listed by module
# class: BatchNorm's running statistics are one case of the rule, as are InstanceNorm's
# (track_running_stats), spectral norm's power iteration, a step counter and an EMA.
#
# After the recompute, every written buffer is put back to what it held before the
# recompute (a copy made when the recompute starts, freed when it ends): the forward wrote
# it once, and the recompute writes nothing.
#
# Where the forward also reads a written buffer (spectral norm computes sigma from the
# vectors it just updated; a counter scales the output), the recompute must start from the
# value the forward started from, so a copy of it is kept from the first write until the
# block's graph is freed. Whether a forward reads it is only known once the forward has run,
# so the first call of a block copies every buffer just before its first write and keeps
# only the copies it needed; later calls remember the answer per buffer, and copy a buffer
# known to be written only if the forward reads it before writing it. A forward that reads
# such a buffer after writing it, uncopied (its code changed course), cannot be recomputed
# exactly: its recompute refuses with a CheckpointError, and the next call copies it.
# Buffers nobody reads (BatchNorm's running statistics in training) cost nothing more than
# before.

_WRITTEN = "written"
_READ = "read"
#: Per block (a module, or a segment's module list): per buffer, whether the forward only
#: writes it or also reads it.
_LEARNED: weakref.WeakKeyDictionary[nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()


@dataclass
class _Slot:
    qual: str
    owner: nn.Module
    name: str
    tensor: torch.Tensor
    version: int


@dataclass
class _Written:
    """A buffer the forward wrote, and what the recompute starts it from (None: as it is then)."""

    owner: nn.Module
    name: str
    reassigned: bool
    before: torch.Tensor | None


def _slots(module: nn.Module) -> list[_Slot]:
    return [
        _Slot(f"{prefix}.{name}" if prefix else name, owner, name, t, t._version)
        for prefix, owner in module.named_modules()
        for name, t in owner._buffers.items()
        if t is not None
    ]


class WrittenBuffers:
    """What one forward of a block does to its buffers, and how its recompute undoes it.

    The forward's watch calls :meth:`before_op`, :meth:`before_write` and :meth:`after_probe`
    around its ops and :meth:`finish` at its end; each recompute runs inside :meth:`recompute`.
    """

    def __init__(self, module: nn.Module, label: str) -> None:
        self.module, self.label = module, label
        self.slots = _slots(module)
        self.storages: dict[int, list[int]] = {}
        """Storage -> buffers in it (empty once the forward finished, or for a block without buffers)."""
        for i, s in enumerate(self.slots):
            key = storage_key(s.tensor)
            if key is not None:
                self.storages.setdefault(key, []).append(i)
        self.learned = _LEARNED.get(module, {})
        self.reads: set[int] = set()
        self.copies: dict[int, torch.Tensor] = {}
        self.uncopied: set[int] = set()
        self.written: list[_Written] = []
        self.inexact: list[str] = []

    def _read(self, slots: list[int]) -> None:
        for i in slots:
            if i in self.uncopied and self.slots[i].qual not in self.inexact:
                self.inexact.append(self.slots[i].qual)
            self.reads.add(i)

    def before_op(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], written: list[torch.Tensor]
    ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Record the buffers ``func`` reads; return the copies to compare after it runs, for the
        buffers it may write without declaring it (see Note [writes an op does not declare])."""
        probes: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        if not self.storages:
            return probes
        skip = {storage_key(t) for t in written}
        for pos, t in arg_tensors(args, kwargs):
            key = storage_key(t)
            slots = self.storages.get(key) if key is not None else None
            if slots is None or key in skip:
                continue
            # See Note [hidden writes without values]: what has no values is not compared
            if pos >= 0 and learned_hidden(func, args) is None and not values_unknown(t):
                with torch.no_grad():
                    probes.append((pos, t, t.detach().clone()))
            else:
                self._read(slots)
        return probes

    def after_probe(
        self, func: Any, args: tuple[Any, ...], probes: list[tuple[int, torch.Tensor, Any]]
    ) -> None:
        """Compare what ``func`` may have written; remember for the op what it did."""
        changed = []
        for pos, t, before in probes:
            key = storage_key(t)
            slots = self.storages.get(key, []) if key is not None else []
            if torch.equal(before, t):
                self._read(slots)
                continue
            changed.append(pos)
            for i in slots:
                if i in self.copies or i in self.uncopied:
                    continue
                if self.slots[i].tensor is t:
                    self.copies[i] = before  # the value before the op: what a recompute starts from
                else:
                    self.uncopied.add(i)  # written through a view: its earlier value is gone
        learn_hidden(func, args, tuple(sorted(set(changed))))

    def before_write(self, key: int) -> None:
        """An op is about to write into storage ``key``: copy a buffer there if its value may be needed."""
        for i in self.storages.get(key, ()):
            if i in self.copies or i in self.uncopied:
                continue
            if self.learned.get(self.slots[i].qual) == _WRITTEN and i not in self.reads:
                self.uncopied.add(i)
                continue
            with torch.no_grad():
                self.copies[i] = self.slots[i].tensor.detach().clone()

    def finish(self) -> None:
        """The forward ended: decide, per written buffer, what each recompute starts it from."""
        for i, s in enumerate(self.slots):
            reassigned = s.owner._buffers.get(s.name) is not s.tensor
            if s.tensor._version != s.version and i not in self.copies:
                self.uncopied.add(i)  # a write the watch did not see (outside any op it watched)
            if not (reassigned or i in self.copies or i in self.uncopied):
                continue
            needs = i in self.reads
            before = self.copies.get(i)
            if before is None and reassigned and i not in self.uncopied:
                before = s.tensor  # the forward replaced it and never wrote into it
            if needs and before is None and s.qual not in self.inexact:
                self.inexact.append(s.qual)
            self.learned[s.qual] = _READ if needs or self.learned.get(s.qual) == _READ else _WRITTEN
            self.written.append(_Written(s.owner, s.name, reassigned, before if needs else None))
        _LEARNED[self.module] = self.learned
        self.slots, self.storages, self.copies, self.reads, self.uncopied = [], {}, {}, set(), set()

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        """Around one recompute: start each written buffer from what the forward saw where it
        reads it, and put every written buffer back afterwards."""
        if self.inexact:
            raise CheckpointError(
                f"the checkpointed block {self.label} read its buffer {self.inexact[0]!r} after writing it, "
                "which its earlier calls did not do, so its recompute cannot start from the value the "
                "forward saw; run the step again (memfit now keeps that buffer's earlier value)."
            )
        saved: list[tuple[_Written, torch.Tensor, torch.Tensor | None]] = []
        with torch.no_grad():
            for w in self.written:
                now = w.owner._buffers.get(w.name)
                if now is None:
                    continue
                saved.append((w, now, None if w.reassigned else now.clone()))
                if w.before is not None and w.reassigned:
                    w.owner._buffers[w.name] = w.before.clone()
                elif w.before is not None:
                    now.copy_(w.before)
        try:
            yield
        finally:
            with torch.no_grad():
                for w, now, value in saved:
                    if value is None:
                        w.owner._buffers[w.name] = now
                    else:
                        now.copy_(value)


class _BufferWatch(TorchDispatchMode):
    """Forward: the buffer rule alone, for a caller that runs ``torch.utils.checkpoint`` itself."""

    def __init__(self, buffers: WrittenBuffers) -> None:
        super().__init__()
        self.buffers = buffers

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        probes = None
        if self.buffers.storages:
            written = written_by(func, args, kwargs)
            probes = self.buffers.before_op(func, args, kwargs, written)
            for t in written:
                key = storage_key(t)
                if key is not None:
                    self.buffers.before_write(key)
        out = func(*args, **kwargs)
        if probes:
            self.buffers.after_probe(func, args, probes)
        return out

    def __exit__(self, *exc: Any) -> Any:
        out = super().__exit__(*exc)
        if exc[0] is None:
            self.buffers.finish()
        return out


class _EachRecompute:
    """The recompute context, entered once per recompute (a graph backwarded more than once)."""

    def __init__(self, buffers: WrittenBuffers) -> None:
        self.buffers = buffers
        self._open: list[Any] = []

    def __enter__(self) -> None:
        context = self.buffers.recompute()
        context.__enter__()  # may refuse (a CheckpointError): then nothing stays open
        self._open.append(context)

    def __exit__(self, *exc: Any) -> Any:
        return self._open.pop().__exit__(*exc)


def buffer_contexts(module: nn.Module, label: str | None = None) -> tuple[Any, Any]:
    """(forward, recompute) contexts that apply the buffer rule to one ``torch.utils.checkpoint``
    call of ``module`` (see Note [buffers a forward writes])."""
    buffers = WrittenBuffers(module, label or type(module).__name__)
    return _BufferWatch(buffers), _EachRecompute(buffers)
