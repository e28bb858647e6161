"""``python -m simulations SCENARIO.toml [--json OUT] [--plots DIR] [--seed N]``."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
