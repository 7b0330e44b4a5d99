"""What the planner decides, written to JSON: run before and after a change to the planner's
insides, and compare (behaviour unchanged means the same decisions and the same bytes).

Three parts:

- ``pure``: plans from profiles measured once and kept in ``benchmarks/plan_snapshot/profiles.json``
  (``--record-profiles`` measures them again), with ``check=False``: nothing is timed, so the
  decision is a function of the stored numbers (the lever facts are measured again: bytes from
  MemTracker, and the optimizer step's per-element cost kept in ``step_temps.json``, whose last
  bytes move from run to run). Every budget, precision list and lever choice below.
- ``measured``: whole ``memfit.plan`` calls (profiling, choosing, the measured check), the
  command line's ``memfit plan``, ``maximize="batch_size"``, levers: the decision can move only
  where timed prices tie (See Note [plans repeat] in memfit.planning.choose).
- ``peft``: a LoRA Llama (transformers + peft; run with the extras environment).

Usage (from the repository root):
    PYTHONPATH=src:tests .venv/bin/python benchmarks/plan_snapshot.py --part pure --part measured
    PYTHONPATH=src:tests HF_HUB_OFFLINE=1 .venv-extras/bin/python benchmarks/plan_snapshot.py --part peft
    python benchmarks/plan_snapshot.py --compare OLD.json NEW.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

os.environ.setdefault("MEMFIT_QUIET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import memfit
from memfit.errors import MemfitError
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.records import Profile

HERE = Path(__file__).resolve().parent / "plan_snapshot"
PROFILES = HERE / "profiles.json"
#: The optimizer steps' measured bytes and seconds per element (the lever facts' only
#: measurements that move by a few bytes from run to run), kept so that every part is exact
#: in what it measures for levers.
STEP_TEMPS = HERE / "step_temps.json"
BUDGETS = ["95%", "80%", "65%", "50%", "40%", "30%", "20%"]

Case = tuple[Callable[[], nn.Module], Any, Callable[..., torch.Tensor]]


def _gpt(n_layer: int, width: int, seq: int, vocab: int = 256) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_embd=width, n_head=2, block_size=seq, vocab_size=vocab))


def _tokens(rows: int, seq: int, vocab: int = 256, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _llama() -> nn.Module:
    from memfit.models.llama import llama

    torch.manual_seed(0)
    return llama(preset="tiny", n_layer=3, n_embd=64, n_head=4, n_kv_head=2, hidden=128, block_size=32).model


def _cases() -> dict[str, Case]:
    from plan_cases import CASES

    cases: dict[str, Case] = dict(CASES)
    cases["gpt_readme"] = (lambda: _gpt(4, 64, 64), _tokens(8, 64), gpt_loss)
    cases["gpt_levers"] = (lambda: _gpt(2, 64, 32), _tokens(8, 32), gpt_loss)
    cases["gpt_16k_head"] = (lambda: _gpt(2, 64, 64, vocab=16384), _tokens(6, 64, vocab=16384), gpt_loss)
    cases["llama"] = (_llama, _tokens(4, 32), gpt_loss)
    return cases


#: case -> (precisions profiled, lever choices planned with)
PURE: dict[str, tuple[list[str], list[str | None]]] = {
    "gpt": (["fp32", "bf16", "fp16"], [None, "all"]),
    "cnn_batchnorm": (["fp32"], [None]),
    "resnet_batchnorm": (["fp32"], [None]),
    "uneven_blocks": (["fp32", "bf16"], [None]),
    "unet_skips": (["fp32"], [None]),
    "dropout": (["fp32"], [None]),
    "gpt_readme": (["fp32", "bf16"], [None, "all"]),
    "gpt_levers": (["fp32", "bf16"], [None, "all", "state_8bit,fused_step"]),
    "gpt_16k_head": (["fp32"], [None, "chunked_loss"]),
    "llama": (["fp32", "bf16"], [None, "all"]),
}


def _setup(name: str) -> tuple[nn.Module, Any, Callable[..., torch.Tensor], torch.optim.Optimizer]:
    make, batch, loss_fn = _cases()[name]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, batch, loss_fn, opt


def decision(plan: Any) -> dict[str, Any]:
    """What a plan decides and predicts, in one JSON-ready dict (the same keys before and after)."""
    report = getattr(plan, "report", plan)
    settings = getattr(plan, "lever_settings", None)
    if settings is not None:
        chunk = int(settings.get("chunked_loss", {}).get("chunk_tokens", 0))
        offload = list(settings.get("offload", {}).get("blocks", []))
    else:
        chunk, offload = plan.loss_chunk_tokens, list(plan.offload)
    return {
        "blocks": dict(plan.blocks),
        "segments": [list(s) for s in plan.segments],
        "precision": plan.precision,
        "micro_batches": plan.micro_batches,
        "levers": list(plan.levers),
        "loss_chunk_tokens": chunk,
        "offload": offload,
        "batch_size": plan.batch_size,
        "predicted_peak_bytes": report.predicted_peak_bytes,
        "budget_bytes": report.budget_bytes,
        "baseline_peak_bytes": report.baseline_peak_bytes,
        "lever_savings": dict(report.lever_savings),
    }


def _planned(call: Callable[[], Any]) -> dict[str, Any]:
    try:
        return decision(call())
    except MemfitError as exc:
        return {"refused": type(exc).__name__, "message": str(exc), **_minimum(exc)}


def _minimum(exc: MemfitError) -> dict[str, Any]:
    minimum = getattr(exc, "minimum_bytes", None)
    return {} if minimum is None else {"minimum_bytes": minimum}


def record_profiles() -> None:
    """Measure every pure case's complete profiles (every mode) and keep them."""
    out: dict[str, dict[str, Any]] = {}
    for name, (precisions, _) in PURE.items():
        model, batch, loss_fn, opt = _setup(name)
        profiles: dict[str, Profile] = {}
        for precision in precisions:  # one at a time: a precision is measured whole only when it can win
            memfit.plan(model, batch, loss_fn, "95%", opt, precision, profiles=profiles, check=False)
        out[name] = {p: prof.to_dict() for p, prof in profiles.items()}
        print(f"profiled {name}: {', '.join(profiles)}", flush=True)
    HERE.mkdir(exist_ok=True)
    PROFILES.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")


@contextlib.contextmanager
def _kept_step_temps() -> Iterator[None]:
    """``step_temp_per_element`` answered from :data:`STEP_TEMPS` (measured and added when missing)."""
    from memfit.measuring import lever_facts

    measure = lever_facts.step_temp_per_element
    kept = json.loads(STEP_TEMPS.read_text(encoding="utf-8")) if STEP_TEMPS.exists() else {}

    def stored(optimizer: Any, kind: str, weights: str, numel: int = lever_facts.PROBE_NUMEL) -> Any:
        key = f"{type(optimizer).__name__}/{kind}/{weights}/{numel}"
        if key not in kept:
            kept[key] = list(measure(optimizer, kind, weights, numel))
        return tuple(kept[key])

    lever_facts.step_temp_per_element = stored  # type: ignore[assignment]
    try:
        yield
    finally:
        lever_facts.step_temp_per_element = measure
        STEP_TEMPS.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def _pure() -> dict[str, Any]:
    stored = json.loads(PROFILES.read_text(encoding="utf-8"))
    out: dict[str, Any] = {}
    for name, (precisions, lever_choices) in PURE.items():
        profiles = {p: Profile.from_dict(d) for p, d in stored[name].items()}
        choices = [[p] for p in precisions] + ([precisions] if len(precisions) > 1 else [])
        for wanted in choices:
            for levers in lever_choices:
                for budget in BUDGETS:
                    key = f"{name} {'+'.join(wanted)} levers={levers} {budget}"
                    model, batch, loss_fn, opt = _setup(name)
                    call = functools.partial(
                        memfit.plan, model, batch, loss_fn, budget, opt, wanted,
                        profiles=profiles, check=False, levers=levers,
                    )  # fmt: skip
                    out[key] = _planned(call)
                    print(key, "->", _short(out[key]), flush=True)
    return out


def measured() -> dict[str, Any]:
    out: dict[str, Any] = {}

    def plan(key: str, name: str, budget: Any, **kwargs: Any) -> None:
        model, batch, loss_fn, opt = _setup(name)
        out[key] = _planned(lambda: memfit.plan(model, batch, loss_fn, budget, opt, **kwargs))
        print(key, "->", _short(out[key]), flush=True)

    plan("gpt fp32 70%", "gpt", "70%", precision="fp32")
    plan("gpt fp32 50%", "gpt", "50%", precision="fp32")
    plan("gpt fp32 30%", "gpt", "30%", precision="fp32")
    plan("gpt fp32+bf16 60%", "gpt", "60%", precision=["fp32", "bf16"])
    plan("gpt bf16 40%", "gpt", "40%", precision="bf16")
    plan("gpt maximize 1MiB", "gpt", "1MiB", precision="fp32", maximize="batch_size")
    plan("uneven fp32 60%", "uneven_blocks", "60%", precision="fp32")
    plan("unet fp32 60%", "unet_skips", "60%", precision="fp32")
    plan("gpt_levers all 35%", "gpt_levers", "35%", precision="fp32", levers="all")
    plan("gpt_levers all 55%", "gpt_levers", "55%", precision="fp32", levers="all")
    plan("gpt_levers bf16 all 30%", "gpt_levers", "30%", precision="bf16", levers="all")
    plan("llama fp32 60%", "llama", "60%", precision="fp32")
    plan("llama all 35%", "llama", "35%", precision="fp32", levers="all")
    out["gpt_16k one row chunked_loss 42072776"] = _chunk_case()
    readme = ["--budget", "60%", "--set", "model.n_layer=4", "--set", "train.batch_size=8"]
    out["cli plan 60% n_layer=4 batch 8"] = _cli(readme)
    largest = ["--budget", "2MiB", "--set", "model.n_layer=2", "--set", "train.batch_size=2"]
    out["cli plan 2MiB n_layer=2 maximize"] = _cli([*largest, "--maximize", "batch_size"])
    return out


def _chunk_case() -> dict[str, Any]:
    """RESULTS.md's loss head case: one row of 512 tokens at vocabulary 16k, 42,072,776 B."""
    model = _gpt(2, 64, 512, vocab=16384)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _tokens(1, 512, vocab=16384)
    return _planned(
        lambda: memfit.plan(model, batch, gpt_loss, 42_072_776, opt, precision="fp32", levers="chunked_loss")
    )


def _cli(argv: list[str]) -> dict[str, Any]:
    from memfit.cli.main import main

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        with _captured() as (_, stderr):
            code = main(["plan", *argv, "--set", "train.device='cpu'", "--out", str(path), "--quiet"])
        if code != 0:
            return {"refused": f"exit {code}", "message": stderr.getvalue().strip()}
        data = json.loads(path.read_text(encoding="utf-8"))
    data.pop("memfit", None)
    return decision(memfit.Plan.from_dict(data))


@contextlib.contextmanager
def _captured() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        yield out, err


def peft_cases() -> dict[str, Any]:
    import peft
    import transformers

    def lora() -> nn.Module:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        base = transformers.LlamaForCausalLM(config)
        cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        return peft.get_peft_model(base, cfg).train()

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(input_ids=x, labels=x).loss

    x = torch.randint(0, 96, (8, 32), generator=torch.Generator().manual_seed(0))
    out: dict[str, Any] = {}
    for budget, levers in (("70%", None), ("95%", None), ("50%", None), ("40%", "all")):
        model = lora()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        key = f"lora llama fp32 {budget} levers={levers}"
        out[key] = _planned(
            functools.partial(memfit.plan, model, x, loss, budget, opt, "fp32", levers=levers)
        )
        print(key, "->", _short(out[key]), flush=True)
    return out


def _short(d: dict[str, Any]) -> str:
    if "refused" in d:
        return f"refused ({d.get('minimum_bytes', '')})"
    modes = "".join(m[0] for m in d["blocks"].values())
    return (
        f"{d['precision']} {modes} seg={len(d['segments'])} mb={d['micro_batches']} "
        f"levers={','.join(d['levers'])} chunk={d['loss_chunk_tokens']} {d['predicted_peak_bytes']:,} B"
    )


def compare(old_path: str, new_path: str) -> int:
    old = json.loads(Path(old_path).read_text(encoding="utf-8"))
    new = json.loads(Path(new_path).read_text(encoding="utf-8"))
    differ = 0
    for part in sorted(set(old) | set(new)):
        a, b = old.get(part, {}), new.get(part, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                differ += 1
                print(f"[{part}] {key}:\n  before {a.get(key)}\n  after  {b.get(key)}")
        same = sum(1 for k in a if a.get(k) == b.get(k))
        print(f"{part}: {same} of {len(set(a) | set(b))} cases identical")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", action="append", choices=["pure", "measured", "peft"], default=[])
    parser.add_argument("--out", default=None, help="the JSON to write (default: plan_snapshot/<parts>.json)")
    parser.add_argument("--record-profiles", action="store_true")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    torch.set_num_threads(1)
    if args.record_profiles:
        record_profiles()
    runs = {"pure": _pure, "measured": measured, "peft": peft_cases}
    with _kept_step_temps():
        result = {part: runs[part]() for part in args.part}
    if result:
        path = Path(args.out) if args.out else HERE / f"{'+'.join(args.part)}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
