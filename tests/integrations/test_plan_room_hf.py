"""A Hugging Face decoder whose plain step does not fit: planned, trained and measured.

``LlamaForCausalLM`` from its config (``use_cache`` on, as the config makes it), trained through
its own ``labels=`` loss, in a subprocess whose ``RLIMIT_AS`` leaves room for 60% of its plain
step (``tests/plan_rlimit_worker.py``); the plan is for 45%, and is measured here unconstrained.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="memfit[hf] extra (transformers) not installed")

from room_helpers import assert_planned_under_the_limit, linux_only, plain_peak, run_worker


@pytest.mark.slow
@linux_only
def test_an_hf_decoder_that_does_not_fit_is_planned_and_trained() -> None:
    from models_for_room import build

    model, _, _ = build("hf-llama")
    assert model.config.use_cache  # the default: memfit turns it off in the checkpointed blocks
    peak = plain_peak("hf-llama")
    result = run_worker("--model", "hf-llama", "--peak", str(peak), "--try-plain")
    assert_planned_under_the_limit("hf-llama", result)
