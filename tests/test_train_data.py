"""The byte corpus and its resumable samplers."""

from __future__ import annotations

import pytest
import torch

from memfit.app.data import BatchSampler, ByteCorpus, SyntheticBatches
from memfit.errors import ConfigError


def test_directory_of_text_files_is_read_sorted_and_split(tmp_path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_bytes(b"b" * 600)
    (tmp_path / "a.py").write_bytes(b"a" * 600)
    (tmp_path / "sub" / "c.md").write_bytes(b"c" * 600)
    (tmp_path / "skip.bin").write_bytes(b"x" * 600)
    corpus = ByteCorpus.load(tmp_path, val_fraction=0.25)
    data = bytes(corpus.train) + bytes(corpus.val)
    assert data == b"a" * 600 + b"\n" + b"b" * 600 + b"\n" + b"c" * 600
    assert len(corpus.val) == len(data) - int(len(data) * 0.75)


def test_missing_path_and_tiny_corpus_are_config_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        ByteCorpus.load(tmp_path / "nothing")
    (tmp_path / "small.txt").write_bytes(b"x" * 10)
    with pytest.raises(ConfigError, match="at least 1 KiB"):
        ByteCorpus.load(tmp_path / "small.txt")


def test_sampler_resumes_at_its_position() -> None:
    corpus = ByteCorpus.from_bytes(bytes(range(256)) * 20, val_fraction=0.1)
    a = BatchSampler(corpus.train, batch_size=3, seq_len=8, seed=5)
    stream = iter(a)
    first = [next(stream) for _ in range(4)]
    assert a.position == 4
    b = BatchSampler(corpus.train, batch_size=3, seq_len=8, seed=5)
    b.load_state_dict(a.state_dict())
    for _ in range(3):
        x_a, y_a = a.next_batch()
        x_b, y_b = b.next_batch()
        assert torch.equal(x_a, x_b) and torch.equal(y_a, y_b)
    x, y = first[0]
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(first[0][0], first[1][0])


def test_synthetic_batches_depend_only_on_seed_and_index() -> None:
    def make(bs: int, seed: int) -> torch.Tensor:
        return torch.randn(bs, 2, generator=torch.Generator().manual_seed(seed))

    a = SyntheticBatches(make, 4, seed=1)
    a.next_batch()
    b = SyntheticBatches(make, 4, seed=1)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.next_batch(), b.next_batch())
    assert torch.equal(a.batch_at(0), SyntheticBatches(make, 4, seed=1).next_batch())


def test_lr_schedule_works_for_any_number_of_steps() -> None:
    import torch

    from memfit.app.schedule import lr_schedule

    for steps in range(1, 40):
        for warm in (0, 1, max(1, steps // 20), steps):
            opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
            sched = lr_schedule(opt, steps, warmup_steps=warm)
            factors = [sched.lr_lambdas[0](s) for s in range(steps)]
            assert all(0.0 < f <= 1.0 + 1e-9 for f in factors), (steps, warm, factors)
