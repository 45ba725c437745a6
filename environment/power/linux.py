"""The power state on Linux, from sysfs: /sys/class/power_supply, the
thermal zones and the ACPI platform profile. `root` is the file system's
root, so tests read a fake tree written in a temporary folder.

Mappings:
- Source: any AC adapter (type Mains or USB) online -> "ac"; else a system
  battery (scope other than Device: a mouse's battery is not the machine's)
  Discharging -> "battery"; Charging, Full or Not charging -> "ac"; adapters
  listed but all offline -> "battery"; no system battery (a desktop, a
  server, a container) -> "ac"; otherwise "unknown".
- Percent: the system batteries' `capacity`, weighted by their full charge
  where each says it (`energy_full`, else `charge_full`), else averaged.
- Thermal, per zone, the temperature (`temp`, millidegrees C) against the
  zone's trip points (`trip_point_N_type`, `trip_point_N_temp`; a trip at
  0 or below is unset): at a "hot" trip, or within 5 C of a "critical" one
  (where the kernel powers off) -> critical; at a "passive" trip (the
  kernel throttles the CPU) -> serious; at an "active" trip (fans) -> fair;
  below them all, or no trips -> nominal. The machine's state is its worst
  zone's; a zone that cannot be read (a Wi-Fi card's while it is down) is
  skipped.
- Low power: /sys/firmware/acpi/platform_profile "low-power" or "quiet".
"""

from __future__ import annotations

import os

from environment.power.state import THERMAL_STATES, PowerState

MAX_READ_BYTES = 4096  # a sysfs attribute is one short line
CRITICAL_MARGIN_MC = 5000  # within 5 C of the power-off trip counts as critical
ADAPTER_TYPES = ("Mains", "USB")
ON_AC_STATUSES = ("Charging", "Full", "Not charging")
LOW_POWER_PROFILES = ("low-power", "quiet")


def read_attribute(path: str) -> str | None:
    """A sysfs attribute's text, stripped; None when it cannot be read
    (missing, refused, or a driver error such as ENODATA)."""
    try:
        with open(path, "rb") as f:
            return f.read(MAX_READ_BYTES).decode("utf-8", "replace").strip()
    except (OSError, ValueError):
        return None


def _int_attribute(path: str) -> int | None:
    text = read_attribute(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _full_charge(supply: str) -> tuple[str, int] | None:
    """A battery's full charge, in energy (uWh) or charge (uAh): the weight
    of its capacity beside another battery's."""
    for kind in ("energy", "charge"):
        value = _int_attribute(os.path.join(supply, f"{kind}_full"))
        if value and value > 0:
            return kind, value
    return None


def power_supplies(root: str = "/") -> tuple[list[dict], str]:
    """(one dict per power_supply entry: name, type, scope, online, status,
    present, capacity, full; error). Entries are read, not judged."""
    base = os.path.join(root, "sys/class/power_supply")
    try:
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        return [], ""  # no power_supply class at all: a server or a container
    except OSError as e:
        return [], f"{base}: {e.strerror or e}"
    supplies = []
    for name in names:
        d = os.path.join(base, name)
        supplies.append({
            "name": name,
            "type": read_attribute(os.path.join(d, "type")),
            "scope": read_attribute(os.path.join(d, "scope")),
            "online": read_attribute(os.path.join(d, "online")),
            "status": read_attribute(os.path.join(d, "status")),
            "present": read_attribute(os.path.join(d, "present")),
            "capacity": read_attribute(os.path.join(d, "capacity")),
            "full": _full_charge(d),
        })
    return supplies, ""


def _percent(batteries: list[dict]) -> tuple[int | None, str]:
    readings, errors = [], []
    for b in batteries:
        text = b["capacity"]
        try:
            value = int(text) if text is not None else None
        except ValueError:
            value = None
        if value is None or not 0 <= value <= 100:
            errors.append(f"{b['name']}: capacity {str(text)[:20]!r} is not a percent")
            continue
        readings.append((value, b["full"]))
    if not readings:
        return None, "; ".join(errors)
    fulls = [full for _, full in readings]
    if None not in fulls and len({unit for unit, _ in fulls}) == 1:  # weights in one unit
        weights = [amount for _, amount in fulls]
    else:
        weights = [1] * len(readings)
    percent = sum(value * w for (value, _), w in zip(readings, weights)) / sum(weights)
    return round(percent), "; ".join(errors)


def source_and_percent(supplies: list[dict]) -> tuple[dict, str]:
    """The machine's power supplies -> ({source, percent}, error)."""
    system = [s for s in supplies if s["scope"] != "Device"]
    adapters = [s for s in system if s["type"] in ADAPTER_TYPES]
    batteries = [s for s in system if s["type"] == "Battery" and s["present"] != "0"]
    percent, error = _percent(batteries)
    statuses = {b["status"] for b in batteries}
    if any(a["online"] == "1" for a in adapters) or not batteries:
        source = "ac"  # without a battery nothing else could run it: a desktop, a server, a container
    elif "Discharging" in statuses:
        source = "battery"
    elif statuses & set(ON_AC_STATUSES):
        source = "ac"
    elif adapters and all(a["online"] == "0" for a in adapters):
        source = "battery"
    else:
        source = "unknown"
        error = "; ".join(filter(None, [error, "power_supply: neither an adapter online nor a battery status"]))
    return {"source": source, "percent": percent}, error


def zone_thermal(zone: str) -> str | None:
    """One thermal zone's state (mapping in the module's docstring), None
    when its temperature cannot be read."""
    temp = _int_attribute(os.path.join(zone, "temp"))
    if temp is None:
        return None
    state = "nominal"
    for n in range(64):  # a zone has a handful of trips, numbered from 0
        kind = read_attribute(os.path.join(zone, f"trip_point_{n}_type"))
        if kind is None:
            break
        trip = _int_attribute(os.path.join(zone, f"trip_point_{n}_temp"))
        if trip is None or trip <= 0:
            continue
        if (kind == "critical" and temp >= trip - CRITICAL_MARGIN_MC) or (kind == "hot" and temp >= trip):
            reached = "critical"
        elif kind == "passive" and temp >= trip:
            reached = "serious"
        elif kind == "active" and temp >= trip:
            reached = "fair"
        else:
            continue
        state = max(state, reached, key=THERMAL_STATES.index)
    return state


def thermal_state(root: str = "/") -> str:
    """The worst readable thermal zone's state; nominal without zones."""
    base = os.path.join(root, "sys/class/thermal")
    try:
        zones = sorted(n for n in os.listdir(base) if n.startswith("thermal_zone"))
    except OSError:
        return "nominal"
    states = [s for n in zones if (s := zone_thermal(os.path.join(base, n))) is not None]
    return max(states, key=THERMAL_STATES.index, default="nominal")


def low_power_profile(root: str = "/") -> bool:
    return read_attribute(os.path.join(root, "sys/firmware/acpi/platform_profile")) in LOW_POWER_PROFILES


def has_readings(root: str = "/") -> bool:
    """Whether anything here can change: a system battery or an AC adapter
    listed, or a thermal zone. False on a server or in a container, where
    every reading says "ac", nominal."""
    supplies, _ = power_supplies(root)
    if any(s["scope"] != "Device" and s["type"] in (*ADAPTER_TYPES, "Battery") for s in supplies):
        return True
    try:
        return any(n.startswith("thermal_zone") for n in os.listdir(os.path.join(root, "sys/class/thermal")))
    except OSError:
        return False


def read_linux(root: str = "/") -> PowerState:
    """One reading from sysfs. Never raises."""
    supplies, list_error = power_supplies(root)
    fields, error = source_and_percent(supplies)
    if list_error:
        fields["source"] = "unknown"
    return PowerState(**fields, low_power=low_power_profile(root), thermal=thermal_state(root), reader="sysfs",
                      error="; ".join(filter(None, [list_error, error])))
