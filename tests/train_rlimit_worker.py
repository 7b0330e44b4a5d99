"""Run by ``test_plan_room.py`` in a subprocess: ``memfit train`` with a budget under ``RLIMIT_AS``.

``python train_rlimit_worker.py ALLOWANCE memfit-args...`` lowers the address-space limit to
what is in use now (torch imported, nothing built) plus ALLOWANCE bytes, then runs the
command line as ``memfit`` would and exits with its code.
"""

from __future__ import annotations

import sys

import torch  # noqa: F401  (imported before the limit: the CLI imports it lazily, when it runs)
from rlimit import limit_address_space

import memfit.app.run  # noqa: F401  (memfit train's modules, likewise)
from memfit.cli.main import main

if __name__ == "__main__":
    allowance, argv = int(sys.argv[1]), sys.argv[2:]
    limit_address_space(allowance)
    sys.exit(main(argv))
