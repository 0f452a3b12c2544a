"""`python -m torchkvops ...`: the same as the `torchkvops` command (torchkvops.cli)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
