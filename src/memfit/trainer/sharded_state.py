"""FSDP2 training state: each rank's shards via ``torch.distributed.checkpoint`` (DCP).

``state.pt`` (written by rank 0 with :func:`memfit.trainer.state.save_state`) holds what every
rank shares: step, RNG, scaler, schedule, data position, and the SHA-256 of every shard
file; ``state.dcp/`` holds the model and optimizer shards, written by all ranks together.
The pair rotates as one: the directory is written as ``state.dcp.tmp`` and renamed only
when every rank has finished, then the old pair becomes ``state.prev.pt`` / ``state.prev.dcp``.

Loading never runs code from the shards: every shard file must match the digest recorded
in the authenticated ``state.pt``, DCP's ``.metadata`` is read by an unpickler that only
builds DCP's own metadata records, and non-tensor items are read with ``weights_only``.

Trade-off: DCP writes one file per rank and needs every rank to save and load together,
but no rank ever gathers the whole model, so a model too big for one device saves fine;
DCP can also reshard when resuming on a different number of processes. Checking the
digests reads every shard file once more when resuming.

Example (inside a ``torchrun`` process with an FSDP2 model ``m`` and optimizer ``o``):
    ``save_sharded(m, o, Path("out/state.pt"), {"step": 3}, rank == 0)`` and later
    ``load_sharded(m, o, Path("out/state.pt"), load_state(Path("out/state.pt"))["shards"])``.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path, PurePath
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from memfit.errors import StateError
from memfit.trainer.state import file_digest, previous_path, save_state

__all__ = ["load_sharded", "save_sharded", "sharded", "shards_path"]

#: The only globals DCP's ``.metadata`` may name: its own records, sizes, dtypes, paths.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata records and nothing else (no function of the file's choosing runs)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in shard metadata")


class _SafeReader(FileSystemReader):
    """DCP's file reader with metadata read by :class:`_MetadataUnpickler`, files kept inside the folder."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as exc:
            raise StateError(f"the shard metadata {str(path)!r} is not DCP metadata ({exc}).") from None
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            rel = PurePath(str(getattr(info, "relative_path", "")))
            if len(rel.parts) != 1 or rel.name in ("", ".", ".."):
                raise StateError(f"the shard metadata {str(path)!r} names a file outside its folder: {rel}.")
        return _finish_metadata(metadata, self)


def _finish_metadata(metadata: Any, reader: FileSystemReader) -> Any:
    """What DCP's own ``read_metadata`` does after unpickling (storage meta with the load id)."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor items read by ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
            raise StateError(f"a shard item cannot be loaded safely (weights_only): {exc}") from None
        # DCP's own load_bytes places the item (nested keys and all) but reads it with
        # weights_only=False; it gets the item re-saved from what weights_only already built.
        super().load_bytes(read_item, _saved(loaded))


def _saved(obj: Any) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def sharded(model: nn.Module) -> bool:
    """Whether ``model`` was sharded with FSDP2's ``fully_shard`` (its state goes to DCP)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


def shards_path(path: str | os.PathLike[str]) -> Path:
    """The DCP directory that goes with a state file: ``state.pt`` -> ``state.dcp``."""
    return Path(path).with_suffix(".dcp")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: file_digest(p) for p in sorted(folder.iterdir()) if p.is_file()}


def save_sharded(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: str | os.PathLike[str],
    state: dict[str, Any],
    is_main: bool,
) -> Path:
    """Save model and optimizer shards with DCP and, on rank 0, ``state`` to ``path``.

    Every rank must call it at the same step. ``state`` gets ``"sharded": True`` and the
    digest of every shard file, so loading can check the shards against it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    target = shards_path(path)
    tmp = target.with_name(target.name + ".tmp")
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp))
    _barrier()
    if is_main:
        digests = _digests(tmp)
        prev = shards_path(previous_path(path))
        if target.exists():
            shutil.rmtree(prev, ignore_errors=True)
            os.replace(target, prev)
        os.replace(tmp, target)
        save_state({**state, "sharded": True, "shards": digests}, path)
    _barrier()
    return path


def load_sharded(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: str | os.PathLike[str],
    digests: dict[str, str] | None,
) -> None:
    """Load this rank's model and optimizer shards saved by :func:`save_sharded` next to ``path``.

    Args:
        digests: the ``"shards"`` entry of the (authenticated) state file: every shard file
            must have exactly this SHA-256, or nothing is read.

    Raises:
        StateError: the shards are missing, differ from what the state file recorded, or
            hold anything but DCP metadata, tensors and plain data.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    target = shards_path(path)
    if not target.is_dir():
        raise StateError(f"{str(path)!r} is an FSDP2 state but its shards {str(target)!r} are missing.")
    if not isinstance(digests, dict) or ".metadata" not in digests:
        raise StateError(
            f"{str(path)!r} records no digests of its shards, so they cannot be verified; start a new run."
        )
    found = _digests(target)
    changed = sorted(n for n in set(digests) | set(found) if digests.get(n) != found.get(n))
    if changed:
        raise StateError(
            f"the shards in {str(target)!r} are not the ones {str(path)!r} was saved with "
            f"({', '.join(changed[:3])} differ); they were changed or damaged."
        )
    from torch.distributed.checkpoint.api import CheckpointException

    reader = _SafeReader(target)
    reader.read_metadata()  # refused here in one sentence, before DCP wraps the error
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # DCP loads in place into the tensors of these dicts.
    try:
        dcp.load({"model": model_sd, "optimizer": optim_sd}, storage_reader=reader, planner=_SafePlanner())
    except CheckpointException as exc:
        last = [line for line in str(exc).strip().splitlines() if line.strip()][-1:] or [type(exc).__name__]
        raise StateError(f"the shards in {str(target)!r} cannot be loaded: {last[0].strip()[:300]}") from None
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
