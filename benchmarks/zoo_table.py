"""Print the README's zoo table: each model's blocks, and its plan at the halfway budget, measured.

The same steps as ``tests/integrations/test_zoo.py`` (which asserts them): the blocks
``memfit.find_blocks`` picks; the keep-everything and full-checkpoint peaks; a plan at the
budget halfway between them; its predicted and measured peak.

Run (needs the extras):
    HF_HUB_OFFLINE=1 PYTHONPATH=src .venv-extras/bin/python benchmarks/zoo_table.py [NAME ...]

With names (substrings of the entries' names, e.g. ``ghostnet clip``) only those rows, each
with a last column: ``memfit.estimate``'s plain peak against the measured one, for entries the
zoo checks it on.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import torch

import memfit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"))
from zoo import Entry, all_entries


def _blocks(names: list[str]) -> str:
    """``transformer.h.0-1`` style: the names with their last index folded."""
    groups: dict[str, list[str]] = {}
    for n in names:
        stem, _, last = n.rpartition(".")
        key = stem if re.fullmatch(r"\d+", last) else re.sub(r"\d+$", "N", n)
        groups.setdefault(key, []).append(last)
    parts = []
    for key, lasts in groups.items():
        parts.append(f"{key}.{lasts[0]}-{lasts[-1]}" if len(lasts) > 1 and lasts[0].isdigit() else key)
    return ", ".join(f"`{p}`" for p in parts)


def _step(model: torch.nn.Module, entry: Entry, batch: object) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    loss = entry.loss(model, batch)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return [loss.detach(), *grads, *(b.clone() for b in model.buffers())]


def exact(entry: Entry) -> bool:
    """full, selective and every=2 give the plain model's loss, gradients and buffers."""
    fresh = entry.build()
    batch = entry.batch(entry.small)
    ref = _step(copy.deepcopy(fresh), entry, batch)
    for kwargs in ({"mode": "full"}, {"mode": "selective"}, {"mode": "full", "every": 2}):
        out = _step(memfit.checkpoint(copy.deepcopy(fresh), **kwargs), entry, batch)
        if len(out) != len(ref) or not all(
            torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(out, ref, strict=True)
        ):
            return False
    return True


def row(entry: Entry) -> str:
    model = entry.build()
    found = memfit.find_blocks(model)
    same = exact(entry)
    batch = entry.batch(entry.large)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = memfit.profile(model, batch, entry.loss, opt, "fp32", repeats=1)
    keep = prof.measured_peak_bytes
    memfit.checkpoint(model, mode="full")
    full = memfit.measure(model, batch, entry.loss, opt, "fp32", steps=1).peak_bytes
    memfit.uncheckpoint(model)
    budget = (full + keep) // 2
    plan = memfit.plan(model, batch, entry.loss, budget, opt, "fp32", profiles={"fp32": prof}, check=False)
    memfit.apply(model, plan)
    measured = memfit.measure(
        model, batch, entry.loss, opt, "fp32", steps=1, micro_batches=plan.micro_batches
    )
    error = (measured.peak_bytes - plan.predicted_peak_bytes) / plan.predicted_peak_bytes
    ok = found == entry.blocks and full <= keep and measured.peak_bytes <= budget and abs(error) <= 0.05
    return (
        f"| {entry.name} | {entry.covers} | {len(found)}: {_blocks(found)} | {'yes' if same else 'NO'} | "
        f"{keep:,} | {full:,} | "
        f"{budget:,} | {measured.peak_bytes:,} ({error:+.1%}) | {'yes' if ok else 'NO'} |"
    )


def estimated(entry: Entry) -> str:
    """``memfit.estimate``'s fp32 plain peak against the measured one (two steps), or "-"."""
    if not entry.estimate:
        return "-"
    batch = entry.batch(entry.large)
    sgd = lambda p: torch.optim.SGD(p, lr=0.01)  # noqa: E731
    est = memfit.estimate(entry.build, batch, entry.loss, sgd, precisions=["fp32"], modes=["none"])
    model = entry.build()
    real = memfit.measure(model, batch, entry.loss, sgd(model.parameters()), "fp32", steps=2).peak_bytes
    predicted = est.peak_bytes("fp32", "none")
    return f"{predicted:,} ({(predicted - real) / real:+.1%})"


def main() -> None:
    torch.set_num_threads(1)
    print(
        "| model | what it brings | blocks found | full, selective, every=2 exact | keep peak B | "
        "full peak B | budget B | plan measured B (vs predicted) | holds |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    names = sys.argv[1:]
    if names:
        print("(last column: memfit.estimate's plain peak B, vs the measured one)")
    for entry in all_entries():
        if not names:
            print(row(entry), flush=True)
        elif any(n in entry.name for n in names):
            print(f"{row(entry)} {estimated(entry)} |", flush=True)


if __name__ == "__main__":
    main()
