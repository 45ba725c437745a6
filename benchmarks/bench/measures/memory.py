"""Peak resident memory of a process and all its descendants, sampled in a thread.

Linux: each process's VmHWM (its own peak RSS, kept by the kernel) from
/proc/PID/status, so a short spike between samples is still seen; sampling
only has to find the processes (workers start, restart and exit) and track
the summed current RSS. macOS: best effort, `ps` RSS at each sample, so a
peak between samples is missed.

RSS counts shared pages (a shared-memory arena, mapped weights) once per
process that touches them, so the per-process peaks can add up to more than
the machine ever used; both the sum of peaks and the peak of the sum are kept.
On Linux the peak of the summed PSS (proportional set size: a page shared by
n processes counts 1/n in each, /proc/PID/smaps_rollup) is kept too: what
the tree really holds, the arena counted once. It is the figure systems are
compared by when both have it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading


class ProcessTreeMemory:
    def __init__(self, root_pid: int, interval: float = 0.5):
        self.root_pid = root_pid
        self.interval = interval
        self.peaks: dict[int, int] = {}  # pid -> peak RSS bytes
        self.names: dict[int, str] = {}
        self.peak_total = 0  # max over samples of the summed current RSS
        self.peak_total_pss = 0  # max over samples of the summed PSS (Linux; 0 elsewhere)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Take one last sample and end the thread."""
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(timeout=5)
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        total = total_pss = 0
        for pid in tree_pids(self.root_pid):
            current, peak = rss_bytes(pid)
            if current is None:
                continue
            total += current
            total_pss += pss_bytes(pid) or 0
            self.peaks[pid] = max(self.peaks.get(pid, 0), peak or current)
            if pid not in self.names:
                self.names[pid] = process_name(pid)
        self.peak_total = max(self.peak_total, total)
        self.peak_total_pss = max(self.peak_total_pss, total_pss)

    def report(self) -> dict:
        procs = [{"pid": pid, "name": self.names.get(pid, "?"), "peak_rss_bytes": peak}
                 for pid, peak in sorted(self.peaks.items())]
        return {"processes": procs, "sum_of_peaks_bytes": sum(self.peaks.values()),
                "peak_total_rss_bytes": self.peak_total,
                "peak_total_pss_bytes": self.peak_total_pss or None,
                "method": "VmHWM per process (/proc)" if sys.platform.startswith("linux") else "ps RSS samples"}


def tree_pids(root: int) -> list[int]:
    """root and every descendant alive now."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parent_map().items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _parent_map() -> dict[int, int]:
    if sys.platform.startswith("linux"):
        parents = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # The name (field 2) may hold spaces and parentheses: split after its last ')'.
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
        return parents
    try:
        out = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {int(a): int(b) for a, b in (line.split() for line in out.splitlines() if line.strip())}


def rss_bytes(pid: int) -> tuple[int | None, int | None]:
    """(current RSS, peak RSS) in bytes; (None, None) when the process is gone."""
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            return None, None
        def kb(key):  # noqa: E306
            return int(fields[key].split()[0]) * 1024 if key in fields else None
        current = kb("VmRSS")
        return (current, kb("VmHWM")) if current is not None else (None, None)  # zombies have no VmRSS
    try:
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True, timeout=5).stdout
        return (int(out.strip()) * 1024,) * 2 if out.strip() else (None, None)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None, None


def pss_bytes(pid: int) -> int | None:
    """Proportional set size in bytes (Linux), None where unknown."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def process_name(pid: int) -> str:
    """A short label: the command line's interesting part (e.g. 'deploy.cli serve', 'mlx_lm.server')."""
    try:
        if sys.platform.startswith("linux"):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        else:
            argv = subprocess.run(["ps", "-o", "command=", "-p", str(pid)], capture_output=True, text=True,
                                  timeout=5).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "?"
    if not argv:
        return "?"
    # Python processes: show what runs, not the interpreter.
    if "python" in os.path.basename(argv[0]):
        rest = argv[1:]
        while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
            rest = rest[1:]  # interpreter options such as -B, -u
        if rest[:1] == ["-m"] and len(rest) > 1:  # the module, and a subcommand if one follows
            return " ".join(rest[1:3] if len(rest) > 2 and not rest[2].startswith("-") else rest[1:2])
        if rest and rest[0] == "-c":
            return _spawned_role(argv) or "python -c"
        return " ".join(os.path.basename(a) for a in rest[:2]) or "python"
    return " ".join([os.path.basename(argv[0]), *argv[1:2]])


def _spawned_role(argv: list[str]) -> str | None:
    """multiprocessing 'spawn' children run `python -c 'from multiprocessing.spawn import spawn_main; ...'`."""
    text = " ".join(argv)
    if "multiprocessing.spawn" in text:
        return "spawned child"
    if "resource_tracker" in text:
        return "resource tracker"
    return None
