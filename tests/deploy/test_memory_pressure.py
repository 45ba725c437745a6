"""The memory pressure reader (environment/memory_pressure.py) on recorded PSI,
/proc/meminfo and macOS sysctl values, and on hostile ones.

The files and the sysctl are fed through the reader's seams (`read_text`,
`sysctl`, `platform`): doubles for what the kernel would report, so the
thresholds are checked without pressing this machine for memory, and the
macOS path runs on Linux up to the ctypes call."""

from __future__ import annotations

import os

import pytest

from environment.memory_pressure import (CRITICAL, MACOS_SYSCTL, MEMINFO_PATH, NORMAL, PSI_PATH, UNLOAD_FIRST_S, WARN,
                                         MemoryPressure, PressurePoll, PressureReader, level_from_meminfo, level_from_psi,
                                         read_text, sysctl_int)

PSI_QUIET = "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
PSI_RECLAIMING = "some avg10=23.51 avg60=8.02 avg300=1.90 total=81234567\nfull avg10=2.10 avg60=0.50 avg300=0.10 total=1234\n"
PSI_THRASHING = "some avg10=71.00 avg60=40.00 avg300=9.00 total=9\nfull avg10=35.00 avg60=20.00 avg300=3.00 total=9\n"
PSI_OLD_KERNEL_NO_FULL = "some avg10=12.00 avg60=0.00 avg300=0.00 total=0\n"


def meminfo(total_kb: int, available_kb: int) -> str:
    # The first lines of a real /proc/meminfo, in its order.
    return (f"MemTotal:       {total_kb} kB\nMemFree:          123456 kB\nMemAvailable:   {available_kb} kB\n"
            "Buffers:           80000 kB\nCached:          3000000 kB\nSwapCached:            0 kB\n")


ROOMY = meminfo(24_683_520, 23_000_000)  # this CPU box, idle


def linux(files: dict) -> PressureReader:
    return PressureReader(read_text=files.get, platform="linux")


@pytest.mark.parametrize("psi, level", [(PSI_QUIET, NORMAL), (PSI_RECLAIMING, WARN), (PSI_THRASHING, CRITICAL),
                                        (PSI_OLD_KERNEL_NO_FULL, WARN)])
def test_psi_levels(psi, level):
    reading = linux({PSI_PATH: psi, MEMINFO_PATH: ROOMY}).read()
    assert reading.level == level and reading.reader == "psi+meminfo" and not reading.error


@pytest.mark.parametrize("available_share, level", [(0.5, NORMAL), (0.08, WARN), (0.03, CRITICAL)])
def test_meminfo_alone_where_psi_is_missing(available_share, level):
    """Containers and kernels before 4.20 have no /proc/pressure: MemAvailable alone."""
    total = 16 * 1024 * 1024
    reading = linux({MEMINFO_PATH: meminfo(total, int(total * available_share))}).read()
    assert reading.level == level and reading.reader == "meminfo"


def test_the_worse_signal_wins():
    total = 16 * 1024 * 1024
    assert linux({PSI_PATH: PSI_QUIET, MEMINFO_PATH: meminfo(total, total // 30)}).read().level == CRITICAL
    assert linux({PSI_PATH: PSI_THRASHING, MEMINFO_PATH: ROOMY}).read().level == CRITICAL


@pytest.mark.parametrize("psi", ["", "garbage", "some avg10=abc avg60=0", "some avg10=250.0 total=1",
                                 "some avg10=-3 total=1", "\0\0\0", "some total=5", "full avg10=90"])
def test_hostile_psi_is_ignored_not_trusted(psi):
    assert level_from_psi(psi)[0] is None
    reading = linux({PSI_PATH: psi, MEMINFO_PATH: ROOMY}).read()
    assert reading.level == NORMAL and reading.reader == "meminfo"


@pytest.mark.parametrize("text", ["", "MemTotal: lots\n", "MemTotal: 100 kB\nMemAvailable: 500 kB\n",
                                  "MemAvailable: 5 kB\n", "MemTotal: 0 kB\nMemAvailable: 0 kB\n", "x" * 10000])
def test_hostile_meminfo(text):
    assert level_from_meminfo(text)[0] is None


def test_nothing_readable_is_normal_with_an_error():
    reading = linux({}).read()
    assert reading.level == NORMAL and reading.reader == "none" and "unreadable" in reading.error


def test_a_reader_that_raises_never_raises_out():
    def boom(path):
        raise RuntimeError("disk on fire")
    reading = PressureReader(read_text=boom, platform="linux").read()
    assert reading.level == NORMAL and "disk on fire" in reading.error


@pytest.mark.parametrize("raw, level", [(1, NORMAL), (2, WARN), (4, CRITICAL)])
def test_macos_sysctl_levels(raw, level):
    asked = []
    reader = PressureReader(sysctl=lambda name: asked.append(name) or raw, platform="darwin")
    assert reader.read().level == level and asked == [MACOS_SYSCTL]


@pytest.mark.parametrize("raw", [None, 0, 3, 99, -1, "2"])
def test_macos_unknown_values(raw):
    reading = PressureReader(sysctl=lambda name: raw, platform="darwin").read()
    assert reading.level == NORMAL and reading.error


def test_sysctl_int_off_macos_is_none():
    """On Linux libc has sysctlbyname neither; the call fails into None, never raises."""
    if os.uname().sysname != "Darwin":
        assert sysctl_int(MACOS_SYSCTL) is None


def test_other_platforms_say_so():
    assert "no memory pressure reader" in PressureReader(platform="win32").read().error


def test_a_state_file_drives_the_level(tmp_path):
    path = tmp_path / "pressure"
    reader = PressureReader(str(path))
    assert reader.read().error  # missing: normal, said why
    for text, level in (("warn\n", WARN), ("CRITICAL", CRITICAL), ("normal", NORMAL), ("swapping", NORMAL)):
        path.write_text(text)
        assert reader.read().level == level
    path.write_bytes(b"\xff\xfe" * 100000)  # garbage, larger than the read limit
    assert reader.read().level == NORMAL


def test_read_text_is_bounded_and_does_not_block_on_a_fifo(tmp_path):
    big = tmp_path / "big"
    big.write_bytes(b"a" * (1 << 20))
    assert len(read_text(str(big), limit=100)) == 100
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert read_text(str(fifo)) in ("", None)  # no writer: returns at once
    assert read_text(str(tmp_path / "absent")) is None


def test_this_machine_reads_without_error():
    assert PressureReader().read().level in (NORMAL, WARN, CRITICAL)


def test_poll_reads_only_when_due():
    now = [0.0]
    calls = []

    class Reader:
        def read(self):
            calls.append(now[0])
            return PressureReader(read_text={}.get, platform="linux").read()

    poll = PressurePoll(Reader(), 2.0, lambda: now[0])
    assert poll.due()
    poll.read()
    now[0] = 1.9
    assert not poll.due()
    now[0] = 2.0
    assert poll.due()


def test_pressure_is_acted_on_once_it_outlasts_the_grace():
    """The cache service and the workers shrink only pressure that has lasted
    UNLOAD_FIRST_S, so the router's pool (a reading every second) unloads idle
    models before anything else shrinks; normal again resets the wait."""
    now, level = [0.0], ["critical"]

    class Reader:
        def read(self):
            return MemoryPressure(level[0], "file")

    poll = PressurePoll(Reader(), 2.0, lambda: now[0], grace_s=UNLOAD_FIRST_S)
    poll.read()
    assert poll.last.level == "critical" and not poll.acting()  # first seen: the router's turn
    now[0] = 2.0
    poll.read()
    assert poll.acting()
    level[0], now[0] = "normal", 4.0
    poll.read()
    assert not poll.acting()
    level[0], now[0] = "warn", 6.0
    poll.read()
    assert not poll.acting()  # a new episode waits again
    at_once = PressurePoll(Reader(), 2.0, lambda: now[0])  # grace 0: acted on at the first reading
    at_once.read()
    assert at_once.acting()
