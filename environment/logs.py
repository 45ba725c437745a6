"""Logging set-up shared by every Tandem process: one line per record, tagged with the process role."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(level: str, tag: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s [{tag} {os.getpid()}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
