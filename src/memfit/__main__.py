"""``python -m memfit``: the memfit command line (what ``torchrun -m memfit`` starts)."""

from memfit.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
