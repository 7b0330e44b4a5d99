"""``memfit.plan(..., maximize="seq_len")`` and ``memfit plan --maximize seq_len``: the longest
sequence one plan fits, probed on fake tensors, confirmed for real; one token more does not fit
(the planner itself refuses it); bad input in one sentence (exit code 2 at the CLI).

The Hugging Face decoder and the LoRA model at issue 38's scale are benchmarks/bench_longest_sequence.py
(recorded in benchmarks/RESULTS.md); tests/integrations/test_longest_sequence_hf.py runs them small.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import vector_batch

import memfit
from memfit.budget import format_bytes
from memfit.cli.main import main
from memfit.errors import ConfigError, InfeasibleBudget
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.planning.longest_sequence import position_limit, resize_sequence, sequence_length
from memfit.records import Plan

BUDGET = 2 * 2**20


def _gpt(block_size: int = 512) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor], torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=block_size))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, (x, x), torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_the_longest_sequence_trains_under_the_budget_and_one_more_token_does_not_fit() -> None:
    model, batch, opt = _gpt()
    plan = memfit.plan(model, batch, gpt_loss, BUDGET, opt, "fp32", maximize="seq_len")
    n = plan.seq_len
    assert 16 < n < 512 and plan.batch_size == 2
    assert 0 < plan.measured_peak_bytes <= plan.budget_bytes == BUDGET
    assert plan.made_for is not None and plan.made_for.batch == [[2, n], [2, n]]
    assert plan.notes[-1].startswith(f"longest sequence: {n:,} tokens; {n + 1:,} tokens need at least")
    assert Plan.from_json(plan.to_json()) == plan
    # the answer's plain step is over the budget: measured on fake tensors, not run for real
    # though the machine has room for it, and the timed steps are ones under the budget
    # (See Note [real steps within the budget] in memfit/planning/longest_sequence.py)
    measured = plan.report.measured
    assert any(f"does not fit the budget of {format_bytes(BUDGET)}" in m for m in measured), measured
    assert not any("tracked step at fp32 without checkpointing" in m for m in measured), measured
    assert any("timed step(s) at fp32" in m and "(the plain step does not fit)" in m for m in measured)
    # the planner, measuring for real at one token more, finds nothing that fits
    with pytest.raises(InfeasibleBudget):
        memfit.plan(model, resize_sequence(batch, n + 1), gpt_loss, BUDGET, opt, "fp32", check=False)
    # the answer trains: prepare and one step, within the budget as MemTracker counts it
    model, opt = memfit.prepare(model, opt, plan)
    sized = resize_sequence(batch, n)
    watched = memfit.measure(model, sized, gpt_loss, opt, "fp32", steps=1, micro_batches=plan.micro_batches)
    assert watched.peak_bytes <= BUDGET


def test_resize_and_limits() -> None:
    x = torch.arange(6).reshape(2, 3)
    assert sequence_length((x, x.float())) == 3
    assert resize_sequence((x, torch.ones(2)), 5)[0].tolist() == [[0, 1, 2, 0, 1], [3, 4, 5, 3, 4]]
    assert resize_sequence(x, 2).tolist() == [[0, 1], [3, 4]]
    model = _gpt(64)[0]
    assert position_limit(model) == (64, "its config.block_size (64)")
    model.config.block_size = 100
    assert position_limit(model) == (64, "its position table pos_emb (64 rows)")
    assert position_limit(torch.nn.Linear(2, 2)) is None


def _one_sentence(message: str) -> None:
    assert message.endswith(".") and "\n" not in message and message.count(". ") == 0


def test_a_model_without_a_sequence_is_refused_in_one_sentence() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
    with pytest.raises(
        ConfigError, match=r"maximize='seq_len' grows the sequence of a batch of token ids"
    ) as info:
        memfit.plan(
            model, vector_batch(), lambda m, b: (m(b[0]) - b[1]).pow(2).mean(), 2**30, maximize="seq_len"
        )
    _one_sentence(str(info.value))


def test_a_batch_longer_than_the_position_table_is_refused() -> None:
    model, _, opt = _gpt(block_size=512)
    model.config.block_size = (
        32  # the table is 512 rows; the model takes 32 tokens (its forward refuses more)
    )
    x = torch.randint(0, 256, (1, 40))
    with pytest.raises(
        ConfigError, match=r"sequence of 40 tokens is longer than GPT takes: its config.block_size \(32\)"
    ):
        memfit.plan(model, (x, x), gpt_loss, BUDGET, opt, "fp32", maximize="seq_len")


def test_the_answer_stops_at_the_position_table() -> None:
    model, batch, opt = _gpt(block_size=64)
    plan = memfit.plan(model, batch, gpt_loss, BUDGET, opt, "fp32", maximize="seq_len")
    assert plan.seq_len == 64
    assert (
        plan.notes[-1]
        == "longest sequence: 64 tokens, as long as the model takes (its config.block_size (64))"
    )


def test_a_budget_below_the_smallest_step_is_refused() -> None:
    model, batch, opt = _gpt(64)
    with pytest.raises(InfeasibleBudget, match=r"^not even a sequence of one token fits the budget") as info:
        memfit.plan(model, batch, gpt_loss, 200_000, opt, "fp32", maximize="seq_len", levers="all")
    assert info.value.minimum_bytes > 200_000
    _one_sentence(str(info.value))


def test_cli_refuses_in_one_sentence_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = ["--set", "model.n_layer=2", "--set", "model.n_embd=16", "--set", "model.n_head=2"]
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                *tiny,
                "--maximize",
                "seq_len",
                "--budget",
                "100KB",
                "--levers",
                "all",
                "--out",
                str(out),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "not even a sequence of one token fits" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_a_failed_confirmation_searches_again_lower_with_the_probes_it_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the real plan at the answer measures over the budget (its twin predicted under),
    the search looks again against the budget less that excess: one more real plan, not one
    per token, and no length is probed on fake tensors twice (See Note [confirmed once for
    real] in memfit/planning/longest_sequence.py). The first real plan is refused here as the
    planner refuses one measured over."""
    import memfit.planning.longest_sequence as ls
    import memfit.planning.planner as planner

    model, batch, opt = _gpt()
    over = BUDGET // 8
    asked: list[int] = []
    real = planner._plan_batch

    def plan_batch(request):  # type: ignore[no-untyped-def]
        asked.append(sequence_length(request.batch))
        if len(asked) == 1:
            raise InfeasibleBudget("the best plan measured over its prediction", BUDGET + over, BUDGET)
        return real(request)

    probed: list[int] = []
    probe = ls._probe

    def counted(request, sized, precision, base):  # type: ignore[no-untyped-def]
        probed.append(sequence_length(sized))
        return probe(request, sized, precision, base)

    monkeypatch.setattr(planner, "_plan_batch", plan_batch)
    monkeypatch.setattr(ls, "_probe", counted)
    plan = memfit.plan(model, batch, gpt_loss, BUDGET, opt, "fp32", maximize="seq_len")
    print(f"planned for real at {asked}; probed {sorted(probed)}")
    assert len(asked) == 2 and asked[1] == plan.seq_len < 0.95 * asked[0], asked
    assert len(probed) == len(set(probed)), probed
    assert f"the budget less {over:,} B" in plan.notes[-1], plan.notes[-1]
    assert 0 < plan.measured_peak_bytes <= BUDGET
