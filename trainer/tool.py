"""How a command-line tool ends on Ctrl-C: one line saying what it leaves, exit status 130. Imports nothing heavy,
so that it holds from the tool's first import on (torch and the model registry take seconds)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn


def run_tool(main: Callable[[], int], interrupted: str) -> NoReturn:
    """``sys.exit(main())``; Ctrl-C anywhere in ``main`` (its imports, loading) prints ``interrupted`` instead of
    a KeyboardInterrupt traceback."""
    try:
        code = main()
    except KeyboardInterrupt:
        print(f"\n{interrupted}", file=sys.stderr, flush=True)
        code = 130
    sys.exit(code)
