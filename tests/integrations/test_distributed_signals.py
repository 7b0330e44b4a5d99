"""Issue 26, case 1 under torchrun: SIGTERM to one rank stops every rank after the same step,
the state of that step is saved, and ``--resume`` under torchrun finishes the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memfit.trainer.callbacks import read_metrics
from memfit.trainer.state import load_state

TESTS = Path(__file__).parent.parent
STEPS = 20
CONFIG = """
[model]
name = "import:slow_gpt:build"
kwargs = {{ seq_len = 16, dropout = 0.0 }}
[data]
path = "{data}"
val_fraction = 0.1
[train]
batch_size = 4
steps = {steps}
eval_every = 0
eval_batches = 1
checkpoint_every = 100
device = "cpu"
distributed = "ddp"
out = "{out}"
"""

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available in this build",
)


def _worker_of_rank(agent: int, rank: int) -> int | None:
    """The pid of the torchrun worker whose parent is ``agent`` and whose LOCAL_RANK is ``rank``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0") if ppid == agent else []
        except (OSError, IndexError, ValueError):
            continue
        if f"LOCAL_RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def _torchrun(config: Path, *extra: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           "-m", "memfit", "train", str(config), "--quiet", *extra]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the workers through /proc")
def test_sigterm_to_one_rank_stops_all_after_the_same_step(tmp_path: Path) -> None:
    data = tmp_path / "corpus.txt"
    data.write_bytes(b"\n".join(p.read_bytes() for p in sorted(Path(os.__file__).parent.glob("a*.py"))))
    out = tmp_path / "out"
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.format(data=data, out=out, steps=STEPS), encoding="utf-8")
    agent = _torchrun(config)
    try:
        deadline = time.monotonic() + 180
        # rank 1's worker is found before the steps are watched: on a busy machine, scanning
        # /proc between step 3 and the signal once let the run finish first
        while (worker := _worker_of_rank(agent.pid, 1)) is None:
            assert agent.poll() is None and time.monotonic() < deadline, "no worker of rank 1 started"
            time.sleep(0.02)
        while not (read_metrics(out / "metrics.jsonl") and read_metrics(out / "metrics.jsonl")[-1].step >= 3):
            assert agent.poll() is None and time.monotonic() < deadline, "the run ended before the signal"
            time.sleep(0.02)
        os.kill(worker, signal.SIGTERM)  # rank 1 only; rank 0 learns it at the end of the step
        _, err = agent.communicate(timeout=180)
    finally:
        if agent.poll() is None:
            agent.kill()
    saved = load_state(out / "state.pt")["step"]
    assert saved == read_metrics(out / "metrics.jsonl")[-1].step < STEPS
    assert err.count(f"memfit train: terminated (SIGTERM) after step {saved}; its state is saved in") == 1
    resumed = _torchrun(config, "--resume")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert [m.step for m in read_metrics(out / "metrics.jsonl")] == list(range(1, STEPS + 1))
