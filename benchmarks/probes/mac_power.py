"""What each macOS power reader returns, side by side: IOKit against
`pmset -g batt`, NSProcessInfo against `pmset -g` and `pmset -g therm`, then
the PowerState `tandem serve` would use. Run it on a Mac (on AC, on battery,
with Low Power Mode on, under load) to check environment/power/macos.py; the
readers count as unverified until it has run.

    python benchmarks/probes/mac_power.py [--record DIR --label NAME]

--record writes the raw outputs (pmset_batt_NAME.txt, pmset_g_NAME.txt,
pmset_therm_NAME.txt, native_NAME.json) into DIR, e.g.
tests/deploy/fixtures/power, to replace the reconstructed fixtures there.
Elsewhere it prints what a Mac-only call says off a Mac.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from environment.power import macos  # noqa: E402


def timed(call):
    """(value or the exception, milliseconds)."""
    t0 = time.perf_counter()
    try:
        value = call()
    except Exception as e:  # noqa: BLE001 - a probe shows every failure
        value = e
    return value, (time.perf_counter() - t0) * 1000


def show(title: str, native, native_ms: float, native_part, pmset_text: str, pmset_error: str, pmset_ms: float,
         pmset_part) -> None:
    print(f"== {title}")
    print(f"  native ({native_ms:.1f} ms): {native!r}")
    print(f"     -> {native_part}")
    print(f"  pmset  ({pmset_ms:.1f} ms): {pmset_error or 'ok'}")
    for line in pmset_text.splitlines():
        print(f"     | {line}")
    print(f"     -> {pmset_part}")


def _pmset(*args: str):
    (text, error), ms = timed(lambda: macos.run_command([macos.PMSET, *args]))
    return text, error, ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", metavar="DIR", help="write the raw outputs into this folder")
    parser.add_argument("--label", default="this_mac", help="the recording's name (ac_charging, battery, low_power...)")
    args = parser.parse_args()

    sources, sources_ms = timed(macos.iokit_power_sources)
    info, info_ms = timed(macos.process_info)
    batt, g, therm = _pmset("-g", "batt"), _pmset("-g"), _pmset("-g", "therm")

    def part(value, mapping):
        return value if isinstance(value, Exception) else mapping(value)

    show("power source (IOKit | pmset -g batt)", sources, sources_ms, part(sources, lambda v: macos.power_from_iokit(*v)),
         *batt, macos.parse_pmset_batt(batt[0]))
    show("Low Power Mode (NSProcessInfo.isLowPowerModeEnabled | pmset -g)", info, info_ms,
         part(info, lambda v: v[0]), *g, macos.parse_pmset_low_power(g[0]))
    show("thermal (NSProcessInfo.thermalState | pmset -g therm)", info, info_ms,
         part(info, lambda v: macos.thermal_from_process_info(v[1])), *therm, macos.parse_pmset_therm(therm[0]))
    state, ms = timed(macos.read_macos)
    print(f"== read_macos ({ms:.1f} ms): {state}")

    if args.record:
        out = Path(args.record)
        out.mkdir(parents=True, exist_ok=True)
        for name, (text, _, _) in (("pmset_batt", batt), ("pmset_g", g), ("pmset_therm", therm)):
            (out / f"{name}_{args.label}.txt").write_text(text)
        native = {"iokit": repr(sources) if isinstance(sources, Exception) else sources,
                  "process_info": repr(info) if isinstance(info, Exception) else info}
        (out / f"native_{args.label}.json").write_text(json.dumps(native, indent=1) + "\n")
        print(f"recorded into {out}")


if __name__ == "__main__":
    main()
