"""How hard the machine is pressed for memory: "normal", "warn" or "critical".

Read every few seconds by the cache service (it shrinks the KV arena's
blocks, cache_service/pressure.py) and by each model worker (it drops its
hot KV tier and MLX's freed buffers, workers/memory_relief.py), so that the
caches give memory back before the system swaps.

Where the level comes from:
- Linux: PSI, /proc/pressure/memory (kernel 4.20+): the share of the last
  10 s in which some task stalled waiting for memory (reclaim, swap-in,
  thrashing). "some avg10" >= 10% is warn; >= 40%, or "full avg10" (every
  task stalled at once) >= 10%, is critical. Stalls begin only once the
  kernel reclaims, so MemAvailable from /proc/meminfo is a second, earlier
  signal: under 10% of MemTotal is warn, under 5% critical. The worse of
  the two counts; either may be missing (containers, old kernels).
- macOS: sysctl kern.memorystatus_vm_pressure_level through ctypes: 1
  normal, 2 warn, 4 critical (the levels Activity Monitor's memory
  pressure graph and DISPATCH_SOURCE_TYPE_MEMORYPRESSURE use).
- A file (`Settings.memory_pressure_file`) holding one of the level names:
  what tests and a desktop trial drive a running server with.

Every input is treated as hostile: files are read bounded, anything
unreadable or unparsable yields "normal" with an `error`, and `read` never
raises.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

NORMAL, WARN, CRITICAL = "normal", "warn", "critical"
LEVELS = (NORMAL, WARN, CRITICAL)  # a level's index is its gauge value (tandem_memory_pressure)

PSI_PATH = "/proc/pressure/memory"
MEMINFO_PATH = "/proc/meminfo"
PSI_SOME_WARN = 10.0  # % of the last 10 s some task waited for memory
PSI_SOME_CRITICAL = 40.0
PSI_FULL_CRITICAL = 10.0  # % of the last 10 s every task waited at once
AVAILABLE_WARN = 0.10  # MemAvailable / MemTotal under this: warn
AVAILABLE_CRITICAL = 0.05
MACOS_SYSCTL = "kern.memorystatus_vm_pressure_level"
_MACOS_LEVELS = {1: NORMAL, 2: WARN, 4: CRITICAL}
_READ_LIMIT = 64 << 10  # /proc/meminfo is ~1.5 KB; a file bigger than this is not one


@dataclass(frozen=True)
class MemoryPressure:
    level: str = NORMAL
    reader: str = "none"  # "psi+meminfo", "meminfo", "macos", "file", "none"
    detail: str = ""  # the figures the level came from
    error: str = ""  # why a reading failed ("" when it did not)

    @property
    def value(self) -> int:
        """0 normal, 1 warn, 2 critical: the gauge's value."""
        return LEVELS.index(self.level)


def worse(a: str, b: str) -> str:
    return a if LEVELS.index(a) >= LEVELS.index(b) else b


def level_from_psi(text: str) -> tuple[Optional[str], str]:
    """(level, detail) from /proc/pressure/memory; (None, why) when unreadable.
    Lines: `some avg10=0.00 avg60=0.00 avg300=0.00 total=0`, then `full ...`."""
    avg10 = {}
    for line in text.splitlines()[:4]:
        kind, _, rest = line.partition(" ")
        for field in rest.split():
            key, _, number = field.partition("=")
            if key == "avg10":
                try:
                    avg10[kind] = float(number)
                except ValueError:
                    return None, f"PSI: bad avg10 {number[:20]!r}"
    some, full = avg10.get("some"), avg10.get("full", 0.0)
    if some is None or not (0.0 <= some <= 100.0 and 0.0 <= full <= 100.0):
        return None, "PSI: no 'some avg10' in 0..100"
    detail = f"psi some avg10 {some:.1f}%, full {full:.1f}%"
    if some >= PSI_SOME_CRITICAL or full >= PSI_FULL_CRITICAL:
        return CRITICAL, detail
    return (WARN if some >= PSI_SOME_WARN else NORMAL), detail


def level_from_meminfo(text: str) -> tuple[Optional[str], str]:
    """(level, detail) from /proc/meminfo's MemTotal and MemAvailable (kB)."""
    kb = {}
    for line in text.splitlines()[:64]:
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            parts = rest.split()
            if parts and parts[0].isdigit():
                kb[key] = int(parts[0])
    total, available = kb.get("MemTotal"), kb.get("MemAvailable")
    if not total or available is None or available > total:
        return None, "meminfo: no MemTotal/MemAvailable"
    share = available / total
    detail = f"available {available >> 10} of {total >> 10} MiB ({share:.0%})"
    if share < AVAILABLE_CRITICAL:
        return CRITICAL, detail
    return (WARN if share < AVAILABLE_WARN else NORMAL), detail


def level_from_macos(value: Optional[int]) -> Optional[str]:
    return _MACOS_LEVELS.get(value) if isinstance(value, int) else None


def level_from_file(text: str) -> Optional[str]:
    words = text.split()
    word = words[0].lower() if words else ""
    return word if word in LEVELS else None


def read_text(path: str, limit: int = _READ_LIMIT) -> Optional[str]:
    """A small file's text, at most `limit` bytes; None when unreadable.
    /proc files never block; a FIFO planted at the path could, hence O_NONBLOCK."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        return os.read(fd, limit).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def sysctl_int(name: str) -> Optional[int]:
    """An int sysctl by name (macOS, through libc's sysctlbyname); None on failure."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        value = ctypes.c_int(0)
        size = ctypes.c_size_t(ctypes.sizeof(value))
        if libc.sysctlbyname(name.encode(), ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)):
            return None
        return value.value
    except (OSError, AttributeError, TypeError, ValueError):
        return None


class PressureReader:
    """Reads the level. The seams (`read_text`, `sysctl`, `platform`) let
    tests feed recorded PSI, meminfo and sysctl values."""

    def __init__(self, state_file: Optional[str] = None, *,
                 read_text: Callable[[str], Optional[str]] = read_text,
                 sysctl: Callable[[str], Optional[int]] = sysctl_int, platform: str = sys.platform):
        self.state_file = state_file
        self._read_text = read_text
        self._sysctl = sysctl
        self._platform = platform

    def read(self) -> MemoryPressure:
        try:
            if self.state_file:
                return self._from_file()
            if self._platform == "darwin":
                return self._from_macos()
            if self._platform.startswith("linux"):
                return self._from_linux()
            return MemoryPressure(error=f"no memory pressure reader on {self._platform}")
        except Exception as exc:  # noqa: BLE001 - a reader must never take its caller down
            return MemoryPressure(error=f"{type(exc).__name__}: {exc}"[:200])

    def _from_file(self) -> MemoryPressure:
        text = self._read_text(self.state_file)
        level = level_from_file(text) if text is not None else None
        if level is None:
            return MemoryPressure(reader="file", error=f"{self.state_file}: not one of {', '.join(LEVELS)}")
        return MemoryPressure(level, "file", detail=self.state_file)

    def _from_macos(self) -> MemoryPressure:
        raw = self._sysctl(MACOS_SYSCTL)
        level = level_from_macos(raw)
        if level is None:
            return MemoryPressure(reader="macos", error=f"{MACOS_SYSCTL}: {raw!r}")
        return MemoryPressure(level, "macos", detail=f"{MACOS_SYSCTL}={raw}")

    def _from_linux(self) -> MemoryPressure:
        readings, errors = [], []
        for name, path, parse in (("psi", PSI_PATH, level_from_psi), ("meminfo", MEMINFO_PATH, level_from_meminfo)):
            text = self._read_text(path)
            level, detail = parse(text) if text is not None else (None, f"{path} unreadable")
            (readings if level else errors).append((name, level, detail))
        if not readings:
            return MemoryPressure(reader="none", error="; ".join(d for _, _, d in errors))
        level = NORMAL
        for _, each, _ in readings:
            level = worse(level, each)
        return MemoryPressure(level, "+".join(n for n, _, _ in readings), detail="; ".join(d for _, _, d in readings))


# A process that shrinks its caches under pressure (the cache service, a model
# worker) acts once the level has stayed above normal this long: the router's
# model pool, reading every second, unloads idle models first (a whole model's
# weights, often relief enough); only pressure that outlasts it shrinks the rest.
UNLOAD_FIRST_S = 2.0


class PressurePoll:
    """The level, read at most every `poll_s` seconds (callers ask every loop
    turn). `grace_s`: how long a level above normal must last before
    `acting` (0: at once)."""

    def __init__(self, reader: PressureReader, poll_s: float, clock: Callable[[], float], grace_s: float = 0.0):
        self.reader = reader
        self.poll_s = poll_s
        self.grace_s = grace_s
        self._clock = clock
        self._next = float("-inf")
        self._pressed_since: float | None = None
        self.last = MemoryPressure()

    def due(self) -> bool:
        return self._clock() >= self._next

    def read(self) -> MemoryPressure:
        """A fresh reading (call when `due`)."""
        now = self._clock()
        self._next = now + self.poll_s
        self.last = self.reader.read()
        if self.last.level == NORMAL:
            self._pressed_since = None
        elif self._pressed_since is None:
            self._pressed_since = now
        return self.last

    def acting(self) -> bool:
        """Whether the last reading is to be acted on: above normal for `grace_s` or more."""
        return self._pressed_since is not None and self._clock() - self._pressed_since >= self.grace_s
