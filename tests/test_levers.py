"""Levers beyond activations (memfit.levers): exactness, bytes, refusals, prepare, resume, check, plan."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.distributed._tools.common_utils import get_untyped_storages

import memfit
from memfit.applying import allowed_levers, apply, remove_levers, site_of
from memfit.check.stability import check_stability
from memfit.checkpointing import checkpointed_blocks
from memfit.errors import ConfigError, LeverRefused
from memfit.levers import fused_step_of, lever_optimizer, needs
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.precision import Precision
from memfit.records import Plan
from memfit.step import training_step
from memfit.stepmodel.state_bytes import state_bytes

torchao = pytest.importorskip("torchao")


def _gpt(n_layer: int = 2, width: int = 64, seq: int = 16, dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_embd=width, n_head=2, block_size=seq, dropout=dropout))


def _batches(n: int, batch: int = 4, seq: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, 256, (batch, seq), generator=g)
        out.append((x, x))
    return out


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("clip_norm", [None, 0.05])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_fused_step_gives_the_unfused_weights(
    micro_batches: int, clip_norm: float | None, checkpointing: str
) -> None:
    """10 steps of AdamW stepped inside the backward == stepped after it (fp32, rtol 1e-6)."""
    runs = []
    for fused in (False, True):
        model = _gpt()
        if checkpointing != "none":
            memfit.checkpoint(model, mode=checkpointing)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        if fused:
            opt = apply(model, Plan(blocks=checkpointed_blocks(model), levers=["fused_step"]), opt).optimizer
            assert fused_step_of(opt) is not None
        norms = []
        for batch in _batches(10):
            r = training_step(model, batch, gpt_loss, opt, Precision("fp32"), micro_batches, clip_norm)
            norms.append(r.grad_norm)
            assert all(p.grad is None for p in model.parameters()) or not fused
        runs.append((copy.deepcopy(model.state_dict()), norms))
    (plain, plain_norms), (fused_sd, fused_norms) = runs
    for key in plain:
        torch.testing.assert_close(fused_sd[key], plain[key], rtol=1e-6, atol=1e-7)
    if clip_norm is not None:
        assert plain_norms[0] > clip_norm  # clipping really clipped
        torch.testing.assert_close(torch.tensor(fused_norms), torch.tensor(plain_norms), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["bf16", "8bit", "4bit"])
def test_state_bytes_are_exact(kind: str) -> None:
    """The step model's state bytes equal the storages torchao's optimizer holds."""
    lin = torch.nn.Linear(256, 512)
    opt = lever_optimizer(torch.optim.AdamW(lin.parameters(), lr=1e-3), kind, weights_bf16=False)
    lin(torch.randn(2, 256)).sum().backward()
    with torch.compiler.set_stance("force_eager"):  # NOTE: the same state, without the compile's cost
        opt.step()
    for p in lin.parameters():
        held = sum(s.nbytes() for v in opt.state[p].values() for s in get_untyped_storages(v))
        assert held == state_bytes(p.numel(), 4, kind)


def test_prepare_returns_a_new_optimizer_with_the_same_groups_and_hyper_parameters() -> None:
    model = _gpt(1)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.8, 0.95),
        eps=1e-7,
    )
    _, same = memfit.prepare(model, opt, Plan(blocks={}, levers=["fused_step"]))
    assert same is opt
    _, new = memfit.prepare(
        model, torch.optim.AdamW(model.parameters()), Plan(blocks={}, levers=["state_8bit"])
    )
    assert new is not opt and type(new).__name__ == "MemfitAdamW8bit"
    plan = Plan(blocks={}, levers=["state_bf16"])
    _, new = memfit.prepare(model, opt, plan)
    assert len(new.param_groups) == 2
    for g_new, g_old in zip(new.param_groups, opt.param_groups, strict=True):
        assert g_new["params"] == g_old["params"]
        assert g_new["weight_decay"] == g_old["weight_decay"]
        assert (
            float(g_new["lr"]) == pytest.approx(3e-3)
            and tuple(g_new["betas"]) == (0.8, 0.95)
            and g_new["eps"] == 1e-7
        )
    x = _batches(1)[0]
    with torch.compiler.set_stance("force_eager"):
        memfit.train_step(model, x, gpt_loss, new, plan)
    assert all(v["exp_avg"].dtype == torch.bfloat16 for v in new.state.values())
    remove_levers(model, new)


def test_levers_are_refused_with_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _gpt(1)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(LeverRefused, match="CUDA only"):
        apply(model, Plan(blocks={}, levers=["offload"]), opt)
    with pytest.raises(LeverRefused, match="fp16"):
        apply(model, Plan(blocks={}, precision="fp16", levers=["fused_step"]), opt)
    with pytest.raises(LeverRefused, match="bf16"):
        apply(model, Plan(blocks={}, precision="fp32", levers=["weights_bf16"]), opt)
    with pytest.raises(LeverRefused, match="SGD"):
        apply(model, Plan(blocks={}, levers=["state_8bit"]), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="unknown lever"):
        memfit.plan(model, _batches(1)[0], gpt_loss, "90%", opt, levers=["state_2bit"])
    two = _gpt(2)
    memfit.checkpoint(two, mode="selective")
    plan = Plan(blocks=checkpointed_blocks(two), levers=["fused_step"])
    fused = apply(two, plan, torch.optim.AdamW(two.parameters())).optimizer
    with pytest.raises(LeverRefused, match="selective checkpointing allows once"):
        training_step(two, _batches(1)[0], gpt_loss, fused, Precision("fp32"), 1, 1.0)
    # NOTE: without torchao the library still imports and plans; the state levers say what to install
    monkeypatch.setattr(needs.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(LeverRefused, match="pip install torchao"):
        apply(model, Plan(blocks={}, levers=["state_8bit"]), opt)
    # chunked_loss and tiled_mlp need no torchao (judged on the model when there is one)
    assert allowed_levers("all", site_of("cpu", opt, "fp32"))[0] == [
        "fused_step",
        "tiled_mlp",
        "chunked_loss",
    ]


@pytest.mark.parametrize(
    ("levers", "precision", "compiled"),
    [
        (["fused_step"], "fp32", False),
        (["state_bf16"], "fp32", False),
        (["state_8bit"], "fp32", True),
        (["state_4bit"], "fp32", False),
        (["fused_step", "state_4bit", "weights_bf16"], "bf16", False),
    ],
)
def test_resume_continues_exactly_with_every_lever(
    tmp_path, levers: list[str], precision: str, compiled: bool
) -> None:
    """Save after 3 steps, load into a fresh model and Trainer: the next 3 steps give the same weights.

    torchao compiles its step; once is enough to show a compiled step resumes (the others
    run eagerly, the same arithmetic without the compile's half minute)."""
    if not compiled:
        with torch.compiler.set_stance("force_eager"):
            _resume(tmp_path, levers, precision)
    else:
        _resume(tmp_path, levers, precision)


def _resume(tmp_path, levers: list[str], precision: str) -> None:
    x = _batches(6)

    def make() -> tuple[GPT, memfit.Trainer]:
        model = _gpt(1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        plan = Plan(blocks={}, precision=precision, levers=levers)
        return model, memfit.Trainer(model, opt, gpt_loss, plan=plan, progress=False, track_memory=False)

    model, trainer = make()
    trainer.fit(x[:3], steps=3)
    trainer.save(tmp_path / "state.pt")
    trainer.fit(x[3:], steps=3)
    again, resumed = make()
    resumed.load(tmp_path / "state.pt")
    resumed.fit(x[3:], steps=3)
    assert type(resumed.optimizer) is type(trainer.optimizer)
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)


def test_check_accepts_a_plan_with_levers() -> None:
    plan = Plan(blocks={"blocks.0": "full", "blocks.1": "none"}, levers=["fused_step", "state_8bit"])
    report = check_stability(
        _gpt, _batches(4), gpt_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-3), ("fp32",), steps=4, plan=plan
    )
    assert report.levers == ["fused_step", "state_8bit"]
    assert report.by_precision["fp32"].verdict == "PASS"
    assert report.by_precision["fp32"].param_drift is not None and report.by_precision["fp32"].param_drift > 0


def test_plan_uses_levers_only_when_asked_and_says_what_each_saves() -> None:
    model = _gpt(2, width=64, seq=32)
    batch = _batches(1, batch=8, seq=32)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    profiles: dict = {}
    plain = memfit.plan(model, batch, gpt_loss, "55%", opt, precision="fp32", profiles=profiles)
    assert plain.levers == []
    with pytest.raises(memfit.InfeasibleBudget):
        memfit.plan(model, batch, gpt_loss, "35%", opt, precision="fp32", profiles=profiles)
    lever = memfit.plan(model, batch, gpt_loss, "35%", opt, precision="fp32", profiles=profiles, levers="all")
    assert lever.levers and "offload" not in lever.levers
    savings = lever.report.lever_savings
    assert set(savings) == set(lever.levers) and all(v > 0 for v in savings.values())
    assert lever.measured_peak_bytes <= lever.budget_bytes
    assert math.isclose(lever.predicted_peak_bytes, lever.measured_peak_bytes, rel_tol=0.05)
    assert any("offload" in n for n in lever.notes)  # "all" on a CPU: offload not used, and why


class _Offset(torch.nn.Module):
    """Weights far from zero: in bf16 (an ulp of 8 at 1000) they lose what the model computes with."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ws = torch.nn.ParameterList(
            [torch.nn.Parameter(1000.0 + 0.01 * torch.randn(64, 64)) for _ in range(16)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(x @ (w - 1000.0) for w in self.ws)  # type: ignore[return-value]


def test_verify_refuses_a_lever_whose_check_fails() -> None:
    """The budget needs bf16 weights and bf16 state; the check fails bf16 weights on this
    model, and without them nothing fits: the lever is refused, saying why."""
    model = _Offset()
    x = torch.randn(8, 64)
    batch = (x, torch.zeros(8, 64))

    def loss_fn(m: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return ((m(b[0]) - b[1]) ** 2).mean()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    budget = 12 * 16 * 64 * 64  # bytes: 12 per parameter
    levers = ["state_bf16", "weights_bf16"]
    unverified = memfit.plan(model, batch, loss_fn, budget, opt, precision="bf16", levers=levers)
    assert unverified.levers == levers
    with pytest.raises(
        LeverRefused, match="weights_bf16 is refused on this model: its check against fp32 failed"
    ):
        memfit.plan(model, batch, loss_fn, budget, opt, precision="bf16", levers=levers, verify=True)
    assert all(w.dtype == torch.float32 for w in model.ws)  # planning left the model as it was


def test_memfit_imports_and_refuses_the_state_levers_without_torchao() -> None:
    """torchao is optional (memfit[levers]): with its import blocked, memfit imports, plans with
    levers='all' (using what needs no torchao) and refuses a state lever with one sentence."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torchao'] = None\n"
        "import torch, memfit\n"
        "from memfit.errors import LeverRefused\n"
        "from memfit.records import Plan\n"
        "m = torch.nn.Linear(4, 4)\n"
        "try:\n"
        "    memfit.prepare(m, torch.optim.AdamW(m.parameters()), Plan(blocks={}, levers=['state_4bit']))\n"
        "except LeverRefused as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "state_4bit needs torchao's low-precision AdamW: `pip install torchao`" in out.stdout


@pytest.mark.parametrize("command", ["plan", "check", "estimate"])
def test_an_unknown_lever_at_the_cli_is_one_sentence_and_exit_2(
    command: str, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    from memfit.cli.main import main

    extra = ["--budget", "50%"] if command == "plan" else []
    assert main([command, *extra, "--levers", "state_2bit", "--set", f"train.out={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "unknown lever 'state_2bit'" in err and "Traceback" not in err
