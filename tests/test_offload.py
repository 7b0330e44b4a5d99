"""Activation offload (memfit.levers.offload) on a CPU: the same schedule as on CUDA with the
copies going to a second CPU tensor. Exact (values, gradients), in the order of its Note,
priced to the byte (memfit.stepmodel.offload against MemTracker, which does not see the host
copies, as a GPU's allocator does not), undoable; composes with the chunked loss head and the
tiled MLP. The lever as a plan uses it stays refused on a CPU.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import memfit
from memfit.errors import CheckpointError, LeverRefused
from memfit.levers.head import install_chunked_head
from memfit.levers.offload import (
    clear_offload,
    offload_blocks,
    offloaded_blocks,
    offloader_of,
    selective_kept_offloaded,
)
from memfit.levers.tiled_mlp import install_tiled_mlp
from memfit.measuring.fake_profile import memory_profile
from memfit.measuring.preserve import create_optimizer_state, preserved
from memfit.measuring.profile import Profiler
from memfit.measuring.tracker import MemoryWatch
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.models.llama import llama
from memfit.precision import Precision
from memfit.records import Plan
from memfit.records.long_context import HostLinkFacts
from memfit.step import training_step
from memfit.stepmodel.offload import moved_bytes, offload_price

Batch = tuple[torch.Tensor, torch.Tensor]
BLOCKS = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]


def _llama(seq: int = 64, rows: int = 2) -> tuple[nn.Module, Batch]:
    torch.manual_seed(0)
    model = llama(preset="tiny", block_size=seq, n_embd=64, n_head=4, n_layer=4).model
    x = torch.randint(0, 256, (rows, seq), generator=torch.Generator().manual_seed(1))
    return model, (x, torch.roll(x, -1, 1))


def _gpt() -> tuple[nn.Module, Batch]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=32, n_head=2, block_size=32))
    x = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(1))
    return model, (x, torch.roll(x, -1, 1))


def _step(model: nn.Module, batch: Batch) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = gpt_loss(model, batch)
    loss.backward()
    return [loss.detach(), *(p.grad.clone() for p in model.parameters())]


@pytest.mark.parametrize("build", [_llama, _gpt], ids=["llama", "gpt"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("blocks", [BLOCKS, ["blocks.1", "blocks.3"]], ids=["all", "some"])
def test_an_offloaded_step_is_exact(build, mode: str, blocks: list[str]) -> None:
    model, batch = build()
    if mode != "none":
        memfit.checkpoint(model, mode=mode)
    plain = _step(model, batch)
    offloader = offload_blocks(model, blocks)
    got = _step(model, batch)
    for a, b in zip(plain, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)  # the same values, copied and back
    assert offloader.moved_to_host > 0 and offloader.host_bytes == 0  # every host copy freed


@pytest.mark.parametrize("mode", ["none", "full"])
def test_offload_composes_with_the_chunked_head_and_the_tiled_mlp(mode: str) -> None:
    model, batch = _llama()
    if mode != "none":
        memfit.checkpoint(model, mode=mode)
    plain = _step(model, batch)
    install_chunked_head(model, chunk_tokens=24)
    install_tiled_mlp(model, chunks=4)
    offloader = offload_blocks(model, BLOCKS, record=True)
    got = _step(model, batch)
    for a, b in zip(plain, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)  # the head's and MLP's chunk sums
    assert ("prefetch", "blocks.0") in [(e, b) for e, b, _ in offloader.log]


def _order(log: list[tuple[str, str, int]]) -> list[str]:
    """The log as ``event block`` lines, each run of uses of one block as one ``use`` line."""
    out: list[str] = []
    for event, block, _ in log:
        line = f"{event} {block.removeprefix('blocks.')}"
        if not (event == "use" and out and out[-1] == line):
            out.append(line)
    return out


def test_the_copy_schedule_runs_in_the_order_of_its_note() -> None:
    """Full checkpointing: each block keeps its input. Copies start as each block's forward ends;
    a block's device copy goes when the next offloaded block's forward has ended; the last is
    kept; the first use of a block's input brings the block before it back (the prefetch)."""
    model, batch = _llama()
    memfit.checkpoint(model, mode="full")
    offloader = offload_blocks(model, BLOCKS, record=True)
    _step(model, batch)
    assert _order(offloader.log) == [
        "offload 0", "offload 1", "release 0", "offload 2", "release 1", "offload 3", "release 2",
        "keep 3", "prefetch 2", "use 3", "prefetch 1", "use 2", "prefetch 0", "use 1", "use 0",
    ]  # fmt: skip
    one_input = 2 * 64 * 64 * 4  # rows x positions x width, fp32
    assert offloader.moved_to_host == offloader.peak_host_bytes == 4 * one_input
    assert offloader.moved_to_device == 3 * one_input  # the last block's input never left
    offloader.log.clear()
    offload_blocks(model, ["blocks.0", "blocks.2"], record=True)
    offloader = offloader_of(model)
    assert offloader is not None and offloader.record
    _step(model, batch)
    assert _order(offloader.log) == [
        "offload 0",
        "offload 2",
        "release 0",
        "keep 2",
        "prefetch 0",
        "use 2",
        "use 0",
    ]


def test_micro_batches_and_a_retained_graph_bring_the_copies_back_each_time() -> None:
    model, batch = _llama()
    memfit.checkpoint(model, mode="full")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    plain = training_step(model, batch, gpt_loss, opt, Precision("fp32"), micro_batches=2)
    grads = [p.grad.clone() for p in model.parameters()]
    offload_blocks(model, BLOCKS)
    got = training_step(model, batch, gpt_loss, opt, Precision("fp32"), micro_batches=2)
    assert got.loss == plain.loss
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    model.zero_grad(set_to_none=True)
    loss = gpt_loss(model, batch)
    loss.backward(retain_graph=True)
    once = [p.grad.clone() for p in model.parameters()]
    loss.backward()  # every saved tensor asked for again: copied back again
    for p, g in zip(model.parameters(), once, strict=True):
        torch.testing.assert_close(p.grad, 2 * g, rtol=1e-6, atol=0)


def test_offload_is_undone_and_survives_a_copy() -> None:
    model, batch = _llama()
    offload_blocks(model, BLOCKS[:2])
    assert offloaded_blocks(model) == BLOCKS[:2]
    offload_blocks(model, BLOCKS[2:])  # replaces the earlier call
    assert offloaded_blocks(model) == BLOCKS[2:]
    twin = copy.deepcopy(model)  # its own offloader, nothing in flight
    assert offloaded_blocks(twin) == BLOCKS[2:] and offloader_of(twin) is not offloader_of(model)
    assert offloaded_blocks(pickle.loads(pickle.dumps(model))) == BLOCKS[2:]
    torch.testing.assert_close(_step(twin, batch)[0], _step(model, batch)[0], rtol=0, atol=0)
    clear_offload(model)
    assert offloaded_blocks(model) == [] and offloader_of(model) is None
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_an_input_changed_after_the_forward_is_named_or_taken_from_the_host_copy() -> None:
    """Checkpointed and kept on the device, a block's input changed in place after its forward is
    named; offloaded, the recompute starts from the host copy: what the forward saw."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)))
    memfit.checkpoint(model, blocks=["0", "1", "2"], mode="full")
    x = torch.randn(8, 64, requires_grad=True)

    def grads(offloaded: list[str], change: bool) -> list[torch.Tensor]:
        offload_blocks(model, offloaded, min_bytes=0)
        model.zero_grad(set_to_none=True)
        h = model[0](x)
        y = model[2](model[1](h))
        if change:
            h.add_(1.0)  # the caller changes block 1's input after its forward
        y.sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    with pytest.raises(
        CheckpointError, match="input of the checkpointed block Sequential was modified in place"
    ):
        grads([], change=True)
    expected = grads([], change=False)
    for offloaded in (["1", "2"], ["1"]):  # block 1 let go and brought back; block 1 kept (the last)
        for a, b in zip(grads(offloaded, change=True), expected, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_lever_a_plan_applies_stays_refused_on_a_cpu() -> None:
    model, _ = _llama()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(LeverRefused, match="offload moves activations to host memory, which on a CPU"):
        memfit.apply(
            model, Plan(blocks={}, levers=["offload"], lever_settings={"offload": {"blocks": BLOCKS}}), opt
        )


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_the_device_peak_is_priced_to_the_byte(mode: str) -> None:
    """MemTracker around a whole step (optimizer state made) against offload_price on the
    step's profile (fake tensors, no offload), for every block and for two of them."""
    model, batch = _llama(seq=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    profile = memory_profile(model, batch, gpt_loss, opt, "fp32")
    link = HostLinkFacts("cpu", 1e9, 1e9)
    for blocks in (BLOCKS, ["blocks.0", "blocks.2"]):
        with preserved(model, opt):
            if mode != "none":
                memfit.checkpoint(model, mode=mode)
            offloader = offload_blocks(model, blocks)
            create_optimizer_state(model, opt)
            with MemoryWatch(model, opt) as watch:
                training_step(model, batch, gpt_loss, opt, Precision("fp32"))
            clear_offload(model)
            memfit.uncheckpoint(model)
        moved = moved_bytes(profile, mode, blocks, selective_kept=selective_kept_offloaded())
        price = offload_price(profile, mode, moved, link)
        print(f"{mode} {blocks}: measured {watch.peak_bytes:,} B, priced {price.peak_bytes:,} B "
              f"(without offload {price.plain_peak_bytes:,} B), host {price.host_bytes:,} B")  # fmt: skip
        assert price.peak_bytes == watch.peak_bytes
        assert price.to_host_bytes == offloader.moved_to_host


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload moves activations off a CUDA device")
def test_offload_on_cuda_is_exact_and_lowers_the_peak_as_priced() -> None:
    """Six fully checkpointed blocks at 4,096 tokens on CUDA, every block's input offloaded: the
    same loss and gradients, and the CUDA allocator's peak falls by the price's bytes (within
    5%: the allocator rounds each block to 512 bytes)."""
    torch.manual_seed(0)
    model = llama(
        preset="tiny", block_size=4096, n_embd=256, n_head=4, n_layer=6, vocab_size=4096
    ).model.cuda()
    x = torch.randint(0, 4096, (1, 4096), generator=torch.Generator().manual_seed(1)).cuda()
    batch = (x, torch.roll(x, -1, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    blocks = memfit.find_blocks(model)
    with preserved(model, opt):  # tracked steps: fake tensors would not take CUDA's attention kernel
        profiler = Profiler(model, batch, gpt_loss, opt, Precision("fp32"))
        profiler.none()
        profiler.modes(["full"])
        profile = profiler.result()
    peaks, grads = {}, {}
    for name, offloaded in (("plain", []), ("offload", blocks)):
        with preserved(model, opt):
            memfit.checkpoint(model, mode="full")
            offload_blocks(model, offloaded)
            create_optimizer_state(model, opt)
            with MemoryWatch(model, opt) as watch:
                training_step(model, batch, gpt_loss, opt, Precision("fp32"))
            # kept on the CPU: on the device they would count in the next variant's allocator peak
            # (the first H200 run read a drop of -7,877,632 B: these 28,849,152 B less the
            # priced 20,971,520 B)
            grads[name] = [p.grad.detach().cpu() for p in model.parameters()]
            clear_offload(model)
            memfit.uncheckpoint(model)
        peaks[name] = watch.peak_bytes
    price = offload_price(
        profile, "full", moved_bytes(profile, "full", blocks), HostLinkFacts("cuda", 1e10, 1e10)
    )
    drop, priced = peaks["plain"] - peaks["offload"], price.plain_peak_bytes - price.peak_bytes
    print(f"offload on CUDA: peak {peaks['offload']:,} B, {peaks['plain']:,} B without; "
          f"drop {drop:,} B, priced {priced:,} B")  # fmt: skip
    assert drop > 0 and abs(drop - priced) <= 0.05 * priced
    for a, b in zip(grads["offload"], grads["plain"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload moves activations off a CUDA device")
def test_offload_on_cuda_lowers_the_peak_and_keeps_the_gradients() -> None:
    """Every block's saved activations in pinned host memory: the CUDA allocator's peak drops,
    the gradients are the same (benchmarks/gpu_check.sh prints the numbers)."""
    from memfit.applying import apply, remove_levers

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=6, n_embd=384, n_head=6, block_size=256)).cuda()
    x = torch.randint(0, 256, (8, 256), device="cuda")
    blocks = memfit.find_blocks(model)
    peaks, grads = {}, {}
    for name, plan in (
        ("plain", Plan(blocks={})),
        ("offload", Plan(blocks={}, levers=["offload"], lever_settings={"offload": {"blocks": blocks}})),
    ):
        opt = apply(model, plan, torch.optim.AdamW(model.parameters(), lr=1e-3)).optimizer
        with MemoryWatch(model, opt) as watch:
            model.zero_grad(set_to_none=True)
            gpt_loss(model, (x, x)).backward()
        peaks[name] = watch.peak_bytes
        grads[name] = [p.grad.detach().cpu() for p in model.parameters()]  # off the device: not counted
        remove_levers(model, opt)
    print(
        f"offload on CUDA: peak {peaks['offload']:,} B with every block offloaded, "
        f"{peaks['plain']:,} B without"
    )
    assert peaks["offload"] < 0.8 * peaks["plain"]
    for a, b in zip(grads["offload"], grads["plain"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
