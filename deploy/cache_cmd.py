"""`tandem cache clear`: delete the KV disk tier's files.

KV blocks on disk can be turned back into the prompts that made them; this
removes them at once, rather than waiting for `--cache-disk-ttl`. Only a
folder laid out as the disk tier lays it out is touched
(cache_service/disk_layout.py): one holding anything else is refused whole,
so a mistyped `--cache-dir` deletes nothing.

A server may be running on the folder: its disk tier takes a deleted file for
a miss, so clearing is safe; what it holds in shared memory stays cached until
it stops (never written to disk again), and new prompts' blocks are written as
before.
"""

from __future__ import annotations

import argparse
import sys

from cache_service.disk_layout import clear_folder
from environment.settings import Settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cache_command", required=True)
    clear = sub.add_parser("clear", help="delete the KV blocks the disk tier keeps (prompts can be read back from them)",
                           description="Delete the KV block files of the disk tier. A running server goes on: it "
                           "misses the deleted blocks, keeps those it holds in memory until it stops, and writes "
                           "the blocks of new prompts.")
    clear.add_argument("--cache-dir", default=Settings().cache_dir,
                       help="the disk tier's folder, as given to `tandem serve --cache-dir` (default: %(default)s)")
    clear.set_defaults(run=run_clear)


def run_clear(args: argparse.Namespace) -> int:
    """0 when the folder holds no KV block file any more (one line saying
    what went), 1 (a line on stderr) when it was refused or unreadable."""
    folder = args.cache_dir
    try:
        files, nbytes = clear_folder(folder)
    except (ValueError, OSError) as exc:
        print(f"tandem cache clear: nothing deleted: {exc}", file=sys.stderr)
        return 1
    if files == 0:
        print(f"{folder}: no KV block files to delete")
    else:
        print(f"{folder}: deleted {files} KV block file{'s' if files != 1 else ''} ({_size(nbytes)}); "
              "a server still running keeps the blocks it holds in memory until it stops")
    return 0


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"
