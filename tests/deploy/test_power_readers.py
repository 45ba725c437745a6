"""The power readers (environment/power/): pmset's outputs through their parsers,
IOKit's and NSProcessInfo's values through their mappings, fake sysfs trees,
the state file's hostile inputs, and the subprocess seam with commands that
hang or are missing.

The macOS readers are tested here through doubles: the ctypes calls
(`iokit_power_sources`, `process_info`) and `pmset` exist only on a Mac, so
`read_macos` is handed fakes returning the values those calls return, and
pmset's outputs are recorded files (tests/deploy/fixtures/power/README.md
says where they come from). What reaches the platform is checked on a Mac by
benchmarks/probes/mac_power.py."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from environment.power import linux, macos, readers
from environment.power.readers import has_power_reading, read_power, read_state_file
from environment.power.state import PowerState
from environment.settings import Settings

FIXTURES = Path(__file__).parent / "fixtures" / "power"
not_mac = pytest.mark.skipif(sys.platform == "darwin", reason="checks what the macOS calls do elsewhere")


def fixture(name: str) -> str:
    return (FIXTURES / f"{name}.txt").read_text()


# ------------------------------------------------------------------ pmset


@pytest.mark.parametrize("name, source, percent", [
    ("pmset_batt_ac_charging", "ac", 85),
    ("pmset_batt_ac_not_charging", "ac", 80),
    ("pmset_batt_battery", "battery", 62),
    ("pmset_batt_low", "battery", 7),
    ("pmset_batt_no_estimate", "battery", 48),
    ("pmset_batt_desktop", "ac", None),
    ("pmset_batt_desktop_ups", "battery", 64),
])
def test_pmset_batt(name, source, percent):
    fields, error = macos.parse_pmset_batt(fixture(name))
    assert (fields["source"], fields.get("percent"), error) == (source, percent, "")


def test_pmset_batt_prefers_the_internal_battery_to_a_ups():
    text = ("Now drawing from 'AC Power'\n -Back-UPS ES 700 (id=1)\t100%; charging present: true\n"
            " -InternalBattery-0 (id=2)\t41%; charging; 1:10 remaining present: true\n")
    assert macos.parse_pmset_batt(text) == ({"source": "ac", "percent": 41}, "")


@pytest.mark.parametrize("text, expected", [
    ("", ({}, "pmset -g batt: no 'Now drawing from' line")),
    ("\x00\xff garbage", ({}, "pmset -g batt: no 'Now drawing from' line")),
    ("No power source info available\n", ({"source": "ac"}, "")),
    ("Now drawing from 'Solar Power'\n", ({"source": "unknown"}, "pmset -g batt: unknown power source 'Solar Power'")),
])
def test_pmset_batt_odd_outputs(text, expected):
    assert macos.parse_pmset_batt(text) == expected


@pytest.mark.parametrize("name, low_power", [
    ("pmset_g_low_power_off", False),
    ("pmset_g_low_power_on", True),
    ("pmset_g_powermode_low", True),
    ("pmset_g_powermode_high", False),  # High Power Mode is not low
    ("pmset_g_no_low_power_mode", False),  # before macOS 12: no such setting
])
def test_pmset_low_power_mode(name, low_power):
    assert macos.parse_pmset_low_power(fixture(name)) == ({"low_power": low_power}, "")


def test_pmset_low_power_mode_empty_output_is_an_error():
    assert macos.parse_pmset_low_power(" \n") == ({}, "pmset -g: empty output")


@pytest.mark.parametrize("name, thermal", [
    ("pmset_therm_nominal", "nominal"),
    ("pmset_therm_cpu_full_speed", "nominal"),
    ("pmset_therm_warning", "serious"),  # warning level 100 (IOPM's "danger" alias), speed limit 72
    ("pmset_therm_critical", "critical"),  # warning level 10
    ("pmset_therm_speed_limited", "serious"),  # a 35% speed limit alone never makes it critical
])
def test_pmset_therm(name, thermal):
    assert macos.parse_pmset_therm(fixture(name)) == ({"thermal": thermal}, "")


@pytest.mark.parametrize("level, thermal", [(0, "nominal"), (5, "fair"), (100, "serious"), (10, "critical"),
                                             (110, "critical"), (255, "nominal"), (42, "fair")])
def test_pmset_thermal_warning_levels(level, thermal):
    assert macos.parse_pmset_therm(f"Thermal Warning Level = {level}\n") == ({"thermal": thermal}, "")


# ------------------------------------------------- IOKit and NSProcessInfo values

LAPTOP_BATTERY = {"Type": "InternalBattery", "Power Source State": "Battery Power", "Current Capacity": 15,
                  "Max Capacity": 100, "Is Present": True, "Name": "InternalBattery-0"}


@pytest.mark.parametrize("providing, sources, expected", [
    ("Battery Power", [LAPTOP_BATTERY], ({"source": "battery", "percent": 15}, "")),
    ("AC Power", [{**LAPTOP_BATTERY, "Power Source State": "AC Power", "Current Capacity": 100}],
     ({"source": "ac", "percent": 100}, "")),
    # capacities in mAh on older Macs: pmset's arithmetic
    ("Battery Power", [{**LAPTOP_BATTERY, "Current Capacity": 2100, "Max Capacity": 4200}],
     ({"source": "battery", "percent": 50}, "")),
    (None, [], ({"source": "ac"}, "")),  # a desktop Mac: no power source at all
    ("AC Power", [], ({"source": "ac"}, "")),
    ("UPS Power", [{"Type": "UPS", "Current Capacity": 30, "Max Capacity": 100}], ({"source": "battery", "percent": 30}, "")),
    ("Battery Power", [{**LAPTOP_BATTERY, "Is Present": False}], ({"source": "battery"}, "")),
    # hostile values: wrong types, a zero or negative capacity
    ("Battery Power", [{**LAPTOP_BATTERY, "Current Capacity": "15"}], ({"source": "battery"}, "")),
    ("Battery Power", [{**LAPTOP_BATTERY, "Max Capacity": 0}], ({"source": "battery"}, "")),
    ("Battery Power", [{**LAPTOP_BATTERY, "Current Capacity": -3}], ({"source": "battery"}, "")),
    ("Off Line", [LAPTOP_BATTERY], ({"source": "unknown", "percent": 15}, "IOKit: unknown power source 'Off Line'")),
])
def test_iokit_values(providing, sources, expected):
    assert macos.power_from_iokit(providing, sources) == expected


@pytest.mark.parametrize("state, expected", [
    (0, ({"thermal": "nominal"}, "")), (1, ({"thermal": "fair"}, "")), (2, ({"thermal": "serious"}, "")),
    (3, ({"thermal": "critical"}, "")), (4, ({}, "NSProcessInfo: unknown thermalState 4")),
    (-1, ({}, "NSProcessInfo: unknown thermalState -1")),
])
def test_process_info_thermal_states(state, expected):
    assert macos.thermal_from_process_info(state) == expected


# ----------------------------------------------------------- read_macos


def _fails():
    raise macos.NotOnMac("macOS only")


class RecordedPmset:
    """A double for `run_command`: recorded outputs per pmset argument list."""

    def __init__(self, outputs: dict[str, tuple[str, str]]):
        self.outputs, self.calls = outputs, []

    def __call__(self, argv, timeout_s):
        assert argv[0] == macos.PMSET and 0 < timeout_s <= macos.COMMAND_TIMEOUT_S
        self.calls.append(" ".join(argv[1:]))
        return self.outputs[" ".join(argv[1:])]


def test_read_macos_takes_the_native_calls_first():
    pmset = RecordedPmset({})
    state = macos.read_macos(run=pmset, iokit=lambda: ("Battery Power", [LAPTOP_BATTERY]), process=lambda: (True, 2))
    assert state == PowerState("battery", 15, True, "serious", reader="iokit+nsprocessinfo")
    assert pmset.calls == []


def test_read_macos_falls_back_to_pmset_part_by_part():
    pmset = RecordedPmset({"-g batt": (fixture("pmset_batt_low"), ""), "-g": (fixture("pmset_g_low_power_on"), ""),
                           "-g therm": (fixture("pmset_therm_critical"), "")})
    # No IOKit; a macOS before 12: thermalState but no isLowPowerModeEnabled.
    state = macos.read_macos(run=pmset, iokit=_fails, process=lambda: (None, 1))
    assert state == PowerState("battery", 7, True, "fair", reader="pmset+nsprocessinfo")
    assert pmset.calls == ["-g batt", "-g"]
    state = macos.read_macos(run=pmset, iokit=_fails, process=_fails)
    assert state == PowerState("battery", 7, True, "critical", reader="pmset")
    # an NSProcessInfo value out of range: pmset answers instead
    state = macos.read_macos(run=pmset, iokit=_fails, process=lambda: (False, 9))
    assert (state.thermal, state.error) == ("critical", "")


def test_read_macos_reports_what_failed_and_keeps_what_it_read():
    pmset = RecordedPmset({"-g batt": ("", "pmset: no answer within 2 s"), "-g": ("garbage\n", ""),
                           "-g therm": ("", "pmset: exit status 1")})
    state = macos.read_macos(run=pmset, iokit=_fails, process=_fails)
    assert state == PowerState("unknown", None, False, "nominal", reader="pmset",
                               error="pmset -g batt: no answer within 2 s; pmset -g therm: exit status 1")


def test_read_macos_stops_asking_once_its_time_is_spent():
    pmset = RecordedPmset({})
    state = macos.read_macos(run=pmset, iokit=_fails, process=_fails, budget_s=0)
    assert pmset.calls == [] and state.reader == "none"
    assert state.error.count("no time left in this reading") == 3


@pytest.mark.timeout(20)
def test_read_macos_with_a_pmset_that_hangs():
    """A real hung process in pmset's place: the first call is killed at the
    reading's deadline and the others are not started."""
    calls = []

    def hanging_pmset(argv, timeout_s):
        calls.append(timeout_s)
        return macos.run_command([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s)

    state = macos.read_macos(run=hanging_pmset, iokit=_fails, process=_fails, budget_s=0.5)
    assert len(calls) == 1 and calls[0] <= 0.5
    assert state.reader == "none" and state.error.startswith("pmset -g batt: no answer within")
    assert state.error.endswith("pmset -g: no time left in this reading; pmset -g therm: no time left in this reading")


@not_mac
def test_the_native_calls_say_macos_only_elsewhere():
    for call in (macos.iokit_power_sources, macos.process_info):
        with pytest.raises(macos.NotOnMac, match="macOS only"):
            call()
    state = macos.read_macos()  # the real seams: no IOKit, no Foundation, no /usr/bin/pmset
    assert state.source == "unknown" and state.reader == "none"
    assert state.error.startswith("pmset -g batt: No such file or directory; pmset -g: No such file")


# ----------------------------------------------------------- run_command


def test_run_command_returns_the_output():
    assert macos.run_command([sys.executable, "-c", "print('Now drawing from')"]) == ("Now drawing from\n", "")


def test_run_command_missing_program():
    out, error = macos.run_command(["/nonexistent/pmset", "-g"])
    assert out == "" and error.startswith("pmset: ") and "No such file" in error


def test_run_command_failing_program_keeps_its_output():
    name = os.path.basename(sys.executable)
    assert macos.run_command([sys.executable, "-c", "print('x'); raise SystemExit(3)"]) == ("x\n", f"{name}: exit status 3")


def _running(pid: int) -> bool:
    """Whether pid runs (a zombie waiting for its new parent does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return sys.platform == "darwin"


@pytest.mark.timeout(20)
def test_run_command_kills_a_hung_command_and_its_children(tmp_path):
    """The shell's child keeps the output pipe open: without the group kill
    the read would wait for the child's 60 s (and the timeout mark fails it)."""
    pid_file = tmp_path / "child.pid"
    out, error = macos.run_command(["/bin/sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], timeout_s=0.5)
    assert out == "" and error == "sh: no answer within 0.5 s"
    child = int(pid_file.read_text())
    for _ in range(100):
        if not _running(child):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the hung command's child {child} is still running")


# ----------------------------------------------------------- Linux sysfs


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """A fake sysfs: {path under root: content}; a content of None makes a
    folder where a file is expected (a read that fails)."""
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            path.mkdir()
        else:
            path.write_text(content + "\n")
    return root


PS = "sys/class/power_supply"
TZ = "sys/class/thermal"


def laptop(online: str, status: str, capacity: str) -> dict[str, str]:
    return {f"{PS}/AC/type": "Mains", f"{PS}/AC/online": online,
            f"{PS}/BAT0/type": "Battery", f"{PS}/BAT0/scope": "System", f"{PS}/BAT0/present": "1",
            f"{PS}/BAT0/status": status, f"{PS}/BAT0/capacity": capacity, f"{PS}/BAT0/energy_full": "57000000"}


def zone(n: int, temp: str, *trips: tuple[str, int]) -> dict[str, str]:
    files = {f"{TZ}/thermal_zone{n}/type": "acpitz", f"{TZ}/thermal_zone{n}/temp": temp}
    for i, (kind, at) in enumerate(trips):
        files[f"{TZ}/thermal_zone{n}/trip_point_{i}_type"] = kind
        files[f"{TZ}/thermal_zone{n}/trip_point_{i}_temp"] = str(at)
    return files


ACPI_TRIPS = (("critical", 105000), ("hot", 100000), ("passive", 90000), ("active", 60000))


def test_linux_laptop_on_ac(tmp_path):
    root = write_tree(tmp_path, {**laptop("1", "Charging", "64"), **zone(0, "45000", *ACPI_TRIPS)})
    assert linux.read_linux(str(root)) == PowerState("ac", 64, False, "nominal", reader="sysfs")
    assert linux.has_readings(str(root))


def test_linux_laptop_on_battery_at_15_percent(tmp_path):
    root = write_tree(tmp_path, laptop("0", "Discharging", "15"))
    assert linux.read_linux(str(root)) == PowerState("battery", 15, False, "nominal", reader="sysfs")


@pytest.mark.parametrize("online, status, source", [
    (None, "Discharging", "battery"), (None, "Full", "ac"), (None, "Not charging", "ac"),
    ("0", "Unknown", "battery"),  # the adapter says it is off
    (None, "Unknown", "unknown"),
])
def test_linux_source_from_the_battery_status(tmp_path, online, status, source):
    files = laptop(online or "0", status, "50")
    if online is None:
        del files[f"{PS}/AC/type"], files[f"{PS}/AC/online"]
    assert linux.read_linux(str(write_tree(tmp_path, files))).source == source


def test_linux_a_usb_mouse_battery_is_not_the_machine(tmp_path):
    mouse = {f"{PS}/hidpp_battery_0/type": "Battery", f"{PS}/hidpp_battery_0/scope": "Device",
             f"{PS}/hidpp_battery_0/status": "Discharging", f"{PS}/hidpp_battery_0/capacity": "5"}
    root = write_tree(tmp_path, mouse)
    assert linux.read_linux(str(root)) == PowerState("ac", None, False, "nominal", reader="sysfs")
    assert not linux.has_readings(str(root))
    write_tree(tmp_path, laptop("1", "Full", "100"))
    assert linux.read_linux(str(root)) == PowerState("ac", 100, False, "nominal", reader="sysfs")


def test_linux_two_batteries_weighted_by_their_size(tmp_path):
    files = {**laptop("0", "Discharging", "10"), f"{PS}/BAT1/type": "Battery", f"{PS}/BAT1/status": "Discharging",
             f"{PS}/BAT1/capacity": "90", f"{PS}/BAT1/energy_full": "19000000"}  # a third of BAT0's size
    assert linux.read_linux(str(write_tree(tmp_path, files))).percent == 30


@pytest.mark.parametrize("capacity", ["garbage", "140", "-1", ""])
def test_linux_a_capacity_that_is_not_a_percent(tmp_path, capacity):
    state = linux.read_linux(str(write_tree(tmp_path, laptop("0", "Discharging", capacity))))
    assert state.source == "battery" and state.percent is None
    assert state.error == f"BAT0: capacity {capacity!r} is not a percent"


def test_linux_empty_tree_is_a_server(tmp_path):
    assert linux.read_linux(str(tmp_path)) == PowerState("ac", None, False, "nominal", reader="sysfs")
    assert not linux.has_readings(str(tmp_path))
    # a desktop whose AC entry reads offline still runs on AC: it has no battery
    write_tree(tmp_path, {f"{PS}/ACAD/type": "Mains", f"{PS}/ACAD/online": "0"})
    assert linux.read_linux(str(tmp_path)).source == "ac" and linux.has_readings(str(tmp_path))


@pytest.mark.parametrize("temp, thermal", [
    ("59000", "nominal"), ("60000", "fair"), ("90500", "serious"), ("100000", "critical"),  # hot
    ("-5000", "nominal"),
])
def test_linux_thermal_zone_against_its_trips(tmp_path, temp, thermal):
    assert linux.read_linux(str(write_tree(tmp_path, zone(0, temp, *ACPI_TRIPS)))).thermal == thermal


def test_linux_critical_zone(tmp_path):
    """Without a hot trip: within 5 C of the power-off trip is critical, and
    the worst zone is the machine's state."""
    files = {**zone(0, "40000", *ACPI_TRIPS), **zone(1, "96000", ("critical", 100000), ("passive", 95000))}
    assert linux.read_linux(str(write_tree(tmp_path, files))).thermal == "critical"
    assert linux.zone_thermal(str(tmp_path / TZ / "thermal_zone1")) == "critical"
    (tmp_path / TZ / "thermal_zone1/temp").write_text("94000\n")
    assert linux.read_linux(str(tmp_path)).thermal == "nominal"


def test_linux_unreadable_zones_are_skipped(tmp_path):
    files = {**zone(0, "garbage", *ACPI_TRIPS), **zone(1, "91000", *ACPI_TRIPS), **zone(3, "99000", *ACPI_TRIPS),
             f"{TZ}/thermal_zone2/type": "iwlwifi_1"}  # no temp at all
    write_tree(tmp_path, files)
    (tmp_path / TZ / "thermal_zone3/temp").unlink()
    (tmp_path / TZ / "thermal_zone3/temp").mkdir()  # a read that fails
    state = linux.read_linux(str(tmp_path))
    assert (state.thermal, state.error) == ("serious", "")


def test_linux_unset_trips_are_ignored(tmp_path):
    """x86_pkg_temp lists passive trips at 0: not set, not reached."""
    files = zone(0, "50000", ("passive", 0), ("passive", -273200), ("critical", "garbage"))
    assert linux.read_linux(str(write_tree(tmp_path, files))).thermal == "nominal"


@pytest.mark.parametrize("profile, low_power", [("low-power", True), ("quiet", True), ("balanced", False),
                                                 ("performance", False)])
def test_linux_platform_profile(tmp_path, profile, low_power):
    root = write_tree(tmp_path, {"sys/firmware/acpi/platform_profile": profile})
    assert linux.read_linux(str(root)).low_power is low_power


# ----------------------------------------------------------- the state file


def state_file(tmp_path: Path, content) -> str:
    path = tmp_path / "power.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_state_file_is_read_afresh_at_every_call(tmp_path):
    path = state_file(tmp_path, {"source": "battery", "percent": 15, "low_power": True, "thermal": "serious"})
    assert read_state_file(path) == PowerState("battery", 15, True, "serious", reader="file")
    state_file(tmp_path, {"source": "ac"})
    assert read_state_file(path) == PowerState("ac", reader="file")
    state_file(tmp_path, PowerState("battery", 50, reader="iokit", error="simulated").as_dict())  # a dump reads back
    assert read_state_file(path) == PowerState("battery", 50, reader="file", error="simulated")


@pytest.mark.parametrize("content, expected", [
    ("{not json", PowerState(reader="file", error="not JSON")),
    ("", PowerState(reader="file", error="not JSON")),
    ("[1, 2]", PowerState(reader="file", error="not a JSON object")),
    ("\"battery\"", PowerState(reader="file", error="not a JSON object")),
    ({"source": "mains"}, PowerState("unknown", reader="file", error="source 'mains' is not one of ac, battery, unknown")),
    ({"source": 1}, PowerState("unknown", reader="file", error="source '1' is not one of")),
    ({"source": "battery", "percent": 140}, PowerState("battery", reader="file",
                                                       error="percent '140' is not a number from 0 to 100")),
    ({"percent": -1}, PowerState(reader="file", error="percent '-1'")),
    ({"percent": "15"}, PowerState(reader="file", error="percent '15'")),
    ({"percent": True}, PowerState(reader="file", error="percent 'True'")),
    ({"percent": 14.6}, PowerState(percent=15, reader="file")),
    ({"low_power": "yes"}, PowerState(reader="file", error="low_power 'yes' is not true or false")),
    ({"low_power": 1}, PowerState(reader="file", error="low_power '1'")),
    ({"thermal": "hot"}, PowerState(reader="file", error="thermal 'hot' is not one of nominal, fair, serious, critical")),
    ({"thermal": ["critical"]}, PowerState(reader="file", error="thermal \"['critical']\"")),
    ({"sourse": "battery", "percent": 20}, PowerState(percent=20, reader="file", error="unknown field 'sourse'")),
    ({"error": 5}, PowerState(reader="file", error="error is not a string")),
])
def test_state_file_hostile_contents(tmp_path, content, expected):
    """`expected.error`: a part of the error said; the other fields exactly."""
    state = read_state_file(state_file(tmp_path, content))
    assert expected.error in state.error and bool(state.error) == bool(expected.error), state.error
    assert replace(state, error="") == replace(expected, error="")


def test_state_file_missing_huge_or_not_a_file(tmp_path):
    missing = read_state_file(str(tmp_path / "nope.json"))
    assert missing.source == "unknown" and missing.reader == "file" and "No such file" in missing.error
    huge = read_state_file(state_file(tmp_path, json.dumps({"source": "ac", "pad": "x" * 10000})))
    assert huge == PowerState(reader="file", error=f"{tmp_path / 'power.json'}: over 4096 bytes")
    deep = read_state_file(state_file(tmp_path, "[" * 2000 + "]" * 2000))  # within the size, too deep for json
    assert deep.source == "unknown" and deep.error
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it would block until a writer came
    assert read_state_file(str(fifo)) == PowerState(reader="file", error=f"{fifo}: not a regular file")
    assert read_state_file(str(tmp_path)).error == f"{tmp_path}: not a regular file"


# ----------------------------------------------------------- read_power


def test_read_power_uses_the_state_file_when_set(tmp_path):
    settings = Settings(power_state_file=state_file(tmp_path, {"source": "battery", "percent": 9}))
    assert read_power(settings) == PowerState("battery", 9, reader="file")
    assert has_power_reading(settings)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux reader")
def test_read_power_reads_this_machine():
    state = read_power(Settings())
    assert state.reader == "sysfs" and state.source in ("ac", "battery", "unknown")
    assert has_power_reading(Settings()) == linux.has_readings()


def test_read_power_never_raises(monkeypatch):
    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(readers, "read_machine", broken)
    assert read_power(Settings()) == PowerState(reader="none", error="power reader failed: RuntimeError: boom")
