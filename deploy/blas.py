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



def calm_blas_threads() -> bool:
    """Make OpenBLAS's idle threads sleep at once instead of spinning (set
    before the workers start; they inherit it). OpenBLAS sizes its pool to
    every core and by default spins ~2^28 cycles after each call: prefill and
    decode workers in separate processes then burn each other's cores. One
    thread per worker fixed that for the swarm but made one stream 25% slower;
    full pools that sleep at once (OPENBLAS_THREAD_TIMEOUT=4, OpenBLAS's
    minimum) kept both: 15.7 vs 11.6 tok/s at 1 client, 67 vs 47 at 16
    (BENCHMARKS.md). Returns False where nothing was changed (the user chose,
    or no OpenBLAS)."""
    if "OPENBLAS_THREAD_TIMEOUT" in os.environ or openblas_path() is None:
        return False
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = "4"
    return True
