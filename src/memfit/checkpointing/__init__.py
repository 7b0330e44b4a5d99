"""Activation checkpointing: which blocks, how each is recomputed, and the contexts that do it.

One concern, one package (as PyTorch keeps ``checkpoint``, ``checkpoint_sequential``, SAC and
``CheckpointError`` in ``torch/utils/checkpoint.py``):

- :mod:`~memfit.checkpointing.blocks`: ``find_blocks``, the repeated unit at any depth, and
  ``block_reasons``, why each was chosen (with :mod:`~memfit.checkpointing.structure`: what a
  module's code says, a residual unit or a head);
- :mod:`~memfit.checkpointing.modes`: ``checkpoint`` / ``uncheckpoint`` / ``set_block_modes``,
  per block ``none``, ``selective`` or ``full``;
- :mod:`~memfit.checkpointing.segments`: a run of blocks checkpointed as one (the one chain
  mechanism, also used by ``memfit bench``'s ``checkpoint_sequential``), and the chain probe;
- :mod:`~memfit.checkpointing.recompute`: one checkpointed call, exact for any number of
  backwards (argument containers copied, copies before in-place writes;
  :class:`~memfit.errors.CheckpointError` where it cannot);
- :mod:`~memfit.checkpointing.buffers`: the buffers a forward writes, written once per step;
- :mod:`~memfit.checkpointing.writes`: what an op writes, declared or not;
- :mod:`~memfit.checkpointing.policy`: the selective-checkpointing (SAC) policy;
- :mod:`~memfit.checkpointing.layers`: the removable instance-level ``forward`` overrides;
- :mod:`~memfit.checkpointing.compile`: ``torch.compile`` helpers and the eager switch;
- :mod:`~memfit.checkpointing.hf`: what checkpointing must know of Hugging Face models.

Example:
    >>> from memfit.models.gpt import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> _ = checkpoint(model, mode="selective", blocks=["blocks.1"])
    >>> checkpointed_blocks(model)
    {'blocks.1': 'selective'}
"""

from memfit.checkpointing.blocks import block_reasons, find_blocks, resolve_blocks
from memfit.checkpointing.modes import (
    checkpoint,
    checkpoint_contexts,
    checkpointed_blocks,
    refuse_double_checkpointing,
    set_block_modes,
    uncheckpoint,
)
from memfit.checkpointing.segments import applied_segments, set_segments
from memfit.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "applied_segments",
    "block_reasons",
    "checkpoint",
    "checkpoint_contexts",
    "checkpointed_blocks",
    "find_blocks",
    "refuse_double_checkpointing",
    "resolve_blocks",
    "set_block_modes",
    "set_segments",
    "uncheckpoint",
]
