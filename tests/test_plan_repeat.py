"""The same call gives the same plan while every core is busy with other work (issue 25).

A busy machine is what makes the time model's prices swing (See Note [plans repeat] in
memfit/planning/choose.py); the plans must not. Timing is never asserted: only that three
identical calls, each timing its blocks under the load, choose one plan.
"""

from __future__ import annotations

import pytest
import torch
from busy_machine import busy_cores, plan_key
from conftest import token_batch

import memfit
from memfit.devices import free_cores
from memfit.measuring.speed import timing_threads
from memfit.models.gpt import GPT, GPTConfig, gpt_loss

# the load is the test's own: two spinning processes for two cores, nothing else beside them
pytestmark = pytest.mark.busy


# At 70% two of three blocks are checkpointed, at 85% one: which blocks, and whether two
# form a segment, ties in counted work and differs in time by checkpoint calls, a price a
# loaded machine inflates. One row, which micro-batches cannot split (See Note [a load that
# moves] in memfit/planning/choose.py), of 512 tokens: on a model of 16 tokens a call was
# timed at a quarter of the step under load while its rounds agreed within a tenth, and a
# segment then won some calls (a limit of timing one call's price, noted in the Note).
@pytest.mark.parametrize("budget", ["70%", "85%"])
def test_three_plan_calls_on_a_busy_machine_give_one_plan(budget: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_embd=64, n_head=2, block_size=512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = token_batch(1, 512)
    with busy_cores() as hogs:
        # fp32: auto would also weigh bf16 on a CPU that runs it natively, a choice between
        # whole timed steps that this rule does not cover (tests/planning/test_plan_stability.py)
        plans = [memfit.plan(model, batch, gpt_loss, budget, opt, precision="fp32") for _ in range(3)]
        assert all(h.poll() is None for h in hogs)  # the load lasted every call
    assert len({plan_key(p) for p in plans}) == 1, [plan_key(p) for p in plans]
    # the budget needs checkpointing or micro-batches
    assert any(m != "none" for m in plans[0].blocks.values()) or plans[0].micro_batches > 1
    assert all(p.predicted_peak_bytes <= p.budget_bytes for p in plans)


@pytest.mark.slow
def test_five_plan_calls_on_the_readme_gpt_at_60_percent_on_a_busy_machine_give_one_plan() -> None:
    """Issue 36's case: the README's GPT (4 x 128, batch 8 x 128), every core busy; micro-batches
    are candidates too (See Note [micro-batches where they are faster])."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=128, n_head=4, block_size=128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = token_batch(8, 128)
    with busy_cores() as hogs:
        plans = [memfit.plan(model, batch, gpt_loss, "60%", opt, precision="fp32") for _ in range(5)]
        assert all(h.poll() is None for h in hogs)
    assert len({plan_key(p) for p in plans}) == 1, [plan_key(p) for p in plans]
    assert all(p.measured_peak_bytes <= p.budget_bytes for p in plans)


def test_steps_are_timed_on_the_free_cores_while_other_processes_keep_them_busy() -> None:
    """See Note [timing on the free cores] in memfit/measuring/speed.py: with every core spinning
    in another process, a profile times its steps on one thread and its report says so; torch's
    own thread count is back afterwards."""
    if free_cores() is None:
        pytest.skip("this machine does not show its runnable threads (/proc/loadavg)")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # more threads than free cores, on any machine
    try:
        with busy_cores():
            assert free_cores() == 0
            assert timing_threads(torch.device("cpu"))[0] == 1
            plan = memfit.plan(model, token_batch(4, 64), gpt_loss, "70%", opt, precision="fp32")
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    said = [line for line in plan.report.measured if "CPU threads" in line]
    assert said and said[0].startswith("steps timed on 1 of 2 CPU threads"), plan.report.measured
