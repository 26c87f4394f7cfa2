"""``python -m scratchlm`` is the same as the ``scratchlm`` console script."""

from scratchlm.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
