"""One reading of the machine's power and thermal state."""

from __future__ import annotations

from dataclasses import asdict, dataclass

SOURCES = ("ac", "battery", "unknown")
# macOS's NSProcessInfoThermalState names; Linux thermal zones are mapped onto them.
THERMAL_STATES = ("nominal", "fair", "serious", "critical")


@dataclass(frozen=True)
class PowerState:
    source: str = "unknown"  # "ac" | "battery" | "unknown" (a machine without a battery reads "ac")
    percent: int | None = None  # battery charge, 0-100; None: no battery or unknown
    low_power: bool = False  # macOS Low Power Mode; Linux: the "low-power"/"quiet" ACPI platform profile
    thermal: str = "nominal"  # one of THERMAL_STATES
    reader: str = ""  # what produced it: "pmset", "iokit", "sysfs", "file", "none"
    error: str = ""  # why part of a reading is missing (empty when complete)

    def as_dict(self) -> dict:
        return asdict(self)
