"""Training-state files: atomic writes, checksums, weights_only loading, RNG capture."""

from __future__ import annotations

import os
import random
import struct

import numpy as np
import pytest
import torch

from memfit.errors import StateError
from memfit.trainer import state as state_mod
from memfit.trainer.state import capture_rng, load_state, previous_path, restore_rng, save_state, verify_state


def _state(step: int) -> dict:
    return {"step": step, "w": torch.full((64,), float(step)), "nested": {"xs": [1, 2.5, "a"]}}


def test_round_trip_and_previous_kept(tmp_path) -> None:
    path = tmp_path / "state.pt"
    save_state(_state(1), path)
    save_state(_state(2), path)
    loaded = load_state(path)
    assert loaded["step"] == 2 and loaded["nested"] == {"xs": [1, 2.5, "a"]}
    torch.testing.assert_close(loaded["w"], torch.full((64,), 2.0), rtol=0, atol=0)
    assert previous_path(path).name == "state.prev.pt"
    assert load_state(previous_path(path))["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.prev.pt", "state.pt"]


def test_truncated_file_refused_and_previous_intact(tmp_path) -> None:
    path = tmp_path / "state.pt"
    save_state(_state(1), path)
    save_state(_state(2), path)
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(StateError) as err:
        load_state(path)
    message = str(err.value)
    assert "truncated" in message and "state.prev.pt" in message and "intact" in message
    assert "\n" not in message
    assert verify_state(previous_path(path))
    assert load_state(previous_path(path))["step"] == 1


def test_flipped_byte_fails_checksum(tmp_path) -> None:
    path = save_state(_state(3), tmp_path / "state.pt")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StateError, match="checksum"):
        load_state(path)


def test_other_files_and_missing_files_refused(tmp_path) -> None:
    plain = tmp_path / "plain.pt"
    torch.save({"a": 1}, plain)
    with pytest.raises(StateError, match="not a memfit training state"):
        load_state(plain)
    with pytest.raises(StateError, match="does not exist"):
        load_state(tmp_path / "nope.pt")


class _Evil:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("echo should-not-run",))


def test_pickled_code_is_not_executed(tmp_path) -> None:
    """A file with a valid checksum (made with this user's key) but a pickled callable is
    refused by weights_only."""
    import io

    buf = io.BytesIO()
    torch.save({"x": _Evil()}, buf)
    payload = buf.getvalue()
    path = tmp_path / "state.pt"
    path.write_bytes(
        state_mod._MAGIC
        + struct.pack("<Q", len(payload))
        + state_mod._mac(state_mod.state_key(), payload)
        + payload
    )
    with pytest.raises(StateError, match="weights_only"):
        load_state(path)


def test_crash_during_write_keeps_the_old_file(tmp_path, monkeypatch) -> None:
    path = save_state(_state(1), tmp_path / "state.pt")

    def _boom(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(state_mod.os, "fsync", _boom)
    with pytest.raises(OSError, match="disk full"):
        save_state(_state(2), path)
    monkeypatch.undo()
    assert load_state(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]  # no temporary file left behind


def test_rng_capture_and_restore() -> None:
    saved = capture_rng()
    first = (torch.rand(3), np.random.rand(3), random.random())
    restore_rng(saved)
    again = (torch.rand(3), np.random.rand(3), random.random())
    torch.testing.assert_close(first[0], again[0], rtol=0, atol=0)
    np.testing.assert_array_equal(first[1], again[1])
    assert first[2] == again[2]


def test_rng_state_survives_a_state_file(tmp_path) -> None:
    path = save_state({"rng": capture_rng()}, tmp_path / "s.pt")
    expected = (torch.randn(2), np.random.randn(2), random.gauss(0, 1))
    restore_rng(load_state(path)["rng"])
    torch.testing.assert_close(torch.randn(2), expected[0], rtol=0, atol=0)
    np.testing.assert_array_equal(np.random.randn(2), expected[1])
    assert random.gauss(0, 1) == expected[2]
