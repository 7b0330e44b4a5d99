"""Run under torchrun: plan for FSDP2 from a one-process profile, then measure each rank.

Prints one JSON line per rank: the plan's per-rank prediction and the measured peak.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from memfit.applying import apply
from memfit.measuring.profile import profile
from memfit.measuring.tracker import MemoryWatch
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.planning.choose import plan_from_profiles
from memfit.planning.sharding import shard_profile
from memfit.precision import Precision
from memfit.records import Profile
from memfit.step import training_step
from memfit.trainer.distributed import init_distributed, local_batch, wrap_model


def main() -> None:
    budget_fraction = float(sys.argv[1]) if len(sys.argv) > 1 else 0.6
    ctx, _ = init_distributed("fsdp2", torch.device("cpu"))
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=4, n_embd=64, n_head=2, block_size=64)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (16, 64), generator=g)
    batch = local_batch((x, x), ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    measured = profile(model, batch, gpt_loss, opt, "fp32")
    # NOTE: every rank must run the same plan (FSDP2's collectives must match), and measured
    # times differ by rank: plan from rank 0's profile on every rank.
    shared = [measured.to_dict()]
    dist.broadcast_object_list(shared, src=0)
    prof = shard_profile(Profile.from_dict(shared[0]), ctx.world_size)
    none = plan_from_profiles({"fp32": prof}, 1 << 40)
    budget = int(budget_fraction * none.predicted_peak_bytes)
    chosen = plan_from_profiles({"fp32": prof}, budget)
    apply(model, chosen)
    model = wrap_model(model, ctx, list(chosen.blocks))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    precision = Precision("fp32")
    micro = chosen.micro_batches
    training_step(model, batch, gpt_loss, opt, precision, micro)  # optimizer state created
    with MemoryWatch(model, opt) as watch:
        training_step(model, batch, gpt_loss, opt, precision, micro)
    row = {
        "rank": ctx.rank,
        "budget": budget,
        "unplanned_prediction": none.predicted_peak_bytes,
        "predicted": chosen.predicted_peak_bytes,
        "measured": watch.peak_bytes,
        "blocks": chosen.blocks,
        "micro_batches": chosen.micro_batches,
    }
    # NOTE: one write of the whole line: both ranks share the pipe, and print() writes the
    # newline separately, so the other rank's line could land between the two.
    sys.stdout.write("RESULT " + json.dumps(row) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
