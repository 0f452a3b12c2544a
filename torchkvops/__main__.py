"""`python -m torchkvops ...`: the same as the `torchkvops` command (torchkvops.cli.main)."""

from .cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
