"""Run by ``test_plan_room.py`` in a subprocess: ``memfit train`` with a budget under ``RLIMIT_AS``.

``python train_rlimit_worker.py ALLOWANCE memfit-args...`` lowers the address-space limit to
what is in use now (torch imported, nothing built) plus ALLOWANCE bytes, then runs the
command line as ``memfit`` would and exits with its code.
"""

from __future__ import annotations

import resource
import sys

from memfit.cli.main import main


def _address_space() -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmSize"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


if __name__ == "__main__":
    allowance, argv = int(sys.argv[1]), sys.argv[2:]
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + allowance, hard))
    sys.exit(main(argv))
