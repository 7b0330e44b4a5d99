"""``memfit doctor``: what this machine can do for memory-saving training."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from memfit.budget import format_bytes
from memfit.devices import all_device_facts, default_device, device_facts, recommendation_line

__all__ = ["doctor_facts", "run"]


def _features() -> dict[str, bool]:
    import inspect

    import torch.utils.checkpoint as ckpt

    return {
        "non_reentrant_checkpoint": "use_reentrant" in inspect.signature(ckpt.checkpoint).parameters,
        "selective_checkpoint": hasattr(ckpt, "create_selective_checkpoint_contexts"),
        "torch_compile": hasattr(torch, "compile"),
        "mem_tracker": _has_mem_tracker(),
    }


def _has_mem_tracker() -> bool:
    try:
        from torch.distributed._tools.mem_tracker import MemTracker  # noqa: F401
    except ImportError:
        return False
    return True


def doctor_facts() -> dict[str, object]:
    """Everything ``memfit doctor`` reports, as plain data."""
    devices = all_device_facts()
    main = device_facts(default_device())
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "devices": [d.to_dict() for d in devices],
        "features": _features(),
        "default_device": main.name,
        "recommendation": recommendation_line(main),
    }


def run(args: argparse.Namespace) -> int:
    """Print the facts."""
    facts = doctor_facts()
    if args.json:
        json.dump(facts, sys.stdout, indent=2)
        print()
        return 0
    print(f"torch {facts['torch']} (CUDA {facts['cuda'] or 'not built in'})")
    for d in all_device_facts():
        cap = f", compute capability {d.capability[0]}.{d.capability[1]}" if d.capability else ""
        print(f"\n{d.name}: {d.description}{cap}, {format_bytes(d.total_memory)}")
        for label, runs, native in (
            ("bf16", d.bf16_runs, d.bf16_native),
            ("fp16", d.fp16_runs, d.fp16_native),
        ):
            state = (
                "native, fast"
                if native
                else ("works, not fast here (see the notes)" if runs else "not supported")
            )
            print(f"  {label}: {state}")
        print(f"  autocast dtypes: {', '.join(d.autocast_dtypes) or 'none'}")
        for note in d.notes:
            print(f"  note: {note}")
    print()
    for name, ok in facts["features"].items():  # type: ignore[attr-defined]
        print(f"{name.replace('_', ' ')}: {'yes' if ok else 'no'}")
    print(f"\nrecommendation ({facts['default_device']}): {facts['recommendation']}")
    return 0
