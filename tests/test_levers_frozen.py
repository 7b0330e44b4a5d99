"""The frozen-weight levers (issue 25): ``frozen_bf16`` and ``frozen_nf4`` on a LoRA-style model.

The model is memfit's built-in LLaMA with its base frozen (``requires_grad=False``) and
small trainable low-rank adapters on the attention's query and value projections, added
here (the core venv has no peft; tests/integrations/test_levers_frozen_peft.py uses peft).
Bytes are MemTracker's; predictions are the step model's from a measured profile.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch import nn

import memfit
from memfit.applying import Site, allowed_levers, apply, lever, site_of, with_levers
from memfit.errors import LeverRefused
from memfit.levers.frozen import frozen_params, is_nf4, nf4_linears
from memfit.measuring.lever_facts import attach_lever_facts
from memfit.models.llama import llama
from memfit.records import Plan
from memfit.stepmodel import simulate

pytest.importorskip("torchao")

#: A step's loss with an NF4 base against the same step with the fp32 base: NF4 moves each
#: weight by up to ~1/16 of its block's range, so the loss moves by a few percent at most.
NF4_LOSS_RTOL = 0.05
#: The bf16 base against fp32: bf16 rounding of weights and activations.
BF16_LOSS_RTOL = 0.02
#: Predicted peak against measured, both of one step (MemTracker).
PREDICTION_RTOL = 0.08


class LoRA(nn.Module):
    """``base(x) + x A^T B^T``: a frozen Linear and a trainable rank-``r`` update (B starts at 0)."""

    def __init__(self, base: nn.Linear, r: int = 8) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(r, base.in_features) * 0.02)
        self.b = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def _lora_llama(n_embd: int = 256, n_layer: int = 2, vocab: int = 512, seq: int = 32):
    torch.manual_seed(0)
    spec = llama(preset="tiny", n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=vocab, block_size=seq)
    model = spec.model
    model.requires_grad_(False)
    for block in model.blocks:
        block.attn.wq = LoRA(block.attn.wq)
        block.attn.wv = LoRA(block.attn.wv)
    return spec, model


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def test_nf4_replaces_frozen_linears_and_trains_the_adapters() -> None:
    spec, model = _lora_llama()
    x, y = spec.random_batch(2, seed=1)
    reference = copy.deepcopy(model)
    ref_loss = spec.loss_fn(reference, (x, y))
    quantized = [name for name, _ in nf4_linears(model)]
    assert "head" not in quantized and len(quantized) == 2 * 7  # q, k, v, o, w1, w2, w3 per block
    # an optimizer over every parameter (frozen ones included) holds the NF4 weights afterwards,
    # so nothing keeps the fp32 ones alive
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    old = {id(model.get_submodule(n).weight) for n in quantized}
    model, opt = memfit.prepare(model, opt, Plan(blocks={}, precision="bf16", levers=["frozen_nf4"]))
    held = [p for g in opt.param_groups for p in g["params"]]
    assert all(is_nf4(model.get_submodule(n).weight) for n in quantized)
    assert not old & {id(p) for p in held} and sum(is_nf4(p) for p in held) == len(quantized)
    loss = spec.loss_fn(model, (x, y))
    torch.testing.assert_close(loss, ref_loss, rtol=NF4_LOSS_RTOL, atol=0.0)
    assert loss != ref_loss  # the base really changed
    loss.backward()
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapters if p.shape[1] == 8)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_nf4_recomputes_under_checkpointing(mode: str) -> None:
    spec, model = _lora_llama()
    batch = spec.random_batch(2, seed=2)
    memfit.prepare(model, _adamw(model), Plan(blocks={}, precision="fp32", levers=["frozen_nf4"]))
    plain = copy.deepcopy(model)
    spec.loss_fn(plain, batch).backward()
    memfit.checkpoint(model, mode=mode)
    loss = spec.loss_fn(model, batch)
    loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_frozen_bf16_casts_only_frozen_weights_in_place() -> None:
    spec, model = _lora_llama()
    batch = spec.random_batch(2, seed=3)
    ref = spec.loss_fn(copy.deepcopy(model), batch)
    frozen = frozen_params(model)
    model, _ = memfit.prepare(model, _adamw(model), Plan(blocks={}, precision="bf16", levers=["frozen_bf16"]))
    assert all(p.dtype == torch.bfloat16 for p in frozen)
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    prec = memfit.Precision("bf16")
    with prec.autocast():
        loss = spec.loss_fn(model, batch)
    torch.testing.assert_close(loss.float(), ref, rtol=BF16_LOSS_RTOL, atol=0.0)


def test_refused_without_frozen_weights_at_fp32_and_without_torchao(monkeypatch) -> None:
    spec = llama(preset="tiny")
    opt = _adamw(spec.model)
    kept, refused = allowed_levers("all", site_of("cpu", opt, "bf16", spec.model))
    assert "frozen_bf16" not in kept and "frozen_nf4" not in kept
    assert "requires_grad=False" in refused["frozen_bf16"] and "nn.Linear" in refused["frozen_nf4"]
    with pytest.raises(LeverRefused, match="freeze the base"):
        memfit.prepare(spec.model, opt, Plan(blocks={}, precision="bf16", levers=["frozen_nf4"]))
    _, model = _lora_llama()
    with pytest.raises(LeverRefused, match="use bf16"):
        apply(model, Plan(blocks={}, precision="fp32", levers=["frozen_bf16"]), _adamw(model))
    # without torchao: one sentence naming the command, and nothing applied (not even frozen_bf16)
    before = {n: (p.dtype, type(p.data)) for n, p in model.named_parameters()}
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a)
    )
    with pytest.raises(LeverRefused, match="pip install torchao") as info:
        apply(model, Plan(blocks={}, precision="bf16", levers=["frozen_bf16", "frozen_nf4"]), _adamw(model))
    assert str(info.value).count(".") <= 3 and "frozen_nf4" in str(info.value)
    assert {n: (p.dtype, type(p.data)) for n, p in model.named_parameters()} == before
    assert lever("frozen_nf4").refusal(Site(torch.device("cpu"), "AdamW", "bf16")) is not None


@pytest.mark.parametrize("levers", [["frozen_bf16"], ["frozen_nf4"], ["frozen_bf16", "frozen_nf4"]])
def test_prediction_matches_measured_bytes(levers: list[str]) -> None:
    spec, model = _lora_llama()
    batch = spec.random_batch(1, seed=4)
    profiler = memfit.profile(model, batch, spec.loss_fn, _adamw(model), "bf16")
    attach_lever_facts(profiler, model, _adamw(model), memfit.find_blocks(model), (batch, spec.loss_fn))
    plain = simulate(profiler, "none").peak_bytes
    predicted = simulate(with_levers(profiler, levers), "none").peak_bytes
    opt = _adamw(model)
    model, opt = memfit.prepare(model, opt, Plan(blocks={}, precision="bf16", levers=levers))
    measured = memfit.measure(model, batch, spec.loss_fn, opt, "bf16", steps=1).peak_bytes
    assert measured < plain * (0.5 if "frozen_nf4" in levers else 0.7)
    assert abs(predicted - measured) <= PREDICTION_RTOL * measured, (predicted, measured)


def test_planner_leaves_the_base_alone_when_the_budget_does_not_need_it() -> None:
    spec, model = _lora_llama()
    batch = spec.random_batch(1, seed=5)
    plain = memfit.measure(model, batch, spec.loss_fn, _adamw(model), "bf16", steps=1).peak_bytes
    plan = memfit.plan(model, batch, spec.loss_fn, int(plain * 1.2), _adamw(model), "bf16", levers="all")
    assert not {"frozen_bf16", "frozen_nf4"} & set(plan.levers)
    assert all(not is_nf4(p) and p.dtype == torch.float32 for p in model.parameters())
    # a model with no frozen weights plans with levers="all" and says why they were not used
    full = llama(preset="tiny")
    batch = full.random_batch(2, seed=0)
    fp = memfit.plan(full.model, batch, full.loss_fn, "90%", None, "bf16", levers="all")
    assert any(n.startswith("lever frozen_nf4 not used") for n in fp.notes)


@pytest.mark.slow
def test_acceptance_a_4bit_base_fits_under_the_bf16_base_and_trains() -> None:
    # issue 25: hidden 512, 4 layers, batch 1 x 64; budget 0.9x the frozen base held in bf16
    spec, model = _lora_llama(n_embd=512, n_layer=4, vocab=2048, seq=64)
    batch = spec.random_batch(1, seed=0)
    budget = int(0.9 * 2 * sum(p.numel() for p in frozen_params(model)))
    opt = _adamw(model)
    plan = memfit.plan(model, batch, spec.loss_fn, budget, opt, "bf16", levers="all")
    assert "frozen_nf4" in plan.levers
    assert plan.measured_peak_bytes <= budget
    assert any("NF4Tensor" in n and "not quantized" in n for n in plan.notes)
    model, opt = memfit.prepare(model, opt, plan)
    losses = [float(memfit.train_step(model, batch, spec.loss_fn, opt, plan)) for _ in range(3)]
    assert losses[2] < losses[0], losses
    assert memfit.measure(model, batch, spec.loss_fn, opt, plan.precision, steps=1).peak_bytes <= budget


def lora_byte_llama() -> nn.Module:
    """For ``memfit check --set model.name=import:test_levers_frozen:lora_byte_llama``: a frozen
    byte-level LLaMA with LoRA adapters, trained on the demo's text corpus."""
    return _lora_llama(n_embd=128, n_layer=2, vocab=256, seq=256)[1]


def test_check_levers_passes_nf4_against_the_bf16_base(tmp_path, capsys) -> None:
    from memfit.cli.main import main

    args = ["check", "--set", "model.name=import:test_levers_frozen:lora_byte_llama"]
    args += ["--set", "model.block_size=32", "--set", "train.batch_size=2", "--set", "train.eval_batches=1"]
    args += ["--set", "data.max_bytes=200000", "--set", "optimizer.lr=0.01"]
    args += ["--steps", "20", "--precisions", "bf16", "--levers", "frozen_nf4"]
    code = main([*args, "--out", str(tmp_path), "--quiet"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "bf16: PASS" in out and "reference: bf16 base (frozen_bf16)" in out
    assert "differs from the bf16 base by" in out and "from fp32" not in out


@pytest.mark.parametrize("torchao", [True, False])
def test_check_cli_refuses_a_frozen_lever_in_one_line(torchao: bool, tmp_path, capsys, monkeypatch) -> None:
    from memfit.cli.main import main

    name = "import:test_levers_frozen:lora_byte_llama" if not torchao else "gpt"
    if not torchao:
        real = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda n, *a: None if n == "torchao" else real(n, *a)
        )
    args = ["check", "--set", f"model.name={name}", "--set", "model.block_size=32"]
    code = main([*args, "--steps", "1", "--levers", "frozen_nf4", "--out", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert ("freeze the base" if torchao else "pip install torchao") in err


def test_estimate_counts_the_frozen_levers_on_a_fake_model() -> None:
    from memfit.planning.lever_sets import smallest_with_levers

    spec, _ = _lora_llama()
    batch = spec.random_batch(1, seed=0)
    est = memfit.estimate(lambda: _lora_llama()[1], batch, spec.loss_fn, _adamw_of, levers=True)
    assert all(p.lever_facts is not None and p.lever_facts.frozen is not None for p in est.profiles.values())
    plain = min(e.peak_bytes for e in est.entries)
    best = smallest_with_levers(est.profiles, ["frozen_bf16", "frozen_nf4"])
    assert best is not None and "frozen_nf4" in best.levers and best.peak_bytes < plain
    # NF4 cannot run under fp16 autocast: refused there, never predicted there
    why = lever("frozen_nf4").refusal(Site(torch.device("cpu"), "AdamW", "fp16"))
    assert why is not None and "use bf16 or fp32" in why
    assert best.precision != "fp16"


def _adamw_of(params) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-2)


def test_the_frozen_facts_forwards_with_the_head_in_chunks_keep_the_blocks_deltas() -> None:
    """Note [the step's forwards with the head in chunks]: where the plain step does not fit,
    the frozen facts' forwards run with the loss head in chunks (no logits held); every block's
    delta is the same, and the head's part differs at most by the frozen head weight's bf16
    cast that only the plain head saves (predicted over, the safe side)."""
    from memfit.levers.head import chunked_head_on
    from memfit.measuring.lever_facts import _saved_by_part

    spec, model = _lora_llama(vocab=4096, seq=64)
    batch = spec.random_batch(1, seed=6)
    blocks = memfit.find_blocks(model)
    facts = {}
    for chunked in (False, True):
        prof = memfit.profile(model, batch, spec.loss_fn, _adamw(model), "bf16")
        attach_lever_facts(prof, model, _adamw(model), blocks, (batch, spec.loss_fn), head_chunked=chunked)
        assert prof.lever_facts is not None and prof.lever_facts.frozen is not None
        facts[chunked] = prof.lever_facts.frozen.saved_delta
    assert set(facts[True]) == set(facts[False]) == {"frozen_bf16", "frozen_nf4", "frozen_bf16,frozen_nf4"}
    cast = 4096 * 256 * 2  # the head weight's bf16 cast
    for levers, plain in facts[False].items():
        chunked = facts[True][levers]
        assert {p: v for p, v in chunked.items() if p} == {p: v for p, v in plain.items() if p}, levers
        assert 0 <= chunked.get("", 0) - plain.get("", 0) <= cast, (levers, chunked, plain)
    plain_saved = _saved_by_part(model, blocks, (batch, spec.loss_fn), "bf16")
    with chunked_head_on(model):
        chunked_saved = _saved_by_part(model, blocks, (batch, spec.loss_fn), "bf16")
    tokens = batch[0].numel() if isinstance(batch, tuple) else batch.numel()
    assert plain_saved[""] - chunked_saved[""] >= tokens * 4096 * 2  # the logits are not held
