"""Training compiled: planning a compiled model, ``compile=True`` in prepare, train_step, the
Trainer and ``memfit train``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_compile import CASES, COMPILED_TOL, STEPS

import memfit
from memfit.checkpointing import checkpointed_blocks
from memfit.checkpointing.compile import is_compiled
from memfit.cli.main import main
from memfit.records import Plan

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_compile_thread")]


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def test_planning_a_compiled_model_leaves_it_free_to_compile_the_plan() -> None:
    # NOTE: measured on torch 2.13: a compiled model run under MemTracker's dispatch mode was
    # never compiled again, so after memfit.apply it kept its un-checkpointed graph. Planning
    # runs it eagerly (memfit.checkpointing.compile.eager) and the plan's graph is compiled.
    torch._dynamo.reset()
    make, loss_fn, batch = CASES["gpt"]
    model = make()
    model.compile()
    loss_fn(model, batch).backward()
    graphs = _graphs()
    plan = memfit.plan(model, batch, loss_fn, "90%", precision="fp32", check=False)
    assert _graphs() == graphs  # planning compiled nothing: it measured the eager step
    assert checkpointed_blocks(model) == {}
    memfit.apply(model, plan)
    assert checkpointed_blocks(model)
    loss_fn(model, batch).backward()
    assert _graphs() > graphs  # the checkpointed model was compiled anew


def test_prepare_train_step_and_trainer_compile_the_planned_model() -> None:
    make, loss_fn, batch = CASES["cnn_batchnorm_inplace"]
    names = memfit.find_blocks(make())
    plan = Plan(blocks={names[0]: "full", names[1]: "selective"}, precision="fp32", micro_batches=2)
    runs = {}
    for how in ("eager", "prepare", "train_step", "trainer"):
        torch._dynamo.reset()
        model = make()
        keys = list(model.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(7)
        if how == "trainer":
            memfit.apply(model, plan)
            trainer = memfit.Trainer(model, opt, loss_fn, plan=plan, compile=True)
            assert trainer.memory_note and "not tracked" in trainer.memory_note
            losses = [trainer.step(batch).loss for _ in range(STEPS)]
            assert trainer.memory is None
        else:
            model, opt = memfit.prepare(model, opt, plan, compile=how == "prepare")
            losses = [
                memfit.train_step(model, batch, loss_fn, opt, plan, compile=how == "train_step")
                for _ in range(STEPS)
            ]
        assert is_compiled(model) == (how != "eager")
        assert list(model.state_dict()) == keys
        assert int(model.state_dict()[f"{names[0]}.bn.num_batches_tracked"]) == STEPS * plan.micro_batches
        runs[how] = (losses, {n: p.detach().clone() for n, p in model.named_parameters()})
    for how in ("prepare", "train_step", "trainer"):
        torch.testing.assert_close(runs[how][0], runs["eager"][0], **COMPILED_TOL, msg=how)
        for name, weight in runs["eager"][1].items():
            torch.testing.assert_close(runs[how][1][name], weight, **COMPILED_TOL, msg=f"{how}: {name}")


def test_memfit_train_compiles_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "corpus.txt"
    data.write_bytes(b"\n".join(p.read_bytes() for p in sorted(Path(json.__file__).parent.glob("*.py"))))
    out = tmp_path / "run"
    argv = [
        "train",
        "--set", "model.n_layer=2", "--set", "model.n_embd=16", "--set", "model.n_head=2",
        "--set", "model.block_size=16", "--set", "train.steps=2", "--set", "train.batch_size=4",
        "--set", f"data.path='{data}'", "--set", "memory.checkpointing='full'", "--set", "train.eval_every=0",
        "--set", "train.compile=true", "--set", f"train.out='{out}'",
    ]  # fmt: skip
    torch._dynamo.reset()
    assert main(argv) == 0, capsys.readouterr().err
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "compiled (torch.compile)" in report
    assert "compiled on CPU: step memory is not tracked" in report
    assert main([*argv[:-2], "--set", "train.compile=2", "--set", f"train.out='{out}2'"]) == 2
    assert "train.compile must be bool" in capsys.readouterr().err
