"""Budgets, the run config, records and the byte corpus: input handling and round trips."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from memfit.app.config import load_config
from memfit.app.data import BatchSampler, ByteCorpus
from memfit.budget import format_bytes, parse_bytes
from memfit.errors import ConfigError
from memfit.records import BlockStats, Plan, Profile


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1000, 1000),
        ("6GiB", 6 * 2**30),
        ("500MB", 500 * 10**6),
        ("1.5 GiB", 3 * 2**29),
        ("2g", 2 * 2**30),
        ("123", 123),
        ("60%", 600),
        ("100%", 1000),
    ],
)
def test_parse_bytes(value: int | str, expected: int) -> None:
    assert parse_bytes(value, reference=1000) == expected


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        ("abc", "cannot read budget 'abc'"),
        ("-1GB", "must be positive"),
        ("150%", "over 100%"),
        (0, "must be a positive number of bytes"),
        ("0", "must be positive"),
        ("5 parsecs", "cannot read budget"),
        (True, "must be a number of bytes"),
    ],
)
def test_parse_bytes_refuses(value: int | str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        parse_bytes(value, reference=1000)


def test_percentage_needs_a_reference() -> None:
    with pytest.raises(ConfigError, match="give bytes such as '6GiB' instead"):
        parse_bytes("50%")


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**29) == "1.50 GiB"


def test_config_file_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[model]\nn_layer = 3\n[memory]\nprecision = "bf16"\n[optimizer]\nlr = 1\n')
    cfg = load_config(path, ["model.n_embd=64", 'memory.checkpointing="every:2"'])
    assert (cfg.model.n_layer, cfg.model.n_embd) == (3, 64)
    assert cfg.memory.precision == "bf16" and cfg.memory.checkpointing == "every:2"
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["model.n_layers=2"], "unknown config key 'model.n_layers' \\(did you mean 'model.n_layer'\\?\\)"),
        (["modle.n_layer=2"], "unknown config section 'modle' \\(did you mean 'model'\\?\\)"),
        (["model.n_layer=two"], "model.n_layer must be int, got 'two'"),
        (["train.steps=0"], "train.steps must be at least 1"),
        (["memory.checkpointing=sometimes"], "is not one of none, selective, full, every:K, auto"),
        (["memory.checkpointing=auto"], "needs memory.budget"),
        (["train.batch_size=6", "train.grad_accum=4"], "must be divisible by train.grad_accum"),
        (["nokey"], "must look like section.key=value"),
    ],
)
def test_config_errors(overrides: list[str], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, overrides)


def test_config_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(bad)


def test_profile_and_plan_json_round_trip() -> None:
    block = BlockStats(
        name="blocks.0",
        param_bytes=10,
        saved_bytes={"none": 5, "full": 1},
        backward_seconds={"none": 0.5},
    )
    profile = Profile(
        precision="fp32",
        device="cpu",
        batch_size=2,
        blocks=[block, block],
        outside=BlockStats(name="outside"),
        param_bytes=20,
        grad_bytes=20,
        optimizer_bytes=40,
        optimizer_temp_bytes=3,
    )
    again = Profile.from_json(profile.to_json())
    assert again == profile and isinstance(again.blocks[0], BlockStats)
    plan = Plan(blocks={"blocks.0": "full"}, precision="bf16", micro_batches=2)
    assert Plan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="no field"):
        Plan.from_dict({"blocks": {}, "colour": "red"})


def test_corpus_split_and_resumable_sampler(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "b.txt").write_bytes(b"hello world " * 200)
    corpus = ByteCorpus.load(tmp_path, val_fraction=0.1)
    assert len(corpus.train) + len(corpus.val) == 256 * 8 + 1 + 12 * 200
    a = BatchSampler(corpus.train, batch_size=2, seq_len=16, seed=5)
    first = [a.next_batch() for _ in range(3)]
    b = BatchSampler(corpus.train, batch_size=2, seq_len=16, seed=5)
    b.load_state_dict({"position": 2, "seed": 5})
    x, y = b.next_batch()
    assert np.array_equal(x.numpy(), first[2][0].numpy())
    assert np.array_equal(y.numpy(), first[2][1].numpy())


def test_stdlib_corpus_is_real_text() -> None:
    corpus = ByteCorpus.load("stdlib", max_bytes=100_000)
    assert len(corpus.train) > 90_000
    assert b"def " in corpus.train.tobytes()


def test_missing_data_path() -> None:
    with pytest.raises(ConfigError, match=r"data path .* does not exist"):
        ByteCorpus.load("/no/such/dir")
