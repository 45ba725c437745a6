"""Which reader answers `read_power`: the --power-state-file when set, else
this platform's (environment/power/macos.py, environment/power/linux.py).

Every reader returns a PowerState and never raises: what it could not read
is left at its default and said in `error`. A reading is bounded in time
(each pmset call within 2 s, all of them within 3.5 s; sysfs and the state
file are plain reads) but blocks while it lasts: call it off the event loop.
"""

from __future__ import annotations

import json
import os
import stat
import sys

from environment.power import linux, macos
from environment.power.state import SOURCES, THERMAL_STATES, PowerState

MAX_STATE_FILE_BYTES = 4096


def read_power(settings) -> PowerState:
    """The power state now (settings: environment.settings.Settings)."""
    try:
        if settings.power_state_file:
            return read_state_file(settings.power_state_file)
        return read_machine()
    except Exception as e:  # noqa: BLE001 - the readers catch their own; this is the last guard
        return PowerState(reader="none", error=f"power reader failed: {type(e).__name__}: {e}")


def read_machine() -> PowerState:
    if sys.platform == "darwin":
        return macos.read_macos()
    if sys.platform.startswith("linux"):
        return linux.read_linux()
    return PowerState(reader="none", error=f"no power reader for {sys.platform}")


def has_power_reading(settings) -> bool:
    """Whether polling can ever see a change: a state file, any Mac, or a
    Linux machine listing a battery, an AC adapter or a thermal zone. False
    on a server: every reading there is "ac", nominal. Cheap: no subprocess."""
    if settings.power_state_file:
        return True
    if sys.platform == "darwin":
        return True
    if sys.platform.startswith("linux"):
        return linux.has_readings()
    return False


def _load_state_file(path: str) -> tuple[object, str]:
    """(the file's JSON value, error). Only a regular file is opened (a FIFO
    would block the open), and only its first few KiB read."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None, f"{path}: not a regular file"
        with open(path, "rb") as f:
            data = f.read(MAX_STATE_FILE_BYTES + 1)
    except OSError as e:
        return None, f"{path}: {e.strerror or e}"
    if len(data) > MAX_STATE_FILE_BYTES:
        return None, f"{path}: over {MAX_STATE_FILE_BYTES} bytes"
    try:
        return json.loads(data), ""
    except (ValueError, RecursionError) as e:
        return None, f"{path}: not JSON ({str(e)[:80]})"


def _state_field(key: str, value) -> tuple[object, str]:
    """(the checked value, or None to leave the default; error)."""
    if key == "source":
        if value in SOURCES:
            return value, ""
        return "unknown", f"source {str(value)[:20]!r} is not one of {', '.join(SOURCES)}"
    if key == "percent":
        if value is None:
            return None, ""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 100:
            return round(value), ""
        return None, f"percent {str(value)[:20]!r} is not a number from 0 to 100"
    if key == "low_power":
        return (value, "") if isinstance(value, bool) else (None, f"low_power {str(value)[:20]!r} is not true or false")
    if key == "thermal":
        if value in THERMAL_STATES:
            return value, ""
        return None, f"thermal {str(value)[:20]!r} is not one of {', '.join(THERMAL_STATES)}"
    if key == "error":  # a file may say a reader failed, to try that too
        return (value[:200], "") if isinstance(value, str) else (None, "error is not a string")
    return None, ""  # "reader": always "file" here


def read_state_file(path: str) -> PowerState:
    """A JSON object with any of PowerState's fields, read afresh at every
    call (rewrite the file to try a policy). Never raises: a missing or
    garbled file, a wrong type, an unknown value or field gives a
    PowerState with `error` set (and the fields that were right)."""
    data, error = _load_state_file(path)
    if error:
        return PowerState(reader="file", error=error)
    if not isinstance(data, dict):
        return PowerState(reader="file", error=f"{path}: not a JSON object")
    fields, errors = {}, []
    for key, value in data.items():
        if key not in PowerState.__dataclass_fields__:
            errors.append(f"unknown field {str(key)[:20]!r}")
            continue
        checked, field_error = _state_field(key, value)
        if checked is not None:
            fields[key] = checked
        if field_error:
            errors.append(field_error)
    if "error" in fields:
        errors.insert(0, fields.pop("error"))
    return PowerState(**fields, reader="file", error="; ".join(e for e in errors if e))
