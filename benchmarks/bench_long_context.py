"""Issue 38's acceptance model: the longest sequence whose training step fits 512 MiB.

``transformers.LlamaConfig`` (2 layers, hidden 256, intermediate 688, 4 heads, 32,000-token
vocabulary, untied head), fp32, AdamW, batch 1, trained through its own ``labels=`` loss. Two
ways to fit the budget, each searched for its longest sequence (multiples of 128 tokens):

- ``hf``: Hugging Face's ``model.gradient_checkpointing_enable()``;
- ``plan``: ``memfit.plan(..., budget=512 MiB, levers="all")``, applied with ``memfit.prepare``.

A length fits when MemTracker's peak around one whole steady-state step (optimizer state
made by a step before) is at most the budget (for ``plan``: and the planner found a plan).
Each probe runs in a subprocess whose address space is limited (``RLIMIT_AS``) to what it
uses after a short warm-up step plus twice the budget (``hf``), so a probe never allocates
far beyond the budget: one that would is a probe that does not fit. ``memfit.plan`` before
issue 38's timing lever timed real steps without levers while planning, so a ``plan`` probe
may allocate 16 times the budget (See ``ROOM``); the step it measures is the plan's. The search gallops from
a first length (``--hf-from``, ``--plan-from``: the lengths found before) by one, two, four...
grains until a length does not fit (down likewise where the first does not fit), then bisects.

Run (memory only; the timings are the lead's, on a quiet machine):
``HF_HUB_OFFLINE=1 .venv-extras/bin/python benchmarks/bench_long_context.py [--only hf|plan] [--lora]``;
one probe: ``... --probe plan --seq 13824`` (prints one ``RESULT {json}`` line). ``--src DIR``
probes another checkout's memfit (``git worktree add /tmp/old <commit>``; ``--src /tmp/old/src``):
the planner as it was before a change.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault(
    "TORCHDYNAMO_DISABLE", "1"
)  # torchao's compiled step runs eagerly, as MemTracker sees it

import torch
from torch.distributed._tools.mem_tracker import MemTracker

BUDGET = 512 * 2**20
_NO_HOOK = SimpleNamespace(remove=lambda: None)  # a hook handle that removes nothing
GRAIN = 128
#: Bytes a probe may allocate beyond its warm-up step. memfit.plan before the timing lever
#: (Note [timing with a lever] in memfit/measuring/timing_lever.py) timed whole steps on the real
#: model without levers and refused a room they did not fit: at 13,824 tokens the plain loss
#: head alone is 1.8 GB of logits, so planning needed that room although its plan fits the
#: budget; kept for probing an older memfit (``--src``).
ROOM = {"hf": 2 * BUDGET, "plan": 16 * BUDGET}
VOCAB = 32000
_ROOT = Path(__file__).resolve().parents[1]


def _model() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=256, intermediate_size=688, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=VOCAB, tie_word_embeddings=False,
        max_position_embeddings=1 << 20, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).train()


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in a peft LoRA adapter: r=16 on the attention and MLP projections."""
    import peft

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets))


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


def _tokens(seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(seq))


def _tracked(
    model: torch.nn.Module, opt: torch.optim.Optimizer, step: Any
) -> tuple[float, int, dict[str, int]]:
    """MemTracker's peak (and its split) around one call of ``step``; its loss."""
    tracker = MemTracker()
    tracker.track_external(model, opt)
    # MemTracker hooks every parameter's gradient, which PyTorch refuses for a frozen one (a
    # LoRA base): marked as hooked already, they are still counted as parameters.
    for p in (p for p in model.parameters() if not p.requires_grad):
        tracker._param_to_grad_hook_handles[p] = (_NO_HOOK, _NO_HOOK)
    with tracker:
        loss = float(step())
    peak = tracker.get_tracker_snapshot("peak")
    split = {str(getattr(k, "name", k)): v for dev in peak.values() for k, v in dev.items() if k != "Total"}
    return loss, int(sum(v["Total"] for v in peak.values())), split


def _hf_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> Any:
    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, x)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _probe(kind: str, seq: int, room: int, lora: bool) -> dict[str, Any]:
    """One length, in this process (the caller's subprocess), its address space limited to what
    it uses after a warm-up step plus ``room`` bytes (``lora``: the model in a LoRA adapter)."""
    sys.path.insert(0, str(_ROOT / "tests"))
    from rlimit import limit_address_space

    import memfit
    from memfit.errors import MemfitError, is_out_of_memory

    torch.set_num_threads(1)
    model = _lora(_model()) if lora else _model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    if kind == "hf":
        model.gradient_checkpointing_enable()
        _hf_step(model, opt, _tokens(16))()  # the optimizer's state, and what a first step loads
    else:  # memfit.prepare takes an optimizer without state: a forward and backward only
        _loss(model, _tokens(16)).backward()
        model.zero_grad(set_to_none=True)
    limit_address_space(room)
    x = _tokens(seq)
    started = time.perf_counter()
    try:
        if kind == "hf":
            _hf_step(model, opt, x)()
            loss, peak, split = _tracked(model, opt, _hf_step(model, opt, x))
            return {
                "seq": seq,
                "peak": peak,
                "split": split,
                "loss": loss,
                "seconds": time.perf_counter() - started,
            }
        plan = memfit.plan(model, x, _loss, BUDGET, opt, "fp32", levers="all")
        model, opt = memfit.prepare(model, opt, plan)
        memfit.train_step(model, x, _loss, opt, plan)
        loss, peak, split = _tracked(model, opt, lambda: memfit.train_step(model, x, _loss, opt, plan))
    except MemfitError as exc:
        return {"seq": seq, "error": str(exc)}
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc):
            raise
        return {"seq": seq, "error": f"out of memory: {str(exc)[:200]}"}
    return {
        "seq": seq, "peak": peak, "split": split, "loss": loss, "predicted": plan.predicted_peak_bytes,
        "levers": plan.levers, "modes": sorted(set(plan.blocks.values())),
        "micro_batches": plan.micro_batches, "loss_chunk_tokens": plan.loss_chunk_tokens,
        "seconds": time.perf_counter() - started,
    }  # fmt: skip


def _run(kind: str, seq: int, room: int, lora: bool, src: Path) -> dict[str, Any]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--probe", kind, "--seq", str(seq), "--room", str(room)]
    cmd += ["--lora"] if lora else []
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
    return {"seq": seq, "error": f"probe exited {out.returncode}: {' | '.join(tail)}"}


def _fits(result: dict[str, Any]) -> bool:
    return "error" not in result and result["peak"] <= BUDGET


def _search(
    kind: str, start: int, room: int, lora: bool, src: Path
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The longest fitting length (a multiple of GRAIN) and every probe, in order."""
    probes: list[dict[str, Any]] = []

    def probe(seq: int) -> bool:
        result = _run(kind, seq, room, lora, src)
        probes.append(result)
        shown = f"peak {result['peak']:,} B" if "peak" in result else result["error"][:120]
        print(
            f"  {kind} {seq:>7,} tokens: {'fits' if _fits(result) else 'does not fit'} ({shown})", flush=True
        )
        return _fits(result)

    lo, hi, step = 0, start, GRAIN
    while probe(hi):  # gallop up from the hint: +1, +2, +4... grains
        lo, hi, step = hi, hi + step, 2 * step
    if lo == 0:  # the hint does not fit: gallop down
        step = GRAIN
        while hi - step > 0 and not probe(hi - step):
            hi, step = hi - step, 2 * step
        lo = max(0, hi - step)
    while hi - lo > GRAIN:
        mid = (lo + hi) // 2 // GRAIN * GRAIN
        lo, hi = (mid, hi) if probe(mid) else (lo, mid)
    best = [p for p in probes if p["seq"] == lo and _fits(p)]
    return (best[0] if best else None), probes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", choices=["hf", "plan"])
    parser.add_argument("--seq", type=int)
    parser.add_argument("--only", choices=["hf", "plan"])
    parser.add_argument("--room", type=int, help="bytes a probe may allocate (default: see ROOM)")
    parser.add_argument("--hf-from", type=int, default=768, help="the hf search's first length")
    parser.add_argument("--plan-from", type=int, default=13824, help="the plan search's first length")
    parser.add_argument("--lora", action="store_true", help="the model in a peft LoRA adapter (r=16)")
    parser.add_argument(
        "--src", type=Path, default=_ROOT / "src", help="the memfit source probes import (an older one)"
    )
    args = parser.parse_args()
    if args.probe:
        print("RESULT " + json.dumps(_probe(args.probe, args.seq, args.room or ROOM[args.probe], args.lora)))
        return
    what = "issue 38's model" + (" in a LoRA adapter" if args.lora else "")
    machine = f"{platform.machine()}, torch {torch.__version__}, memfit from {args.src}"
    print(f"# {what} at a {BUDGET:,} B budget: {machine}")
    found = {}
    for kind, start in (("hf", args.hf_from), ("plan", args.plan_from)):
        if args.only and kind != args.only:
            continue
        room = args.room or ROOM[kind]
        print(f"{kind}: each probe may allocate {room:,} B beyond its warm-up", flush=True)
        found[kind], _ = _search(kind, start, room, args.lora, args.src.resolve())
    print("\n| way | longest sequence (tokens) | MemTracker peak (B) | plan |")
    print("|---|---:|---:|---|")
    for kind, best in found.items():
        if best is None:
            print(f"| {kind} | none fits | | |")
            continue
        how = "" if kind == "hf" else f"{best['levers']}, {best['modes']}, chunk {best['loss_chunk_tokens']}"
        print(f"| {kind} | {best['seq']:,} | {best['peak']:,} | {how} |")
    for kind, best in found.items():
        if best is not None:
            print(f"\n{kind} at {best['seq']:,} tokens, the peak by MemTracker's kind: {best['split']}")
    if len(found) == 2 and all(found.values()):
        print(f"\nplan / hf: {found['plan']['seq'] / found['hf']['seq']:.2f}x")  # type: ignore[index]


if __name__ == "__main__":
    main()
