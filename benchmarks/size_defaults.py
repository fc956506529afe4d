"""The ``--small`` / full-size defaults that several benchmark scripts share."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_step_size_options(parser: argparse.ArgumentParser, small: dict[str, Any],
                          full: dict[str, Any]) -> None:
    """``--small``, ``--out`` and one step's sizes (``--requests``, ``--vocab``, ``--top-k``),
    left unset for ``fill_size_defaults``."""
    parser.add_argument("--small", action="store_true", help=f"Small sizes {small}.")
    parser.add_argument("--out", type=Path, help="Write the results as JSON here.")
    parser.add_argument("--requests", type=int, help=f"R (default {full['requests']}).")
    parser.add_argument("--vocab", type=int, help=f"V (default {full['vocab']}).")
    parser.add_argument("--top-k", type=int, help=f"Ids per row (default {full['top_k']}).")


def fill_size_defaults(args: argparse.Namespace, small: dict[str, Any],
                       full: dict[str, Any]) -> argparse.Namespace:
    """Set every size option left unset (None) to ``small``'s value under ``--small``, else
    ``full``'s; returns ``args``."""
    for name, value in (small if args.small else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args
