"""A fake-tensor twin of a real model, its optimizer and a batch: a step measured, nothing allocated.

Planning a step that does not fit the device cannot run it. The twin is a copy of the model
whose parameters and buffers are ``FakeTensor``s of the same shapes, dtypes and devices
(PyTorch's ``FakeTensorMode``: no storage), with an optimizer of the same class and
hyper-parameters over them; the same :func:`memfit.measuring.phases.phased_step` then runs
on it under the same MemTracker accounting a real step has, so its bytes are what the real
step would hold (:mod:`memfit.measuring.estimate` does the same for a model built from its
constructor).

The twin runs under :class:`memfit.measuring.fakebuild.FakeFallbacks`, as an estimate does:
the batch keeps its values, and so do the positions a model makes from a length, so a forward
that reads them (a check of the labels' range, Hugging Face's choice of an attention mask)
takes the path the real step takes (See Note [positions keep their values]).

Trade-off: nothing else is computed, so a model whose forward reads the values of its
activations (a data-dependent branch, ``.item()``) cannot run on a twin; :func:`make_twin` or
the step then fails, and the caller measures for real where that fits (the error says why).

Example:
    >>> import torch
    >>> from memfit.precision import Precision
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> from memfit.measuring.phases import phased_step
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> x = torch.randint(0, 256, (2, 16))
    >>> twin = make_twin(model, None, (x, x))
    >>> with twin.running():
    ...     fake = phased_step(twin.model, twin.batch, gpt_loss, None, Precision("fp32"), [])
    >>> real = phased_step(model, (x, x), gpt_loss, None, Precision("fp32"), [])
    >>> fake.peak == real.peak
    True
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.measuring.fakebuild import FakeFallbacks, fake_batch
from memfit.precision import Precision
from memfit.step import Batch

__all__ = ["Twin", "make_twin", "twin_precision"]


@dataclass
class Twin:
    """The fake copies; run them inside ``with twin.running():``."""

    mode: FakeTensorMode
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    batch: Batch
    fallbacks: FakeFallbacks

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Fake mode with its fallbacks: where the twin's steps run."""
        with self.mode, self.fallbacks:
            yield


def _fake_optimizer(optimizer: torch.optim.Optimizer, fakes: dict[int, Any]) -> torch.optim.Optimizer:
    """A new optimizer of the same class and per-group settings over the fake parameters."""
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [fakes[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    return type(optimizer)(groups)  # type: ignore[call-arg]


def _copy_state(
    mode: FakeTensorMode, optimizer: torch.optim.Optimizer, fake: torch.optim.Optimizer, fakes: dict[int, Any]
) -> None:
    """The real optimizer's state copied onto ``fake``'s parameters as fake tensors, or nothing
    where an entry is not a plain tensor or its parameter has no fake copy (then the caller
    creates the state with a step on the twin). See Note [the twin's optimizer state]."""
    state: dict[Any, dict[str, Any]] = {}
    for p, entry in optimizer.state.items():
        if id(p) not in fakes:
            return
        copied: dict[str, Any] = {}
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor):
                copied[key] = copy.deepcopy(value)
            elif type(value) is not torch.Tensor:
                return  # a tensor subclass (a low-bit optimizer's state): its own step makes it
            elif value.dim() == 0:  # a step count the optimizer reads: a fake constant, as made there
                number = value.item()
                with mode:
                    copied[key] = torch.tensor(number, dtype=value.dtype, device=value.device)
            else:
                copied[key] = mode.from_tensor(value)
        state[fakes[id(p)]] = copied
    fake.state.update(state)


# Note [fake tensors first, real tensors where they fail]
# A twin is tried first because it allocates nothing. Whatever it cannot do (a copy that
# fails, a forward that reads values), a real step may: a twin's failure is no verdict on
# the model or the batch. Callers catch any exception from the twin and measure (or count)
# for real, as before twins existed; the real step then judges the batch.
#
# Note [one measuring path]
# The planner measures every mode's memory on the twin wherever the twin runs, whether the
# plain step fits the room or not (issue 36): a plan made with room to spare and one made
# under a limit come from the same numbers. Where both run, MemTracker counts the same bytes
# on the twin as on real tensors in every mode, up to a CPU kernel's leftovers (a reduction
# may keep its scalar in a buffer of the batch's rows: 28-96 bytes on the tests' small
# models; tests/test_one_measuring_path.py). Across the third-party zoo
# (tests/integrations/test_zoo_twin_memory.py) 50 of 52 models match within 0.0001%; on
# BART and Swin the twin counts 0.5-2.5% more, the safe side. A real tracked step of the
# README's GPT costs 2 of its plain steps quiet and up to 10 with both cores busy; the
# twin's Python costs about the same quiet or busy. Real steps still time the step, and
# one real tracked step checks the chosen plan. memfit.profile tracks real steps where they
# fit: it reports what one measures. Where the twin cannot run, every memory step is real.
#
# Note [the twin's optimizer state]
# A step's bytes count the optimizer's state, so the twin's optimizer needs one. Created by
# a step on zero gradients under fake tensors, it cost 0.08-0.2 s of the README GPT's
# planning quiet (AdamW's ops on its fake parameters), 5-12% of it. Where the real
# optimizer has its state (the planner creates it first), the twin takes fake copies of it:
# the same shapes, dtypes and devices, so the same bytes.
#
# Note [room after the fake step]
# The device's room is read after the fake step, which loads what a first step needs
# (libraries, lazily built state); the room left then is what the real step gets.


def make_twin(model: nn.Module, optimizer: torch.optim.Optimizer | None, batch: Batch) -> Twin:
    """The model, optimizer and batch copied to fake tensors, the optimizer's state too where
    it has one (else create it on the twin with
    :func:`memfit.measuring.preserve.create_optimizer_state`).

    Raises:
        Exception: whatever copying the model raises (an attribute that cannot be copied, a
            tensor that is neither a parameter nor a buffer on a device fake tensors refuse).
    """
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fakes: dict[int, Any] = {}
    with mode:
        for t in [*model.parameters(), *model.buffers()]:
            f = mode.from_tensor(t)
            fakes[id(t)] = (
                nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
            )
        fake_model = copy.deepcopy(model, dict(fakes))
        fake_opt = _fake_optimizer(optimizer, fakes) if optimizer is not None else None
    if optimizer is not None and fake_opt is not None:
        _copy_state(mode, optimizer, fake_opt, fakes)
    inputs = fake_batch(mode, batch)
    return Twin(mode, fake_model, fake_opt, inputs, FakeFallbacks(mode, inputs))


def twin_precision(precision: Precision) -> Precision:
    """``precision`` for a fake step: the same autocast, loss scaling off.

    Loss scaling reads the gradients (``found_inf.item()``), which fake tensors cannot answer,
    and a scaler first used under fake tensors would keep a fake scale for the real steps
    after it; it holds a few scalars, so the fake step leaves it out.
    """
    fake = copy.copy(precision)
    fake.scaler = torch.amp.GradScaler(precision.device.type, enabled=False)
    return fake
