"""What torchao and torch print when a lever loads and first steps, held back unless memfit is verbose.

Issue 37: loading a lever printed ``Failed to load .../torchao/_C_mxfp8...so``, a torch
``register_constant`` deprecation line and an ``OptimState4bit`` UserWarning, which read like
errors. Each run is a fresh process (torchao is imported once per process).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchao", reason="the low-bit levers need torchao (memfit[levers])")

SRC = Path(__file__).resolve().parents[1] / "src"
#: A 4-bit AdamW lever optimizer, two steps, progress shown as plain lines on stderr.
SCRIPT = """
import torch
from memfit import progress
from memfit.levers.optim import lever_optimizer
progress.configure(quiet=False)
model = torch.nn.Linear(256, 256)
opt = lever_optimizer(torch.optim.AdamW(model.parameters()), "4bit", weights_bf16=False)
for _ in range(2):
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
print("stepped")
"""
#: torchao imported as the levers import it.
IMPORT = "from memfit.levers.quiet import import_torchao; import_torchao(); print('stepped')"
#: What dependencies print, which memfit holds back unless verbose.
NOISE = ("Failed to load", "register_constant", "_stable_hash_for_caching", "triton not found")


def _run(verbose: bool, script: str = SCRIPT) -> str:
    env = {**os.environ, "PYTHONPATH": str(SRC), "MEMFIT_VERBOSE": "1" if verbose else "0"}
    env.pop("MEMFIT_QUIET", None)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "stepped", done.stderr
    return done.stderr


def test_dependency_lines_are_held_back_and_memfit_says_what_matters() -> None:
    quiet, loud = _run(verbose=False), _run(verbose=True, script=IMPORT)
    assert not [line for line in quiet.splitlines() if any(n in line for n in NOISE)], quiet
    assert all(line.startswith("memfit: ") for line in quiet.splitlines()), quiet
    # the first step's compilation is announced, once, and said to be slow only the first time
    compiling = [line for line in quiet.splitlines() if "compiling torchao's AdamW4bit step" in line]
    assert compiling and all("(slow only on the first step)" in line for line in compiling), quiet
    start = (
        "memfit: compiling torchao's AdamW4bit step for each parameter shape (slow only on the first step)"
    )
    assert compiling[0] == start, quiet
    # prebuilt kernels that did not load: torchao's own lines with -v, one memfit line without
    failed = [line for line in loud.splitlines() if line.startswith("Failed to load")]
    said = [line for line in quiet.splitlines() if "prebuilt kernels" in line]
    assert len(said) == (1 if failed else 0), (quiet, loud)
    if failed:
        assert "did not load here" in said[0] and "memfit -v shows torchao's own lines" in said[0]
