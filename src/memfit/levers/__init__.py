"""What each lever does to a model or an optimizer: the mechanics the lever objects of
:mod:`memfit.applying` wrap.

Checkpointing and micro-batches shrink activations; the model state (fp32 weights, their
gradients and AdamW's two moments: 16 bytes per parameter) stays. A plan's ``levers`` may
also use, each only when asked (``memfit.plan(..., levers="all" | [names])``):

- ``fused_step``: the optimizer step fused into the backward (:mod:`.fused`): gradients
  are never all alive. Exact: the same weights as the unfused step.
- ``state_bf16`` / ``state_8bit`` / ``state_4bit``: Adam's moments in bf16, or block-wise
  quantized by torchao (:mod:`.optim`): 4, about 2 or about 1 byte per parameter instead of 8.
- ``weights_bf16``: bf16 weights without an fp32 master copy, updates rounded
  stochastically (:mod:`.weights`, :mod:`.optim`).
- ``offload``: chosen blocks' saved activations in pinned host memory (:mod:`.offload`,
  CUDA only).
- ``chunked_loss``: the loss head in chunks of tokens (:mod:`.head`, :mod:`.loss_head`).
- ``frozen_bf16`` / ``frozen_nf4``: the frozen weights (``requires_grad=False``) in bf16, or
  their Linear weights in QLoRA's NF4 through torchao (:mod:`.frozen`).

Which can run where, what each changes in the step model and how a plan applies them is
:mod:`memfit.applying` (one module per lever); ``memfit check --levers`` proves they still
train the same model.
"""

from memfit.levers.fused import FusedStep, fused_step_of
from memfit.levers.optim import lever_optimizer

__all__ = ["FusedStep", "fused_step_of", "lever_optimizer"]
