"""``memfit plan`` in a log: progress lines on stderr while it works, none on stdout, none when quiet.

Issue 28's acceptance: ``memfit plan --budget 60%`` prints at least three progress lines to
stderr while it works when stderr is a file. The command runs as a user runs it, in its own
process (``python -m memfit``), with stderr written to a file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

#: A GPT small enough to plan in seconds, whose activations are most of its 60% budget.
TINY = [
    "--set", "model.n_layer=2", "--set", "model.n_embd=32", "--set", "model.n_head=2",
    "--set", "model.block_size=64", "--set", "train.batch_size=8",
]  # fmt: skip


def _plan(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """``python -m memfit plan --budget 60% ...`` with stderr to a file: the run and its stderr lines."""
    full = {k: v for k, v in os.environ.items() if k != "MEMFIT_QUIET"}
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    full |= {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", **env}
    err = tmp_path / "stderr.log"
    argv = ["plan", "--budget", "60%", "--precision", "fp32", *TINY, "--out", str(tmp_path / "plan.json")]
    with err.open("w") as log:
        done = subprocess.run(
            [sys.executable, "-m", "memfit", *argv],
            stdout=subprocess.PIPE, stderr=log, text=True, timeout=600, env=full, cwd=tmp_path,
        )  # fmt: skip
    return done, err.read_text().splitlines()


def test_memfit_plan_prints_progress_lines_to_a_log(tmp_path: Path) -> None:
    done, err = _plan(tmp_path)
    assert done.returncode == 0, "\n".join(err)
    # on a busy machine the first seconds (importing torch, ...) say so every 5 s until planning speaks
    setting_up = [line for line in err if "importing torch and setting up" in line]
    assert all(
        re.fullmatch(r"memfit: plan: importing torch and setting up \(.* s so far\)", ln) for ln in setting_up
    )
    progress = [line for line in err if line.startswith("memfit: ") and line not in setting_up]
    assert len(progress) >= 3, err
    assert progress[0].startswith("memfit: planning a batch of 8 for 60% (fp32)")
    assert err[: len(setting_up)] == setting_up, err  # only before the command's own first line
    assert any(line.startswith("memfit: timing blocks.0 alone: 0/8") for line in progress), err
    assert any("measuring the chosen plan" in line for line in progress), err
    assert "\r" not in "".join(err)  # plain lines, no bar redrawn in place
    assert (tmp_path / "plan.json").exists()
    assert "memfit: " not in done.stdout and "timing" not in done.stdout  # stdout carries the plan only
    assert "blocks.0" in done.stdout


def test_memfit_quiet_silences_progress(tmp_path: Path) -> None:
    done, err = _plan(tmp_path, MEMFIT_QUIET="1")
    assert done.returncode == 0, "\n".join(err)
    assert err == []
    assert (tmp_path / "plan.json").exists() and "memfit: " not in done.stdout
