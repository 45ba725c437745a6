"""Real ring groups for tests of what a worker group's ranks do together:
N Python processes, each running `script` as rank r of a fresh ring on
127.0.0.1 (argv: rank, hostfile), each printing one JSON line last."""

from __future__ import annotations

import json
import subprocess
import sys

from deploy.group_plan import write_hostfile


def run_ring_ranks(script: str, tmp_path, size: int = 2, timeout: float = 90) -> list:
    """Every rank's last stdout line, parsed; fails the test with the ranks'
    stderr when one exits non-zero (or is killed at `timeout`)."""
    hostfile = tmp_path / "g.hosts.json"
    write_hostfile(str(hostfile), size)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(hostfile)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(size)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
