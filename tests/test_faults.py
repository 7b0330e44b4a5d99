"""Issue 15, cases 1, 4 and 5: nothing loaded from disk runs code, a run whose directory
turns unwritable keeps its state and says where, and an fp16 run that diverges stops."""

from __future__ import annotations

import io
import os
import pickle
import shlex
import struct
from pathlib import Path

import pytest
import torch

from memfit.app.data import BatchSampler, ByteCorpus
from memfit.cli.main import main
from memfit.errors import StateError
from memfit.models.gpt import gpt_loss
from memfit.trainer import sharded_state
from memfit.trainer import state as state_mod
from memfit.trainer.callbacks import SaveState, read_metrics
from memfit.trainer.sharded_state import load_sharded, save_sharded
from memfit.trainer.state import load_state, save_state
from memfit.trainer.trainer import Trainer

TINY = [
    "--set", "model.n_layer=2", "--set", "model.n_embd=16", "--set", "model.n_head=2",
    "--set", "model.block_size=8", "--set", "train.batch_size=4", "--set", "data.max_bytes=20000",
]  # fmt: skip


class _Payload:
    """Pickled, it runs ``open(marker, "w")`` when unpickled: the proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (str(self.marker), "w"))


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _sharded(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    model, opt = _model()
    path = tmp_path / "state.pt"
    with pytest.warns(UserWarning):  # DCP: "assuming the intent is to save in a single process"
        save_sharded(model, opt, path, {"step": 3}, is_main=True)
    return path, model


# -- case 1: loading never runs code --------------------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_state_round_trips_with_verified_shards(tmp_path: Path) -> None:
    path, model = _sharded(tmp_path)
    state = load_state(path)
    assert state["sharded"] and ".metadata" in state["shards"]
    fresh, fresh_opt = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    load_sharded(fresh, fresh_opt, path, state["shards"])
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_crafted_dcp_metadata_runs_no_code(tmp_path: Path) -> None:
    path, _ = _sharded(tmp_path)
    marker = tmp_path / "code-ran"
    (tmp_path / "state.dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    fresh, opt = _model()
    trainer = Trainer(fresh, opt, lambda m, b: m(b).sum(), "fp32", progress=False)
    with pytest.raises(StateError, match="not the ones"):
        trainer.load(path)  # the digest recorded in the authenticated state.pt does not match
    assert not marker.exists()
    # even with the digests forged to match (someone holding the key), nothing is unpickled
    state = load_state(path)
    state["shards"][".metadata"] = state_mod.file_digest(tmp_path / "state.dcp" / ".metadata")
    save_state(state, path, keep_previous=False)
    with pytest.raises(StateError, match="is not DCP metadata"):
        trainer.load(path)
    assert not marker.exists()


def test_shard_items_are_read_with_weights_only(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    buffer = io.BytesIO()
    torch.save({"x": _Payload(marker)}, buffer)
    buffer.seek(0)
    with pytest.raises(StateError, match="weights_only"):
        sharded_state._SafePlanner().load_bytes(None, buffer)
    assert not marker.exists()


def test_a_state_file_forged_without_the_key_is_refused(tmp_path: Path) -> None:
    """The old unkeyed SHA-256 let anyone mark a state as sharded; the HMAC needs the key."""
    import hashlib

    buffer = io.BytesIO()
    torch.save({"format": "memfit-training-state", "step": 1, "sharded": True}, buffer)
    payload = buffer.getvalue()
    path = tmp_path / "state.pt"
    path.write_bytes(
        state_mod._MAGIC + struct.pack("<Q", len(payload)) + hashlib.sha256(payload).digest() + payload
    )
    with pytest.raises(StateError, match="not written with this user's state key"):
        load_state(path)


def test_another_users_key_does_not_authenticate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = save_state({"step": 1}, tmp_path / "state.pt")
    monkeypatch.setenv(state_mod.KEY_ENV, str(tmp_path / "other.key"))
    with pytest.raises(StateError, match=r"state key .* does not exist"):
        load_state(path)
    save_state({"step": 2}, tmp_path / "mine.pt")  # creates the other key
    with pytest.raises(StateError, match="not written with this user's state key"):
        load_state(path)
    assert (tmp_path / "other.key").stat().st_mode & 0o077 == 0  # readable by its owner only


def test_a_killed_save_leaves_no_temporary_file_behind(tmp_path: Path) -> None:
    stale = tmp_path / ".state.pt.abc123.tmp"
    stale.write_bytes(b"half a state")
    save_state({"step": 1}, tmp_path / "state.pt")
    assert not stale.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["state.pt"]


# -- case 4: the directory turns unwritable mid-run -----------------------------------------


def _fail_writes_from(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    """A fault hook standing in for ``chmod 555 DIRECTORY`` (which does not stop root); the
    rescue folder goes to the test's own temporary directory."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(directory.parent))
    real = tempfile.mkstemp

    def mkstemp(*args: object, **kwargs: object) -> tuple[int, str]:
        if Path(str(kwargs.get("dir", ""))) == directory:
            raise PermissionError(13, "Permission denied", str(directory))
        return real(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(state_mod.tempfile, "mkstemp", mkstemp)


def test_trainer_keeps_the_state_elsewhere_when_its_directory_turns_unwritable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    corpus = ByteCorpus.from_bytes(bytes(range(256)) * 40)
    sampler = BatchSampler(corpus.train, batch_size=2, seq_len=8, seed=0)
    from conftest import tiny_gpt

    model = tiny_gpt(n_layer=1)
    saver = SaveState(out / "state.pt", every=2, data=sampler)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters()), gpt_loss, "fp32", callbacks=[saver],
                      progress=False, track_memory=False)  # fmt: skip
    trainer.fit(sampler, steps=2)
    _fail_writes_from(monkeypatch, out)
    with pytest.raises(StateError) as info:
        trainer.fit(sampler, steps=4)
    message = str(info.value)
    assert "cannot write the training state" in message and "Permission denied" in message
    rescue = Path(message.split("was saved to ", 1)[1].split("'")[1])
    assert load_state(rescue)["step"] == 4 == trainer.step_count
    assert load_state(out / "state.pt")["step"] == 2  # the last state in the directory is intact
    weights = trainer.model.state_dict()
    for key, value in load_state(rescue)["model"].items():
        torch.testing.assert_close(value, weights[key], rtol=0, atol=0)


def test_memfit_train_in_a_directory_that_turns_unwritable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--quiet", *TINY, "--set", "train.steps=6", "--set", "train.checkpoint_every=2",
            "--set", f"train.out='{out}'"]  # fmt: skip
    import memfit.trainer.callbacks as callbacks

    on_step_end = SaveState.on_step_end

    def then_chmod(self: SaveState, trainer: Trainer, metrics: object) -> None:
        if trainer.step_count == 3:
            _fail_writes_from(monkeypatch, out)  # between the saves of step 2 and step 4
        on_step_end(self, trainer, metrics)  # type: ignore[arg-type]

    monkeypatch.setattr(callbacks.SaveState, "on_step_end", then_chmod)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0] and "cannot write the training state" in err[0]
    command = err[0][err[0].index("resume with ") + len("resume with ") : -1]
    monkeypatch.undo()  # the directory is writable again
    assert load_state(out / "state.pt")["step"] == 2
    assert main([*shlex.split(command)[1:], "--quiet"]) == 0  # the printed command, as printed
    assert [m.step for m in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert load_state(out / "state.pt")["step"] == 6


# -- case 5: fp16 divergence is not a success -----------------------------------------------


@pytest.mark.slow
def test_fp16_divergence_stops_names_the_module_and_keeps_last_good(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--quiet", *TINY, "--set", "optimizer.lr=1e6", "--set", "memory.precision='fp16'",
            "--set", "train.steps=30", "--set", f"train.out='{out}'"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fp16 training stopped at step" in err[0]
    assert "forward pass of module 'blocks." in err[0] and "last-good.pt" in err[0]
    good = load_state(out / "last-good.pt")
    assert good["step"] >= 1 and all(torch.isfinite(v).all() for v in good["model"].values())
    assert not os.path.exists(out / "state.pt") or load_state(out / "state.pt")["step"] == good["step"]
