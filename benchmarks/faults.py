"""The fault table of issue 15: each bad-input and fault case run as a user would type it.

Every case runs ``memfit`` in a fresh process (a few need a fault hook: this machine's
sessions run as root, where ``chmod 555`` stops nothing and a real memory limit needs the
rlimit test). A row says what happened (exit code, the one line on stderr, what was on
disk afterwards) and what was lost. Any traceback fails the script.

Usage: .venv/bin/python benchmarks/faults.py > table.md      (about 2-3 minutes on 2 cores)
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = (
    "--set model.n_layer=2 --set model.n_embd=16 --set model.n_head=2 --set model.block_size=8 "
    "--set train.batch_size=4 --set data.max_bytes=20000"
)
CASES: list[tuple[str, Callable[[Path], tuple[str, str]]]] = []


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MEMFIT_QUIET": "1"}


def _run(args: list[str], cwd: Path) -> tuple[int, str, str]:
    env = {**_env(), "TMPDIR": str(cwd)}  # NOTE: a rescue folder stays in the case's directory
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if "Traceback" in done.stderr:
        raise SystemExit(f"TRACEBACK in {args}:\n{done.stderr[-3000:]}")
    return done.returncode, done.stdout, done.stderr.strip()


def memfit(command: str, cwd: Path) -> tuple[int, str, str]:
    return _run([sys.executable, "-m", "memfit.cli.main", *shlex.split(command)], cwd)


def python(code: str, cwd: Path) -> tuple[int, str, str]:
    return _run([sys.executable, "-c", code], cwd)


def _said(rc: int, err: str) -> str:
    lines = err.splitlines()
    line = lines[-1] if lines else ""
    line = line if len(line) <= 230 else line[:227] + "..."
    return f"exit {rc}, {len(lines)} line: `{line}`".replace("|", "\\|")


def case(name: str) -> Callable[[Callable[[Path], tuple[str, str]]], None]:
    """Register a case: ``fn(empty_directory) -> (what happened, data lost)``."""

    def register(fn: Callable[[Path], tuple[str, str]]) -> None:
        CASES.append((name, fn))

    return register


# -- 1. code from a state directory --------------------------------------------------------

CRAFT = """
import pickle, torch, warnings
from pathlib import Path
from memfit.trainer.sharded_state import save_sharded
from memfit.trainer.trainer import Trainer
warnings.simplefilter("ignore")
m = torch.nn.Linear(4, 4); o = torch.optim.AdamW(m.parameters())
save_sharded(m, o, Path("state.pt"), {"step": 1}, True)
class P:
    def __reduce__(self): return (open, ("code-ran", "w"))
Path("state.dcp/.metadata").write_bytes(pickle.dumps(P()))
from memfit.errors import MemfitError
from memfit.trainer.state import load_state, save_state, file_digest
t = Trainer(m, o, lambda mm, b: mm(b).sum(), "fp32", progress=False)
for forge in (False, True):
    if forge:  # someone holding the key also fixes the digest
        s = load_state("state.pt"); s["shards"][".metadata"] = file_digest("state.dcp/.metadata")
        save_state(s, "state.pt", keep_previous=False)
    try:
        t.load("state.pt")
    except MemfitError as e:
        print(type(e).__name__ + ": " + str(e))
print("code ran" if Path("code-ran").exists() else "no code ran")
"""


@case("1. `state.dcp/.metadata` replaced by a pickle that runs code")
def _(d: Path) -> tuple[str, str]:
    _, out, _ = python(CRAFT, d)
    lines = out.strip().splitlines()
    what = f"refused twice: `{lines[0][:110]}...`; with the digest forged: `{lines[1][:90]}...`; {lines[2]}"
    return what, "none (no code ran)"


# -- 2. values that passed validation ------------------------------------------------------

for setting in (
    "optimizer.lr=nan",
    "train.seed=-1",
    "train.seed=1e20",
    "train.seed=100000000000000000000",
    "optimizer.eps=-1",
    "optimizer.weight_decay=nan",
    "train.device='cuda'",
):

    @case(f"2. `memfit train --set {setting}`")
    def _(d: Path, setting: str = setting) -> tuple[str, str]:
        rc, _, err = memfit(f"train {TINY} --set {shlex.quote(setting)} --set train.out='o'", d)
        written = "o/ exists" if (d / "o").exists() else "no o/"
        return _said(rc, err), f"none (nothing written: {written})"


NINES = "9" * 400
for command in (
    f"plan --budget {NINES}",
    f"estimate --device-memory {NINES}",
    f"bench --budget {NINES}",
    f"train --set memory.checkpointing='auto' --set memory.budget='{NINES}'",
):

    @case(f"2. budget of 400 nines: `memfit {command.split()[0]}`")
    def _(d: Path, command: str = command) -> tuple[str, str]:
        return _said(*memfit(f"{command} {TINY}", d)[::2]), "none"


@case("2. `memfit.budget.parse_bytes(5.96e-08)`")
def _(d: Path) -> tuple[str, str]:
    code = (
        "import memfit\nfrom memfit.budget import parse_bytes\ntry:\n print(parse_bytes(5.96e-08))\n"
        "except memfit.MemfitError as e:\n print(e)"
    )
    return f"ConfigError: `{python(code, d)[1].strip()}`", "none"


for text in ("[]", '{"blocks": 5}'):

    @case(f"2. `memfit check --plan plan.json` holding `{text}`")
    def _(d: Path, text: str = text) -> tuple[str, str]:
        (d / "plan.json").write_text(text)
        return _said(*memfit(f"check {TINY} --plan plan.json --out c", d)[::2]), "none"


@case("2. an unreadable config (fault hook: read fails with EACCES)")
def _(d: Path) -> tuple[str, str]:
    (d / "run.toml").write_text("[train]\nsteps = 2\n")
    code = (
        "import pathlib, sys\nfrom memfit.cli.main import main\nreal = pathlib.Path.read_text\n"
        "def denied(self, *a, **k):\n"
        "    if self.name == 'run.toml': raise PermissionError(13, 'Permission denied')\n"
        "    return real(self, *a, **k)\n"
        "pathlib.Path.read_text = denied\nsys.exit(main(['train', 'run.toml']))"
    )
    return _said(*python(code, d)[::2]), "none"


# -- 3. output paths ----------------------------------------------------------------------

for command, out in (
    ("plan --budget 90%", "--out ."),
    ("plan --budget 90%", "--out afile/plan.json"),
    ("profile", "--out ."),
    ("check", "--out afile"),
    ("train", "--set train.out='afile'"),
):

    @case(f"3. `memfit {command.split()[0]} {out}` (`.` is a folder, `afile` a file)")
    def _(d: Path, command: str = command, out: str = out) -> tuple[str, str]:
        (d / "afile").write_text("keep me")
        rc, _, err = memfit(f"{command} {TINY} {out}", d)
        kept = (d / "afile").read_text() == "keep me"
        return _said(rc, err) + " (before the model is built)", "none" if kept else "afile changed!"


# -- 4. the run directory turns unwritable ----------------------------------------------

CHMOD = """
import sys, tempfile
from pathlib import Path
import memfit.trainer.callbacks as cb, memfit.trainer.state as st
from memfit.cli.main import main
real, step_end = st.tempfile.mkstemp, cb.SaveState.on_step_end
def deny(*a, **k):
    if Path(str(k.get("dir", ""))).name == "run": raise PermissionError(13, "Permission denied", "run")
    return real(*a, **k)
def hook(self, trainer, m):
    if trainer.step_count == 3: st.tempfile.mkstemp = deny   # as if `chmod 555 run` now
    step_end(self, trainer, m)
cb.SaveState.on_step_end = hook
sys.exit(main(sys.argv[1:]))
"""


@case("4. `train.out` turns unwritable mid-run (fault hook for `chmod 555`, after step 3 of 6)")
def _(d: Path) -> tuple[str, str]:
    argv = f"train {TINY} --set train.steps=6 --set train.checkpoint_every=2 --set train.out='run' --quiet"
    rc, _, err = _run([sys.executable, "-c", CHMOD, *shlex.split(argv)], d)
    command = err[err.index("resume with ") + len("resume with ") : -1]
    rc2, _, _ = memfit(" ".join(shlex.split(command)[1:]) + " --quiet", d)
    steps = [json.loads(x)["step"] for x in (d / "run" / "metrics.jsonl").read_text().splitlines()]
    return (
        _said(rc, err) + f"; the printed command then exits {rc2} and metrics hold steps {steps}",
        "none (step 4 went to the rescue folder; state.pt kept step 2)",
    )


# -- 5. fp16 divergence -------------------------------------------------------------------


@case("5. `memfit train --set optimizer.lr=1e6 --set memory.precision=fp16 --set train.steps=30`")
def _(d: Path) -> tuple[str, str]:
    rc, _, err = memfit(
        f"train {TINY} --set optimizer.lr=1e6 --set memory.precision='fp16' --set train.steps=30 "
        "--set train.out='run' --quiet",
        d,
    )
    return _said(rc, err), "none: last-good.pt holds the weights before the failed step"


# -- 6. smaller -------------------------------------------------------------------------------


@case("6. a 2-layer `plan.json` given to `memfit check --plan` on a 3-layer model")
def _(d: Path) -> tuple[str, str]:
    memfit(f"plan {TINY} --budget 90% --no-check --out plan.json", d)
    return _said(*memfit(f"check {TINY} --set model.n_layer=3 --plan plan.json --out c", d)[::2]), "none"


@case("6. `--resume` after a run with `--set memory.checkpointing=selective`")
def _(d: Path) -> tuple[str, str]:
    (d / "run.toml").write_text('[memory]\ncheckpointing = "full"\n[train]\nsteps = 4\nout = "run"\n')
    memfit(f"train run.toml {TINY} --set memory.checkpointing='selective' --set train.steps=2 --quiet", d)
    _, _, alone = memfit("train --resume run/state.pt --set train.steps=3 --quiet", d)
    kept = "| checkpointing | selective |" in (d / "run" / "report.md").read_text()
    _, _, with_file = memfit(f"train run.toml {TINY} --resume --quiet", d)
    note = next(x for x in with_file.splitlines() if "checkpointing" in x)
    return (
        f"`memfit train --resume run/state.pt` (no config file) keeps the saved `selective`: {kept} "
        f"(stderr: `{alone.splitlines()[0]}`); `memfit train run.toml --resume` runs the file's `full` "
        f"and says so: `{note}` (the next note says to repeat the earlier --set to keep it)",
        "none",
    )


@case("6. `--resume --set train.steps=...` on a cosine schedule")
def _(d: Path) -> tuple[str, str]:
    memfit(
        f"train {TINY} --set optimizer.schedule='cosine' --set train.steps=4 --set train.out='run' --quiet", d
    )
    _, _, err = memfit("train --resume run/state.pt --set train.steps=12 --quiet", d)
    return f"exit 0, notes: `{err.splitlines()[-1]}`", "none"


@case("6. the recovery hint after a truncated `state.pt`, run as printed")
def _(d: Path) -> tuple[str, str]:
    argv = f"train {TINY} --set train.steps=4 --set train.checkpoint_every=2 --set train.out='run' --quiet"
    memfit(argv, d)
    state = d / "run" / "state.pt"
    state.write_bytes(state.read_bytes()[:-10])
    rc, _, err = memfit(argv + " --resume", d)
    hint = err[err.index("(memfit train --resume ") + 1 : err.rindex(")")]
    rc2, _, _ = memfit(" ".join(shlex.split(hint)[1:]) + " --quiet", d)
    return f"{_said(rc, err)}; `{hint}` exits {rc2}", "none (resumed from state.prev.pt)"


@case("6. a killed save's `.state.pt.*.tmp`")
def _(d: Path) -> tuple[str, str]:
    argv = f"train {TINY} --set train.steps=2 --set train.out='run' --quiet"
    memfit(argv, d)
    (d / "run" / ".state.pt.k1ll3d.tmp").write_bytes(b"half")
    memfit(argv + " --resume --set train.steps=3", d)
    left = sorted(p.name for p in (d / "run").iterdir())
    return f"removed by the next save; the folder holds {left}", "none"


@case("6. a directory given as the config")
def _(d: Path) -> tuple[str, str]:
    (d / "configs").mkdir()
    return _said(*memfit("train configs", d)[::2]), "none"


@case("6. `memory.budget = 2000000` (an int) in the config")
def _(d: Path) -> tuple[str, str]:
    (d / "run.toml").write_text('[memory]\nbudget = 2000000\n[train]\nsteps = 2\nout = "run"\n')
    rc, _, _ = memfit(f"train run.toml {TINY} --quiet", d)
    report = (d / "run" / "report.md").read_text()
    verdict = next((x.strip("- ") for x in report.splitlines() if "memory.budget" in x), "no verdict")
    return f"exit {rc}; the report says `{verdict}`", "none"


@case("6. `memfit plan --budget -1GB`")
def _(d: Path) -> tuple[str, str]:
    return _said(*memfit(f"plan {TINY} --budget -1GB", d)[::2]), "none"


# -- out of memory ------------------------------------------------------------------------

OOM = """
import sys
import memfit.app.run as run
from oom_faults import KeptBytesLimit
from test_oom import _Arm
from memfit.cli.main import main
build = run.build_run
def shrink(*a, **k):
    built = build(*a, **k); t = built.trainer
    lim = KeptBytesLimit(t.loss_fn); lim.limit = lim.kept_bytes(t.model, built.sampler.batch_at(0)) - 1
    t.loss_fn = lim; t.callbacks.append(_Arm(lim, 2)); return built
run.build_run = shrink
sys.exit(main(sys.argv[1:]))
"""


@case("OOM: `memfit train` with `checkpointing = auto`; the device 'shrinks' after step 2 (fault hook)")
def _(d: Path) -> tuple[str, str]:
    argv = (
        "train --set model.n_layer=4 --set model.n_embd=32 --set model.block_size=16 "
        "--set train.batch_size=8 "
        "--set data.max_bytes=40000 --set train.steps=5 --set memory.checkpointing='auto' "
        "--set memory.budget='100%' --set train.out='run'"
    )
    rc, out, _ = _run([sys.executable, "-c", OOM, *shlex.split(argv)], d)
    line = next((x for x in out.splitlines() if "ran out of memory" in x), "")
    steps = [json.loads(x)["step"] for x in (d / "run" / "metrics.jsonl").read_text().splitlines()]
    return f"exit {rc}; `{line[:200]}...`; metrics hold steps {steps}", "none (no step lost, none twice)"


def main() -> None:
    only = sys.argv[1] if len(sys.argv) > 1 else ""  # run only the cases whose name has this
    print("| case | what happened | data lost |")
    print("|---|---|---|")
    for name, fn in CASES:
        if only not in name:
            continue
        with tempfile.TemporaryDirectory() as d:
            what, lost = fn(Path(d))
        print(f"| {name} | {what} | {lost} |", flush=True)


if __name__ == "__main__":
    main()
