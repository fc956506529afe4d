"""The ``--small`` / full-size defaults that several benchmark scripts share."""

from __future__ import annotations

import argparse
from typing import Any


def fill_size_defaults(args: argparse.Namespace, small: dict[str, Any],
                       full: dict[str, Any]) -> argparse.Namespace:
    """Set every size option left unset (None) to ``small``'s value under ``--small``, else
    ``full``'s; returns ``args``."""
    for name, value in (small if args.small else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args
