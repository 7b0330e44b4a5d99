"""Peak bytes of checkpointed steps with two copies of memfit's code: byte-equal where nothing changed.

The exactness work on the recompute (issue 34: a recompute per backward, aliased inputs,
buffers a forward writes) must cost nothing where those cases do not occur. This script
measures ``memfit.measure(...).peak_bytes`` (MemTracker on a CPU: exact, stable bytes) for
the built-in GPT and zoo models under full and selective checkpointing (and one segment),
once with each source tree, each in a fresh process, and prints both and whether they are
equal to the byte.

Run (the zoo models need the extras environment)::

    .venv-extras/bin/python benchmarks/peaks_checkpoint_exact.py --before /path/to/main/src --after src
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: (case, zoo entry or "gpt", variant); variants: full, selective, or a segment of blocks.
CASES = [
    ("gpt", "full"),
    ("gpt", "selective"),
    ("gpt", "segment"),
    ("torchvision/densenet", "full"),
    ("torchvision/densenet", "selective"),
    ("timm/resnet18d", "full"),
    ("timm/resnet18d", "selective"),
    ("timm/efficientnet_b0", "full"),
    ("timm/efficientnet_b0", "selective"),
    ("transformers/gpt2", "full"),
    ("transformers/gpt2", "selective"),
]


def _gpt() -> tuple[Any, Any, Any, list[str]]:
    import torch

    from memfit.models.gpt import GPT, GPTConfig, gpt_loss

    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (8, cfg.block_size), generator=torch.Generator().manual_seed(1))
    return model, (x, x), gpt_loss, [f"blocks.{i}" for i in range(cfg.n_layer)]


def _zoo(name: str) -> tuple[Any, Any, Any, list[str]]:
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "integrations"))
    from zoo import all_entries

    entry = next(e for e in all_entries() if e.name == name)
    torch.manual_seed(0)
    return entry.build(), entry.batch(entry.large), entry.loss, entry.blocks


def worker(cases: list[tuple[str, str]]) -> dict[str, int]:
    """Peak bytes per case, with whatever ``memfit`` this process imports."""
    import torch

    import memfit
    from memfit.checkpointing import set_segments

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = {}
    for name, variant in cases:
        model, batch, loss, blocks = _gpt() if name == "gpt" else _zoo(name)
        if variant == "segment":
            set_segments(model, [blocks[:2]])
        else:
            memfit.checkpoint(model, mode=variant)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        out[f"{name} {variant}"] = memfit.measure(model, batch, loss, opt, "fp32", steps=1).peak_bytes
    return out


def _run(src: str, cases: list[tuple[str, str]]) -> dict[str, int]:
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, __file__, "--worker", json.dumps(cases)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="/work/main/src", help="the source tree to compare against")
    parser.add_argument("--after", default=str(ROOT / "src"), help="this change's source tree")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--gpt-only", action="store_true", help="skip the zoo models (no extras needed)")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker([tuple(c) for c in json.loads(args.worker)])))
        return
    cases = [c for c in CASES if not args.gpt_only or c[0] == "gpt"]
    before, after = _run(args.before, cases), _run(args.after, cases)
    print("| model, checkpointing | peak bytes before | peak bytes after | equal |")
    print("|---|---|---|---|")
    for key in before:
        print(f"| {key} | {before[key]:,} | {after[key]:,} | {before[key] == after[key]} |")
    print(f"all equal to the byte: {before == after}")


if __name__ == "__main__":
    main()
