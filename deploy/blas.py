"""Run MLX's CPU backend on OpenBLAS instead of the wheel's bundled BLAS.

The Linux `mlx[cpu]` wheel links a reference BLAS that is ~35x slower
than OpenBLAS for prefill, ~2x for decode (BENCHMARKS.md). A library can only
be swapped in before the process starts, so the command line re-executes
itself once with LD_PRELOAD set; processes it spawns later inherit it.
"""

from __future__ import annotations

import os
import sys

OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)


def openblas_path() -> str | None:
    """The Debian/Ubuntu `libopenblas0-pthread` BLAS, if installed here."""
    if not sys.platform.startswith("linux"):
        return None
    return next((p for p in OPENBLAS_PATHS if os.path.exists(p)), None)


def reexec_with_openblas() -> None:
    """Re-execute this process with OpenBLAS preloaded, once. Returns
    normally (doing nothing) off Linux, without OpenBLAS, when it is already
    preloaded, or when TANDEM_NO_OPENBLAS is set (to measure or debug the
    bundled BLAS)."""
    lib = openblas_path()
    if lib is None or os.environ.get("TANDEM_NO_OPENBLAS"):
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if lib in preload.replace(":", " ").split():
        return
    env = dict(os.environ, LD_PRELOAD=f"{lib} {preload}".strip())
    # sys.orig_argv keeps the interpreter's own flags and `-m module`, so the
    # new process starts exactly as this one did (sys.argv has lost them).
    argv = [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)


def share_cores(mlx_processes: int) -> int | None:
    """Give each MLX worker process an equal share of the cores for OpenBLAS
    (set before they start; they inherit it). OpenBLAS sizes its thread pool
    to every core and its idle threads spin, so two workers with a pool each
    on a 2-core machine fight over the cores: one thread each made the swarm
    benchmark 1.4x faster end to end (BENCHMARKS.md). Returns the threads
    set, or None where nothing was changed (the user chose, or no OpenBLAS)."""
    if "OPENBLAS_NUM_THREADS" in os.environ or openblas_path() is None or mlx_processes < 1:
        return None
    threads = max(1, (os.cpu_count() or 1) // mlx_processes)
    os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
    return threads
