"""The power state on macOS: IOKit and NSProcessInfo through ctypes, `pmset`
when those fail.

Each platform call is one small function (`iokit_power_sources`,
`process_info`, `run_command`) returning plain Python values; everything
else here parses and maps those values, so it is tested on any machine with
recorded outputs (tests/deploy/fixtures/power/). Off a Mac the ctypes calls
raise `NotOnMac` and `read_macos` answers with `error` set.

Mappings:
- Source: IOKit's / pmset's providing power source "AC Power" -> "ac",
  "Battery Power" -> "battery", "UPS Power" -> "battery" (the Mac runs on
  stored energy); a Mac with no power source at all (a desktop) -> "ac".
- Percent: the internal battery's Current Capacity * 100 / Max Capacity
  (pmset's own arithmetic), else a UPS's.
- Low Power Mode: NSProcessInfo.isLowPowerModeEnabled (macOS 12+), else
  `pmset -g`: `lowpowermode 1`, or `powermode 1` on Macs with High Power Mode
  (`powermode` 0 automatic, 1 low, 2 high).
- Thermal: NSProcessInfo.thermalState 0-3 -> nominal, fair, serious,
  critical. Else `pmset -g therm`, the worst of: the thermal warning level
  (IOPM.h: 0 normal -> nominal; 5 danger -> fair; 100 warning, which IOPM.h
  also names kIOPMThermalWarningLevelDanger -> serious; 10 critical and 110
  trap -> critical; 255 unknown -> no reading; other values -> fair), the
  performance warning level (0 -> nominal, else fair) and CPU_Speed_Limit
  (100 -> nominal, 60-99 -> fair, below 60 -> serious; never critical: a
  Mac without its battery runs limited for good, and critical refuses work).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

from environment.power.state import THERMAL_STATES, PowerState

PMSET = "/usr/bin/pmset"  # absolute: never whatever `pmset` PATH finds first
COMMAND_TIMEOUT_S = 2.0
READ_BUDGET_S = 3.5  # all of one reading's pmset calls together (router/power_watch.py waits 5 s)
MAX_OUTPUT_CHARS = 64 << 10

PROVIDING_SOURCES = {"AC Power": "ac", "Battery Power": "battery", "UPS Power": "battery"}


class NotOnMac(OSError):
    """A macOS-only call made elsewhere."""


# ---------------------------------------------------------------- subprocess


def run_command(argv: list[str], timeout_s: float = COMMAND_TIMEOUT_S) -> tuple[str, str]:
    """(stdout, error): error is empty when the command exited 0 in time.
    Never raises. The command runs in its own process group, killed whole at
    the deadline: a child it left holding the pipe would otherwise keep the
    read waiting past it."""
    name = os.path.basename(argv[0])
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:  # FileNotFoundError: not on this machine
        return "", f"{name}: {e.strerror or e}"
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)
        proc.stdout.close()
        return "", f"{name}: no answer within {timeout_s:.1f} s"
    text = out[:MAX_OUTPUT_CHARS].decode("utf-8", "replace")
    if proc.returncode != 0:
        return text, f"{name}: exit status {proc.returncode}"
    return text, ""


# ------------------------------------------------------- pmset output parsing

_PROVIDING = re.compile(r"Now drawing from '([^']*)'")
_SOURCE_LINE = re.compile(r"^\s*-(.*?)\t\s*(\d+)%;", re.MULTILINE)
_LOW_POWER_MODE = re.compile(r"^\s*(lowpowermode|powermode)\s+(-?\d+)", re.MULTILINE)
_THERMAL_WARNING = re.compile(r"Thermal Warning Level = (-?\d+)")
_PERFORMANCE_WARNING = re.compile(r"Performance Warning Level = (-?\d+)")
_CPU_SPEED_LIMIT = re.compile(r"CPU_Speed_Limit\s*=\s*(-?\d+)")


def parse_pmset_batt(text: str) -> tuple[dict, str]:
    """`pmset -g batt` -> ({source, percent}, error)."""
    if "No power source info available" in text:
        return {"source": "ac"}, ""  # no battery, no UPS: a desktop
    found = _PROVIDING.search(text)
    if not found:
        return {}, "pmset -g batt: no 'Now drawing from' line"
    fields, error = {"source": PROVIDING_SOURCES.get(found.group(1), "unknown")}, ""
    if fields["source"] == "unknown":
        error = f"pmset -g batt: unknown power source {found.group(1)[:40]!r}"
    lines = _SOURCE_LINE.findall(text)
    # The internal battery first; a desktop's UPS otherwise.
    lines.sort(key=lambda line: not line[0].startswith("InternalBattery"))
    if lines:
        fields["percent"] = min(100, int(lines[0][1]))
    return fields, error


def parse_pmset_low_power(text: str) -> tuple[dict, str]:
    """`pmset -g` (the settings in use) -> ({low_power}, error). No line at
    all: a Mac without Low Power Mode (before macOS 12), so off."""
    if not text.strip():
        return {}, "pmset -g: empty output"
    found = _LOW_POWER_MODE.search(text)
    if not found:
        return {"low_power": False}, ""
    name, value = found.group(1), int(found.group(2))
    return {"low_power": value == 1 if name == "powermode" else value != 0}, ""


def _worse(a: str, b: str) -> str:
    return max(a, b, key=THERMAL_STATES.index)


def _thermal_from_warning_level(level: int) -> str | None:
    if level in (255, -1):  # kIOPMThermalLevelUnknown (or unset): no reading
        return None
    return {0: "nominal", 5: "fair", 100: "serious", 10: "critical", 110: "critical"}.get(level, "fair")


def _thermal_from_speed_limit(percent: int) -> str:
    return "nominal" if percent >= 100 else "fair" if percent >= 60 else "serious"


def parse_pmset_therm(text: str) -> tuple[dict, str]:
    """`pmset -g therm` -> ({thermal}, error): the worst its lines say."""
    if not text.strip():
        return {}, "pmset -g therm: empty output"
    thermal = "nominal"
    for found in _THERMAL_WARNING.finditer(text):
        thermal = _worse(thermal, _thermal_from_warning_level(int(found.group(1))) or "nominal")
    for found in _PERFORMANCE_WARNING.finditer(text):
        thermal = _worse(thermal, "nominal" if int(found.group(1)) == 0 else "fair")
    for found in _CPU_SPEED_LIMIT.finditer(text):
        thermal = _worse(thermal, _thermal_from_speed_limit(int(found.group(1))))
    return {"thermal": thermal}, ""


# ------------------------------------------------- IOKit / NSProcessInfo values


def power_from_iokit(providing: str | None, sources: list[dict]) -> tuple[dict, str]:
    """What `iokit_power_sources` returned -> ({source, percent}, error)."""
    present = [s for s in sources if s.get("Is Present") is not False]
    if providing is None and not present:
        return {"source": "ac"}, ""  # no power source at all: a desktop
    fields, error = {"source": PROVIDING_SOURCES.get(providing or "", "unknown")}, ""
    if fields["source"] == "unknown":
        error = f"IOKit: unknown power source {str(providing)[:40]!r}"
    present.sort(key=lambda s: s.get("Type") != "InternalBattery")
    for s in present:
        now, full = s.get("Current Capacity"), s.get("Max Capacity")
        if isinstance(now, int) and isinstance(full, int) and full > 0 and now >= 0:
            fields["percent"] = min(100, now * 100 // full)
            break
    return fields, error


def thermal_from_process_info(state: int | None) -> tuple[dict, str]:
    """NSProcessInfoThermalState (0 nominal .. 3 critical) -> ({thermal}, error)."""
    if state is None:
        return {}, "NSProcessInfo: no thermalState"
    if not 0 <= state < len(THERMAL_STATES):
        return {}, f"NSProcessInfo: unknown thermalState {state}"
    return {"thermal": THERMAL_STATES[state]}, ""


# ------------------------------------------------------- ctypes (macOS only)

_FRAMEWORKS = "/System/Library/Frameworks"
_UTF8 = 0x08000100  # kCFStringEncodingUTF8
_SINT64 = 4  # kCFNumberSInt64Type
_SOURCE_KEYS = ("Type", "Power Source State", "Current Capacity", "Max Capacity", "Is Present", "Name")


def _require_mac() -> None:
    if sys.platform != "darwin":
        raise NotOnMac(f"macOS only (this is {sys.platform})")


def _bind(lib, name: str, restype, *argtypes):
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


@functools.cache
def _iokit():
    """IOKit's power-source calls and the CoreFoundation calls to read their
    dictionaries, bound once."""
    _require_mac()
    vp, long = ctypes.c_void_p, ctypes.c_long
    cf = ctypes.CDLL(f"{_FRAMEWORKS}/CoreFoundation.framework/CoreFoundation")
    iokit = ctypes.CDLL(f"{_FRAMEWORKS}/IOKit.framework/IOKit")
    ns = SimpleNamespace(
        copy_info=_bind(iokit, "IOPSCopyPowerSourcesInfo", vp),
        copy_list=_bind(iokit, "IOPSCopyPowerSourcesList", vp, vp),
        description=_bind(iokit, "IOPSGetPowerSourceDescription", vp, vp, vp),
        providing=_bind(iokit, "IOPSGetProvidingPowerSourceType", vp, vp),
        count=_bind(cf, "CFArrayGetCount", long, vp),
        item=_bind(cf, "CFArrayGetValueAtIndex", vp, vp, long),
        get=_bind(cf, "CFDictionaryGetValue", vp, vp, vp),
        type_id=_bind(cf, "CFGetTypeID", ctypes.c_ulong, vp),
        string=_bind(cf, "CFStringGetCString", ctypes.c_bool, vp, ctypes.c_char_p, long, ctypes.c_uint32),
        number=_bind(cf, "CFNumberGetValue", ctypes.c_bool, vp, long, vp),
        boolean=_bind(cf, "CFBooleanGetValue", ctypes.c_bool, vp),
        release=_bind(cf, "CFRelease", None, vp),
    )
    ns.string_id = _bind(cf, "CFStringGetTypeID", ctypes.c_ulong)()
    ns.number_id = _bind(cf, "CFNumberGetTypeID", ctypes.c_ulong)()
    ns.boolean_id = _bind(cf, "CFBooleanGetTypeID", ctypes.c_ulong)()
    make = _bind(cf, "CFStringCreateWithCString", vp, vp, ctypes.c_char_p, ctypes.c_uint32)
    ns.keys = {k: make(None, k.encode(), _UTF8) for k in _SOURCE_KEYS}  # kept for the process's life
    return ns


def _cf_value(cf, ref):
    """A CFString, CFNumber or CFBoolean as str, int or bool; anything else None."""
    if not ref:
        return None
    kind = cf.type_id(ref)
    if kind == cf.string_id:
        buf = ctypes.create_string_buffer(256)
        return buf.value.decode("utf-8", "replace") if cf.string(ref, buf, len(buf), _UTF8) else None
    if kind == cf.number_id:
        out = ctypes.c_int64()
        return out.value if cf.number(ref, _SINT64, ctypes.byref(out)) else None
    if kind == cf.boolean_id:
        return bool(cf.boolean(ref))
    return None


def iokit_power_sources() -> tuple[str | None, list[dict]]:
    """(providing power source type, one dict per power source with the
    _SOURCE_KEYS it has), from IOPSCopyPowerSourcesInfo. macOS only."""
    cf = _iokit()
    info = cf.copy_info()
    if not info:
        return None, []
    try:
        providing = _cf_value(cf, cf.providing(info))  # a Get: not ours to release
        sources = []
        listed = cf.copy_list(info)
        if listed:
            try:
                for i in range(cf.count(listed)):
                    desc = cf.description(info, cf.item(listed, i))
                    if desc:
                        sources.append({k: _cf_value(cf, cf.get(desc, key)) for k, key in cf.keys.items()})
            finally:
                cf.release(listed)
        return providing, sources
    finally:
        cf.release(info)


@functools.cache
def _objc():
    """The Objective-C runtime, with objc_msgSend typed once per signature
    (on arm64 a variadic call would pass the arguments wrongly)."""
    _require_mac()
    vp = ctypes.c_void_p
    objc = ctypes.CDLL("/usr/lib/libobjc.A.dylib")
    ctypes.CDLL(f"{_FRAMEWORKS}/Foundation.framework/Foundation")  # registers NSProcessInfo
    send = ctypes.cast(objc.objc_msgSend, vp).value
    return SimpleNamespace(
        get_class=_bind(objc, "objc_getClass", vp, ctypes.c_char_p),
        selector=_bind(objc, "sel_registerName", vp, ctypes.c_char_p),
        class_of=_bind(objc, "object_getClass", vp, vp),
        responds=_bind(objc, "class_respondsToSelector", ctypes.c_bool, vp, vp),
        send_id=ctypes.CFUNCTYPE(vp, vp, vp)(send),
        send_bool=ctypes.CFUNCTYPE(ctypes.c_bool, vp, vp)(send),
        send_long=ctypes.CFUNCTYPE(ctypes.c_long, vp, vp)(send),
    )


def process_info() -> tuple[bool | None, int | None]:
    """(NSProcessInfo.isLowPowerModeEnabled, .thermalState), None for what
    this macOS lacks (asked first: an unknown selector would raise an
    Objective-C exception and end the process). macOS only."""
    objc = _objc()
    cls = objc.get_class(b"NSProcessInfo")
    if not cls:
        raise OSError("NSProcessInfo not found")
    info = objc.send_id(cls, objc.selector(b"processInfo"))
    if not info:
        raise OSError("NSProcessInfo.processInfo returned nil")
    kind = objc.class_of(info)
    low_sel, thermal_sel = objc.selector(b"isLowPowerModeEnabled"), objc.selector(b"thermalState")
    low = bool(objc.send_bool(info, low_sel)) if objc.responds(kind, low_sel) else None
    thermal = int(objc.send_long(info, thermal_sel)) if objc.responds(kind, thermal_sel) else None
    return low, thermal


# ------------------------------------------------------------------ reading


def _with_pmset(args: list[str], parse, run, deadline: float) -> tuple[dict, str]:
    left = deadline - time.monotonic()
    if left <= 0:
        return {}, f"pmset {' '.join(args)}: no time left in this reading"
    text, error = run([PMSET, *args], min(COMMAND_TIMEOUT_S, left))
    if error and not text:
        return {}, f"pmset {' '.join(args)}: {error.split(': ', 1)[-1]}"  # run_command's "pmset: ..."
    return parse(text)


def _iokit_part(iokit) -> tuple[dict, str]:
    """IOKit's {source, percent}, or nothing where the call fails (off a
    Mac: NotOnMac); the caller then asks pmset."""
    try:
        return power_from_iokit(*iokit())
    except Exception:  # noqa: BLE001 - any failure of a native call means: ask pmset
        return {}, ""


def read_macos(run=run_command, iokit=iokit_power_sources, process=process_info,
               budget_s: float = READ_BUDGET_S) -> PowerState:
    """One reading: each part from its ctypes call, else from pmset. Never
    raises; `reader` names what answered ("iokit+nsprocessinfo" on a
    current Mac), `error` why a part is missing or doubtful. The seams are
    parameters so tests drive every path with recorded values."""
    deadline = time.monotonic() + budget_s
    fields, errors, readers = {}, [], []
    try:
        low, thermal_state = process()
    except Exception:  # noqa: BLE001 - any failure of the native call means: ask pmset
        low, thermal_state = None, None
    parts = [
        (_iokit_part(iokit), "iokit", ["-g", "batt"], parse_pmset_batt),
        (({"low_power": low}, "") if low is not None else ({}, ""), "nsprocessinfo", ["-g"], parse_pmset_low_power),
        (thermal_from_process_info(thermal_state) if thermal_state is not None else ({}, ""), "nsprocessinfo",
         ["-g", "therm"], parse_pmset_therm),
    ]
    for (got, error), reader, pmset_args, parse in parts:
        if not got:  # the native call failed or said nothing: pmset, and its error if any
            (got, error), reader = _with_pmset(pmset_args, parse, run, deadline), "pmset"
        fields.update(got)
        if error:
            errors.append(error)
        if got and reader not in readers:
            readers.append(reader)
    return PowerState(**fields, reader="+".join(readers) or "none", error="; ".join(errors))
