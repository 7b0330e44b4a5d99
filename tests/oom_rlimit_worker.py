"""Run by ``test_oom.py`` in a subprocess: a real allocation failure under ``RLIMIT_AS``.

Trains a GPT two steps with no checkpointing, then lowers the process's address-space
limit below what that plan needs (the CPU allocator then fails with "can't allocate
memory"), trains three more steps, lifts the limit and trains the uninterrupted reference:
the first plan for two steps, then the re-planned one. Prints one ``RESULT {json}`` line.

The environment must set ``MALLOC_MMAP_THRESHOLD_`` (large tensors are mapped, and their
address space returned, one by one) and ``MALLOC_ARENA_MAX=1``, so the address space in use
follows the tensors alive.
"""

from __future__ import annotations

import json

import torch
from rlimit import address_space, lift_address_space_limit, limit_address_space

from memfit.applying import apply
from memfit.measuring.profile import profile
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.planning.choose import plan_from_profiles
from memfit.trainer.oom import OomConfig
from memfit.trainer.trainer import Trainer

FAIL_AT, STEPS = 3, 5


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, 256, (12, 129), generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def _trainer(first: object, profiles: dict[str, object] | None = None) -> Trainer:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=192, n_head=4, block_size=128, dropout=0.1))
    apply(model, first)  # type: ignore[arg-type]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    oom = OomConfig(profiles=dict(profiles or {}), margin=0.3)  # type: ignore[arg-type]
    return Trainer(model, opt, gpt_loss, plan=first, progress=False, oom=oom)  # type: ignore[arg-type]


def main() -> None:
    torch.set_num_threads(1)
    batches = _batches()
    torch.manual_seed(0)
    probe = GPT(GPTConfig(n_layer=4, n_embd=192, n_head=4, block_size=128, dropout=0.1))
    opt = torch.optim.AdamW(probe.parameters())
    profiles = {"fp32": profile(probe, batches[0], gpt_loss, opt, "fp32", repeats=1)}
    first = plan_from_profiles(profiles, 2**40)
    del probe

    a = _trainer(first, profiles)
    torch.manual_seed(7)
    history = a.fit(batches[: FAIL_AT - 1], steps=FAIL_AT - 1)
    assert a.memory is not None
    kept = a.memory.breakdown["params"] + a.memory.breakdown["optimizer"]
    transient = a.memory.peak_bytes - kept
    start = address_space()
    limit = limit_address_space(int(0.8 * transient))  # less than the first plan's step needs
    try:
        history += a.fit(batches[FAIL_AT - 1 :], steps=STEPS - FAIL_AT + 1)
    finally:
        lift_address_space_limit()

    second = a.replans[-1].plan if a.replans else first
    b = _trainer(first)
    torch.manual_seed(7)
    reference = b.fit(batches[: FAIL_AT - 1], steps=FAIL_AT - 1)
    b.use_plan(second)
    reference += b.fit(batches[FAIL_AT - 1 :], steps=STEPS - FAIL_AT + 1)
    same = all(
        torch.equal(x, y)
        for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values(), strict=True)
    )
    result = {
        "steps": [m.step for m in history],
        "replans": [(e.step, e.error, e.after) for e in a.replans],
        "first_peak_bytes": history[FAIL_AT - 2].peak_bytes,
        "failed_peak_bytes": [e.failed_peak_bytes for e in a.replans],
        "budget_bytes": [e.budget_bytes for e in a.replans],
        "second_peak_bytes": history[FAIL_AT - 1].peak_bytes,
        "limit_above_start_bytes": limit - start,
        "first": [first.blocks, first.segments, first.micro_batches],
        "second": [second.blocks, second.segments, second.micro_batches],
        "losses": [m.loss for m in history],
        "reference_losses": [m.loss for m in reference],
        "same_weights": same,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
