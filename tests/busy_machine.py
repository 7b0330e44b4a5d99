"""What the plan-repeat tests share: every core kept busy, and a plan's identity.

``tests/test_plan_repeat.py`` (full fine-tuning) and ``tests/integrations/test_peft_plan.py``
(a LoRA model) plan three times while :func:`busy_cores` runs, and compare :func:`plan_key`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

import memfit


@contextmanager
def busy_cores() -> Iterator[list[subprocess.Popen[bytes]]]:
    """A Python process spinning on each core while the body runs, ended after it (and
    torch's thread count, which timing may change, put back). The body starts once every
    process has said it is spinning: one still starting up (reading its modules) may not be
    runnable yet."""
    hogs: list[subprocess.Popen[bytes]] = []
    threads = torch.get_num_threads()
    try:
        for _ in range(os.cpu_count() or 1):
            spin = "print('spinning', flush=True)\nwhile True: pass"
            hogs.append(subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE))
        for hog in hogs:
            assert hog.stdout is not None and hog.stdout.readline() == b"spinning\n"
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()
        torch.set_num_threads(threads)


def plan_key(plan: memfit.Plan) -> str:
    """What two plans must share to be the same plan."""
    return json.dumps((plan.blocks, plan.segments, plan.precision, plan.micro_batches))
