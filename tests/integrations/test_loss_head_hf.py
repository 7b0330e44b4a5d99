"""The chunked_loss lever on Hugging Face causal LMs built from configs: same loss, same gradients."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="memfit[hf] extra (transformers) not installed")

from memfit.applying import apply, remove_levers  # noqa: E402
from memfit.levers.head import chunked_head_of, find_head, head_refusal, install_chunked_head  # noqa: E402
from memfit.records import Plan, Profile  # noqa: E402

FP32_TOL = {"rtol": 1e-4, "atol": 1e-6}
VOCAB = 1000

#: model type -> config fields beyond the size: one of each head the lever handles.
CASES = {
    "qwen2": {"tie_word_embeddings": True},  # tied embeddings
    "gemma2": {"head_dim": 16, "final_logit_softcapping": 2.0},  # soft-capped logits
    "cohere": {"logit_scale": 0.25},  # scaled logits (tied by default)
    "llama": {},  # untied head; labels with ignored tokens
    "phi": {},  # a bias on the head
    "granite": {"logits_scaling": 4.0},  # logits divided by a scale
    "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
}


def _model(kind: str, **extra: object) -> nn.Module:
    torch.manual_seed(0)
    fields = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=2)
    fields.update(intermediate_size=64)
    fields.update(
        vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0
    )
    fields.update(CASES[kind], **extra)
    config = transformers.AutoConfig.for_model(kind, **fields)
    config.use_cache = False
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (3, 20), generator=g)
    labels = x.clone()
    labels[0, 5:9] = -100  # prompt tokens the loss skips
    labels[2, -3:] = -100
    return x, labels


def labels_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The model's own loss: ``model(input_ids=x, labels=labels).loss``."""
    x, labels = batch
    return model(input_ids=x, labels=labels).loss


def _loss_and_grads(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = labels_loss(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", list(CASES))
def test_chunked_head_gives_the_models_own_loss_and_gradients(kind: str) -> None:
    model = _model(kind)
    batch = _batch()
    ref_loss, ref_grads = _loss_and_grads(model, batch)
    opt = torch.optim.AdamW(model.parameters())
    apply(model, Plan(blocks={}, levers=["chunked_loss"]), opt)
    assert chunked_head_of(model) == 8388  # 2**23 // 1000 tokens per chunk
    install_chunked_head(model, chunk_tokens=7)  # several chunks at this batch, the last one short
    out = model(input_ids=batch[0], labels=batch[1])
    assert out.logits is None  # no full logits when the lever computes the loss
    loss, grads = _loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss, **FP32_TOL)
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], **FP32_TOL, msg=n)
    # without labels the model is unchanged: its logits, as before
    assert model(input_ids=batch[0]).logits.shape == (3, 20, VOCAB)
    remove_levers(model, opt)
    assert chunked_head_of(model) is None


def test_head_facts_of_each_case() -> None:
    specs = {kind: find_head(_model(kind)) for kind in ("qwen2", "gemma2", "cohere", "phi", "granite")}
    assert specs["qwen2"] is not None and specs["qwen2"].head.weight is not None
    assert specs["gemma2"] is not None and specs["gemma2"].softcap == 2.0
    assert specs["cohere"] is not None and specs["cohere"].logit_scale == 0.25
    assert specs["phi"] is not None and specs["phi"].head.bias is not None
    assert specs["granite"] is not None and specs["granite"].logit_scale == 0.25


def test_num_items_in_batch_sums_then_divides_as_hugging_face_does() -> None:
    model = _model("llama")
    x, labels = _batch()
    ref = model(input_ids=x, labels=labels, num_items_in_batch=torch.tensor(17)).loss
    apply(model, Plan(blocks={}, levers=["chunked_loss"]), torch.optim.AdamW(model.parameters()))
    got = model(input_ids=x, labels=labels, num_items_in_batch=torch.tensor(17)).loss
    torch.testing.assert_close(got, ref, **FP32_TOL)


def test_unknown_model_types_are_refused_with_the_reason() -> None:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "mixtral",
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        num_local_experts=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    why = head_refusal(model)
    assert why is not None and "'mixtral'" in why


# --- bytes: the step model's prediction against MemTracker, and memfit.plan -----------------

BIG_VOCAB = 16384


def _big(kind: str) -> nn.Module:
    return _model(kind, vocab_size=BIG_VOCAB)


def _big_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, BIG_VOCAB, (2, 96), generator=g)
    labels = x.clone()
    labels[:, :16] = -100
    return x, labels


def _measured(
    model: nn.Module, batch, opt: torch.optim.Optimizer, plan: Plan, precision: str = "fp32"
) -> int:
    from memfit.measuring.preserve import create_optimizer_state, preserved
    from memfit.measuring.tracker import MemoryWatch
    from memfit.precision import Precision
    from memfit.step import training_step

    with preserved(model, opt):
        used = apply(model, plan, opt).optimizer
        create_optimizer_state(model, used)
        with MemoryWatch(model, used) as watch:
            training_step(model, batch, labels_loss, used, Precision(precision))
        remove_levers(model, used)
    return watch.peak_bytes


def _head_profile(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    opt: torch.optim.Optimizer,
    precision: str = "fp32",
) -> Profile:
    """The model's profile without checkpointing (and fully checkpointed where ``precision`` is
    not fp32), with its lever facts (the head's too)."""
    import memfit
    from memfit.measuring.lever_facts import attach_lever_facts
    from memfit.measuring.preserve import preserved
    from memfit.measuring.profile import Profiler
    from memfit.precision import Precision

    with preserved(model, opt):
        profiler = Profiler(model, batch, labels_loss, opt, Precision(precision))
        profiler.none()
        if precision != "fp32":
            profiler.modes(["full"])
        blocks = memfit.find_blocks(model)
        return attach_lever_facts(profiler.result(), model, opt, blocks, (batch, labels_loss))


@pytest.mark.parametrize("kind", ["qwen2", "gemma2", "cohere", "llama", "phi"])
def test_predicted_peak_of_the_chunked_head_within_5_percent(kind: str) -> None:
    from memfit.applying import with_levers
    from memfit.stepmodel import simulate

    model, batch = _big(kind), _big_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    profile = _head_profile(model, batch, opt)
    assert profile.lever_facts.head is not None and not profile.lever_facts.head.refused
    plain = _measured(model, batch, opt, Plan(blocks={}))
    chunked = _measured(model, batch, opt, Plan(blocks={}, levers=["chunked_loss"]))
    predicted = simulate(with_levers(profile, ["chunked_loss"]), "none").peak_bytes
    print(
        f"{kind}: plain {plain:,} B, chunked {chunked:,} B ({chunked / plain:.3f}x), "
        f"predicted {predicted:,} B"
    )
    assert chunked < plain
    assert abs(predicted - chunked) <= 0.05 * chunked


def test_chunked_head_in_bf16_on_a_lora_model_predicted_to_the_percent() -> None:
    """bf16 autocast and a frozen head (peft LoRA): the model's forward keeps the bf16 logits
    beside their fp32 copy, and a frozen head makes no weight gradient; the head measured
    alone does the same, so the chunked head's step is predicted within 1% (it was 1.8x and
    3.3x over at 128k vocabulary before), without checkpointing and fully checkpointed."""
    peft = pytest.importorskip("peft")
    import memfit
    from memfit.applying import with_levers
    from memfit.stepmodel import simulate

    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    model, batch = peft.get_peft_model(_big("llama"), lora), _big_batch()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    profile = _head_profile(model, batch, opt, "bf16")
    assert profile.lever_facts.head.weight_grad_bytes == 0  # the head is frozen
    blocks = memfit.find_blocks(model)
    for mode in ("none", "full"):
        plan = Plan(
            blocks={b: mode for b in blocks} if mode == "full" else {},
            levers=["chunked_loss"],
            precision="bf16",
        )
        measured = _measured(model, batch, opt, plan, "bf16")
        predicted = simulate(with_levers(profile, ["chunked_loss"]), mode).peak_bytes
        print(f"bf16 LoRA, {mode}: chunked head measured {measured:,} B, predicted {predicted:,} B")
        assert abs(predicted - measured) <= 0.01 * measured


@pytest.mark.parametrize("kind", ["qwen2", "phi"])
def test_the_chunk_size_is_applied_and_predicted_at_a_third_size(kind: str) -> None:
    """Tied (Qwen2) and biased (Phi) heads at 16k: the head is measured at the default chunk
    (all 192 tokens) and at the ladder's smallest; a step at 48 tokens a chunk, applied from
    the plan, is predicted within 5% of MemTracker's count."""
    from memfit.applying import with_levers
    from memfit.stepmodel import simulate
    from memfit.stepmodel.head_chunks import at_chunk

    model, batch = _big(kind), _big_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    profile = _head_profile(model, batch, opt)
    head = profile.lever_facts.head
    assert head.default_chunk_tokens == 192 and head.small_chunk_tokens == 3
    plan = Plan(blocks={}, levers=["chunked_loss"], lever_settings={"chunked_loss": {"chunk_tokens": 48}})
    apply(model, plan, opt)
    assert chunked_head_of(model) == 48
    remove_levers(model, opt)
    chunked = _measured(model, batch, opt, plan)
    default = _measured(model, batch, opt, Plan(blocks={}, levers=["chunked_loss"]))
    predicted = simulate(with_levers(at_chunk(profile, 48), ["chunked_loss"]), "none").peak_bytes
    print(f"{kind}: default chunk {default:,} B; 48 tokens a chunk {chunked:,} B, predicted {predicted:,} B")
    assert chunked < default
    assert abs(predicted - chunked) <= 0.05 * chunked


def test_plan_chooses_the_head_lever_only_when_it_is_needed_to_fit() -> None:
    """A Qwen2-style decoder (tied embeddings) at a 32k vocabulary, labels=: 0.5x the plain peak
    fits with the head lever alone; a budget the plain step meets uses no lever."""
    import memfit
    from memfit.measuring.preserve import preserved

    model = _model("qwen2", vocab_size=32768, hidden_size=64, num_attention_heads=4)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 32768, (2, 128), generator=g)
    batch = (x, x)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with preserved(model, opt):
        plain = _measured(model, batch, opt, Plan(blocks={}))
    roomy = memfit.plan(model, batch, labels_loss, int(1.05 * plain), opt, precision="fp32", levers="all")
    assert "chunked_loss" not in roomy.levers
    tight = memfit.plan(
        model, batch, labels_loss, int(0.5 * plain), opt, precision="fp32", levers=["chunked_loss"]
    )
    print(
        f"plain {plain:,} B; 0.5x plan {tight.levers} measured {tight.measured_peak_bytes:,} B, "
        f"notes {tight.notes}"
    )
    assert tight.levers == ["chunked_loss"]
    assert tight.measured_peak_bytes <= 0.5 * plain
    assert any("no logits" in n for n in tight.notes)


def _tracked_second_step(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], opt: torch.optim.Optimizer, plan: Plan
) -> tuple[float, int]:
    """The first loss of ``memfit.train_step``, then PyTorch's MemTracker peak of the second."""
    from torch.distributed._tools.mem_tracker import MemTracker

    import memfit
    from memfit.checkpointing.compile import eager

    first = float(memfit.train_step(model, batch, labels_loss, opt, plan))
    tracker = MemTracker()
    tracker.track_external(model, opt)

    def next_micro_batch(module: torch.nn.Module, args: object) -> None:
        # MemTracker takes a second forward of the root module for a new iteration; with
        # micro-batches it is the same step's next one: clear its per-module statistics
        if module is model and module in tracker.memory_tracking and not tracker._mod_tracker.is_bw:
            tracker.reset_mod_stats()

    hook = torch.nn.modules.module.register_module_forward_pre_hook(next_micro_batch)
    with eager(), tracker:  # torchao's compiled step, run as MemTracker sees it
        memfit.train_step(model, batch, labels_loss, opt, plan)
    hook.remove()
    peak = tracker.get_tracker_snapshot("peak")
    return first, int(sum(v["Total"] for v in peak.values()))


def test_a_budget_of_three_tenths_fits_with_every_lever_measured_by_memtracker() -> None:
    """Issue 24's acceptance on a small vocabulary: the Qwen2-style decoder (tied embeddings,
    intermediate size at its default) at 0.30x of its plain peak with ``levers="all"``: the
    head lever, the fused step and 4-bit state (the tied embedding's step in slices), measured
    by PyTorch's own MemTracker around ``memfit.train_step`` at or under the budget, the first
    loss the plain model's."""
    import copy

    import memfit
    from memfit.stepmodel import state_bytes

    model = _model("qwen2", vocab_size=32768, hidden_size=64, num_attention_heads=4, intermediate_size=5632,
                   num_hidden_layers=4, max_position_embeddings=256)  # fmt: skip
    fresh = copy.deepcopy(model)
    x = torch.randint(0, 32768, (2, 256), generator=torch.Generator().manual_seed(3))
    batch = (x, x)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = memfit.profile(model, batch, labels_loss, opt, "fp32", repeats=1)
    plain = prof.measured_peak_bytes
    plain_loss = labels_loss(copy.deepcopy(fresh), batch)
    old = state_bytes.STEP_SLICE_ELEMENTS
    state_bytes.STEP_SLICE_ELEMENTS = 2**18  # the tied 32k x 64 embedding steps in 8 slices
    try:
        plan = memfit.plan(model, batch, labels_loss, int(0.30 * plain), opt, "fp32", levers="all",
                           profiles={"fp32": prof})  # fmt: skip
        model, opt = memfit.prepare(model, opt, plan)
        first, peak = _tracked_second_step(model, batch, opt, plan)
    finally:
        state_bytes.STEP_SLICE_ELEMENTS = old
    print(f"plain {plain:,} B; 0.30x plan {plan.levers} predicted {plan.predicted_peak_bytes:,} B, "
          f"MemTracker {peak:,} B ({peak / plain:.3f}x)")  # fmt: skip
    assert "chunked_loss" in plan.levers
    assert peak <= int(0.30 * plain)
    torch.testing.assert_close(torch.tensor(first), plain_loss.detach(), rtol=1e-4, atol=0)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "gpt2"])
def test_memfit_s_own_hf_loss_is_the_model_s_loss_and_takes_the_chunked_head(kind: str) -> None:
    """``hf_causal_loss`` (what ``memfit train`` uses for ``hf:`` models) computes the
    cross-entropy of the logits against the shifted targets through the model's own
    ``labels=`` loss, so the chunked head gives it with the same gradients."""
    from memfit.integrations.hf import hf_causal_loss

    model = _model(kind)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(3))
    batch = (tokens[:, :-1], tokens[:, 1:])
    logits = model(input_ids=batch[0]).logits
    by_hand = nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[1].flatten())
    model.zero_grad(set_to_none=True)
    plain = hf_causal_loss(model, batch)
    plain.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(plain, by_hand, rtol=1e-6, atol=1e-7)
    install_chunked_head(model, chunk_tokens=5)
    model.zero_grad(set_to_none=True)
    calls: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    chunked = hf_causal_loss(model, batch)
    hook.remove()
    assert not calls, "the whole head ran: the chunked head was not used"
    chunked.backward()
    torch.testing.assert_close(chunked, plain.detach(), rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6)


def test_chunked_head_on_a_peft_wrapper_chunks_the_base_models_loss() -> None:
    """On a peft-wrapped causal LM the lever goes on the base model (the wrapper's
    ``base_model_prefix`` names the base model, not its decoder); the loss is the plain head's."""
    peft = pytest.importorskip("peft")
    import copy

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=172, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=500, tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    lora = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), lora)
    plain = copy.deepcopy(model)
    x = torch.randint(0, 500, (1, 96), generator=torch.Generator().manual_seed(1))
    install_chunked_head(model, 16)
    assert chunked_head_of(model) == 16
    out, ref = model(input_ids=x, labels=x), plain(input_ids=x, labels=x)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0.0)
    remove_levers(model, None)
    assert chunked_head_of(model) is None and model(input_ids=x, labels=x).logits is not None
