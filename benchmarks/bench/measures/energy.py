"""Energy meters: the joules a machine used between two points of a run.

Every meter is machine-wide, never per process: what it reads covers every
process on the machine, and the machine's idle draw (benchmarks/bench/measures/energy_run.py
measures that draw before each system starts, so a reader can subtract it).

- RaplMeter (Linux, Intel and AMD): the kernel's RAPL counters under
  /sys/class/powercap, `intel-rapl:N/energy_uj` (microjoules, wrapping at
  `max_energy_range_uj`). Counted: each CPU package zone, and each package's
  `dram` subzone (DRAM is its own RAPL domain, not part of the package's
  count); the other subzones (core, uncore) are inside the package and not
  counted again; `psys` (the whole platform, overlapping the packages) is
  left out. Since Linux 5.10 energy_uj is readable by root only: then not
  available, with the reason.
- NvidiaSmiMeter: `nvidia-smi`. Its CLI has no energy query field on the
  drivers checked (NVML's total-energy counter is not exposed: `--query-gpu=
  total_energy_consumption` is "not a valid field"), so it is used only when
  `--help-query-gpu` lists it; otherwise board power (`power.draw.instant`
  where listed, else `power.draw`) is sampled and integrated (trapezoid),
  summed over the GPUs the run uses (CUDA_VISIBLE_DEVICES, else all).
- PowermetricsMeter (macOS, root only): `powermetrics` streams a block every
  interval with the CPU+GPU+ANE power averaged over it; energy is that power
  times the block's elapsed time. Apple calls these figures estimates.
  Unverified on a Mac: the parser is tested on recorded output only.

EnergyRecorder runs the meters together: a thread polls them (counters are
read often enough to see every wrap; sampled power needs the samples), a mark
is the cumulative joules per domain at an instant, and a window between two
marks is the energy used in between. Nothing here raises out of a reading:
a failed read is counted and skipped (the next one covers the gap), and every
subprocess has a timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SCOPE = ("machine-wide: every process on the machine and its idle draw, not only the system measured; "
         "idle.watts is the machine's draw before the system started")


def _read_int(path: Path) -> int:
    return int(path.read_text().strip())


class Meter:
    """Cumulative joules per domain since start(), read by poll()."""

    name = "meter"
    method = ""

    def __init__(self):
        self.reason = ""  # why not available ("" when it is)
        self.domains: list[str] = []
        self.joules: dict[str, float] = {}
        self.errors = 0
        self.last_error = ""

    def available(self) -> bool:
        return False

    def start(self) -> None:
        self.poll()

    def poll(self) -> None:
        """Take a reading now (counters, sampled power); a no-op for streamed meters."""

    def stop(self) -> None:
        pass

    def _failed(self, why: str) -> None:
        self.errors += 1
        self.last_error = why[:300]

    def describe(self) -> dict:
        return {"meter": self.name, "method": self.method, "domains": list(self.domains),
                "errors": self.errors, "last_error": self.last_error or None}


# ------------------------------------------------------------------ RAPL

@dataclass
class RaplZone:
    domain: str  # "package-0", "package-0/dram"
    energy_path: Path
    max_range_uj: int | None  # the counter wraps past this; None: unknown


def rapl_zones(root: Path) -> list[RaplZone]:
    """The zones counted (packages and their DRAM), from a powercap tree."""
    zones = []
    for top in sorted(root.glob("intel-rapl:*")):
        if not re.fullmatch(r"intel-rapl:\d+", top.name):
            continue
        name = _name(top)
        if not name.startswith("package"):
            continue  # psys: the platform as a whole, which contains the packages
        zones.append(_zone(top, name))
        for sub in sorted(top.glob(f"{top.name}:*")):
            if _name(sub) == "dram":
                zones.append(_zone(sub, f"{name}/dram"))
    return zones


def _name(zone: Path) -> str:
    try:
        return (zone / "name").read_text().strip()
    except OSError:
        return ""


def _zone(path: Path, domain: str) -> RaplZone:
    try:
        max_range = _read_int(path / "max_energy_range_uj")
    except (OSError, ValueError):
        max_range = None
    return RaplZone(domain, path / "energy_uj", max_range if max_range and max_range > 0 else None)


def counter_delta(before: int, after: int, max_range: int | None) -> int:
    """Microjoules between two readings of a counter that wraps to 0 past max_range."""
    if after >= before:
        return after - before
    return (max_range - before + after) if max_range and before <= max_range else 0


class RaplMeter(Meter):
    name = "rapl"
    method = "counter (powercap energy_uj)"

    def __init__(self, root: str | os.PathLike = "/sys/class/powercap"):
        super().__init__()
        self.root = Path(root)
        self.zones: list[RaplZone] = []
        self._last: dict[str, int] = {}

    def available(self) -> bool:
        if not self.root.is_dir():
            self.reason = f"no {self.root} (not Linux, or no RAPL driver)"
            return False
        self.zones = rapl_zones(self.root)
        if not self.zones:
            self.reason = f"no package zone under {self.root}"
            return False
        for z in self.zones:
            try:
                _read_int(z.energy_path)
            except PermissionError:
                self.reason = (f"{z.energy_path} is readable by root only (Linux 5.10+): run the bench as root, "
                               f"or `sudo chmod a+r {self.root}/intel-rapl:*/energy_uj`")
                return False
            except (OSError, ValueError) as e:
                self.reason = f"{z.energy_path}: {e}"
                return False
        self.domains = [z.domain for z in self.zones]
        return True

    def start(self) -> None:
        self.joules = {z.domain: 0.0 for z in self.zones}
        self._last = {}
        self.poll()

    def poll(self) -> None:
        for z in self.zones:
            try:
                value = _read_int(z.energy_path)
            except (OSError, ValueError) as e:
                self._failed(f"{z.energy_path}: {e}")  # the next read covers this interval
                continue
            if z.domain in self._last:
                self.joules[z.domain] += counter_delta(self._last[z.domain], value, z.max_range_uj) / 1e6
            self._last[z.domain] = value


# ------------------------------------------------------------------ sampled power

class SampledPower(Meter):
    """Power samples integrated over time (trapezoid between a domain's consecutive
    samples: a domain missing from a sample is bridged from its last one)."""

    method = "sampled power, trapezoid"

    def __init__(self, clock=time.monotonic):
        super().__init__()
        self.clock = clock
        self._prev: dict[str, tuple[float, float]] = {}  # domain -> (seconds, watts) of its last sample

    def add_sample(self, at: float, watts: dict[str, float]) -> None:
        for domain, w in watts.items():
            prev = self._prev.get(domain)
            if prev and at > prev[0]:
                self.joules[domain] = self.joules.get(domain, 0.0) + (prev[1] + w) / 2 * (at - prev[0])
            self._prev[domain] = (at, w)


# ------------------------------------------------------------------ NVIDIA

def parse_gpu_csv(text: str) -> dict[str, tuple[str, float | None]]:
    """`index, uuid, value` lines -> {index: (uuid, value)}; "[N/A]" and garbage give None."""
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        try:
            value = float(parts[2])
        except ValueError:
            value = None
        out[parts[0]] = (parts[1], value)
    return out


def gpus_in_use(visible: str | None, gpus: dict[str, tuple[str, float | None]]) -> list[str]:
    """The nvidia-smi indices CUDA_VISIBLE_DEVICES names (indices or UUIDs), else all.
    (CUDA numbers devices fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, nvidia-smi
    by bus: the same on a machine of identical GPUs.)"""
    if not visible or not visible.strip():
        return sorted(gpus, key=int)
    chosen = []
    for item in (v.strip() for v in visible.split(",")):
        for index, (uuid, _) in gpus.items():
            if item == index or (item.startswith("GPU-") and uuid.startswith(item)):
                chosen.append(index)
    return sorted(set(chosen), key=int) or sorted(gpus, key=int)


class NvidiaSmiMeter(SampledPower):
    name = "nvidia-smi"

    def __init__(self, binary: str | None = None, clock=time.monotonic, timeout_s: float = 5.0):
        super().__init__(clock)
        self.binary = binary or shutil.which("nvidia-smi")
        self.timeout_s = timeout_s
        self.field = "power.draw"
        self.counter = False  # True: total_energy_consumption (mJ), read as a counter
        self.gpus: list[str] = []
        self._last_mj: dict[str, float] = {}

    def _query(self, *args: str) -> str:
        return subprocess.run([self.binary, *args], capture_output=True, text=True, errors="replace",
                              timeout=self.timeout_s, check=True).stdout

    def available(self) -> bool:
        if not self.binary:
            self.reason = "nvidia-smi not found"
            return False
        try:
            fields = self._query("--help-query-gpu")
            if '"total_energy_consumption"' in fields:  # the help lists each field's name in quotes
                self.field, self.counter = "total_energy_consumption", True
            elif '"power.draw.instant"' in fields:
                self.field = "power.draw.instant"  # power.draw is a 1 s average on recent drivers
            gpus = parse_gpu_csv(self._query(f"--query-gpu=index,uuid,{self.field}", "--format=csv,noheader,nounits"))
        except (OSError, subprocess.SubprocessError) as e:
            self.reason = f"nvidia-smi failed: {e}"
            return False
        self.gpus = [g for g in gpus_in_use(os.environ.get("CUDA_VISIBLE_DEVICES"), gpus) if gpus[g][1] is not None]
        if not self.gpus:
            self.reason = f"nvidia-smi reports no {self.field} for any GPU"
            return False
        self.method = "counter (total_energy_consumption)" if self.counter else f"sampled {self.field}, trapezoid"
        self.domains = [f"gpu{g} board" for g in self.gpus]
        return True

    def start(self) -> None:
        self.joules = {d: 0.0 for d in self.domains}
        self._prev, self._last_mj = {}, {}
        self.poll()

    def poll(self) -> None:
        t0 = self.clock()
        try:
            out = self._query(f"--query-gpu=index,uuid,{self.field}", "--format=csv,noheader,nounits")
        except (OSError, subprocess.SubprocessError) as e:
            self._failed(f"nvidia-smi: {e}")
            return
        at = (t0 + self.clock()) / 2  # the reading was taken somewhere inside the call
        gpus = parse_gpu_csv(out)
        values = {f"gpu{g} board": gpus[g][1] for g in self.gpus if g in gpus and gpus[g][1] is not None}
        if len(values) < len(self.gpus):
            self._failed(f"nvidia-smi: no {self.field} for some GPU in {out[:200]!r}")
        if self.counter:
            for domain, mj in values.items():
                if domain in self._last_mj and mj >= self._last_mj[domain]:
                    self.joules[domain] += (mj - self._last_mj[domain]) / 1000
                self._last_mj[domain] = mj
        else:
            self.add_sample(at, values)


# ------------------------------------------------------------------ macOS

_BLOCK = re.compile(r"\*\*\* Sampled system activity .*\(([\d.]+)\s*ms elapsed\)")
_COMBINED = re.compile(r"^Combined Power \(CPU \+ GPU \+ ANE\):\s*([\d.]+)\s*(mW|W)\b")
_INTEL = re.compile(r"package power \(CPUs\+GT\+SA\):\s*([\d.]+)\s*(mW|W)\b")


class PowermetricsParser:
    """Lines of `powermetrics` text output -> (elapsed seconds, watts) per block."""

    def __init__(self):
        self._elapsed: float | None = None

    def feed(self, line: str) -> tuple[float, float] | None:
        m = _BLOCK.search(line)
        if m:
            self._elapsed = float(m.group(1)) / 1000
            return None
        m = _COMBINED.search(line.strip()) or _INTEL.search(line)
        if m and self._elapsed is not None:
            watts = float(m.group(1)) / (1000 if m.group(2) == "mW" else 1)
            block, self._elapsed = (self._elapsed, watts), None  # one figure per block
            return block
        return None


def parse_powermetrics(text: str) -> list[tuple[float, float]]:
    parser = PowermetricsParser()
    return [b for b in map(parser.feed, text.splitlines()) if b]


class PowermetricsMeter(Meter):
    name = "powermetrics"
    method = "powermetrics average power x each block's elapsed time (Apple's estimate)"

    def __init__(self, interval_ms: int = 200, binary: str | None = None):
        super().__init__()
        self.interval_ms = interval_ms
        self.binary = binary or shutil.which("powermetrics")
        self.domains = ["CPU+GPU+ANE"]
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def available(self) -> bool:
        if sys.platform != "darwin":
            self.reason = "powermetrics is macOS only"
        elif os.geteuid() != 0:
            self.reason = "powermetrics needs root: run the bench with sudo"
        elif not self.binary:
            self.reason = "powermetrics not found"
        return not self.reason

    def start(self) -> None:
        self.joules = {"CPU+GPU+ANE": 0.0}
        try:
            self._proc = subprocess.Popen(
                [self.binary, "-i", str(self.interval_ms), "-b", "1", "--samplers", "cpu_power,gpu_power"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, errors="replace")
        except OSError as e:
            self._failed(f"powermetrics: {e}")
            return
        self._reader = threading.Thread(target=self._read, args=(self._proc.stdout,), name="powermetrics",
                                        daemon=True)
        self._reader.start()

    def _read(self, stream) -> None:
        parser = PowermetricsParser()
        for line in stream:
            block = parser.feed(line)
            if block:  # one writer; marks read the running sum as it stands
                self.joules["CPU+GPU+ANE"] += block[0] * block[1]

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)


# ------------------------------------------------------------------ recorder

@dataclass(frozen=True)
class Mark:
    at: float  # time.monotonic()
    joules: dict[str, float]  # "meter:domain" -> cumulative joules


def default_meters() -> list[Meter]:
    return [RaplMeter(), NvidiaSmiMeter(), PowermetricsMeter()]


class EnergyRecorder:
    """The available meters, polled in a thread; marks and the windows between them."""

    def __init__(self, meters: list[Meter], interval_s: float = 0.2, clock=time.monotonic):
        self.meters = meters
        self.interval_s = interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="energy-poll", daemon=True)

    @classmethod
    def open(cls, meters: list[Meter] | None = None, **kw) -> tuple[EnergyRecorder | None, dict[str, str]]:
        """(a recorder of the meters that are available, or None; {meter: why not} for the others)."""
        ready, missing = [], {}
        for m in default_meters() if meters is None else meters:
            if m.available():
                ready.append(m)
            else:
                missing[m.name] = m.reason
        return (cls(ready, **kw) if ready else None), missing

    def start(self) -> EnergyRecorder:
        for m in self.meters:
            m.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        for m in self.meters:
            m.stop()

    def __enter__(self) -> EnergyRecorder:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._poll()

    def _poll(self) -> None:
        with self._lock:
            for m in self.meters:
                m.poll()

    def mark(self) -> Mark:
        """Read every meter now."""
        with self._lock:
            for m in self.meters:
                m.poll()
            return Mark(self.clock(), {f"{m.name}:{d}": j for m in self.meters for d, j in m.joules.items()})

    def window(self, a: Mark, b: Mark) -> dict:
        """{"joules", "seconds", "watts", "by_domain"} between two marks."""
        by_domain = {d: round(b.joules[d] - a.joules.get(d, 0.0), 6) for d in b.joules}
        joules = sum(by_domain.values())
        seconds = b.at - a.at
        return {"joules": joules, "seconds": seconds, "watts": joules / seconds if seconds > 0 else None,
                "by_domain": by_domain}

    @contextmanager
    def measure(self):
        """with recorder.measure() as w: ...  -> w holds the window's figures afterwards."""
        out: dict = {}
        start = self.mark()
        try:
            yield out
        finally:
            out.update(self.window(start, self.mark()))

    def describe(self) -> list[dict]:
        return [m.describe() for m in self.meters]

    @property
    def domains(self) -> list[str]:
        return [f"{m.name}:{d}" for m in self.meters for d in m.domains]
