"""Energy per output token in `tandem bench`: the meters, the windows, the report, a row per power policy.

This box has no RAPL, no GPU and no Mac, so each meter is driven by a double:
RAPL by a powercap tree in tmp_path, nvidia-smi by a script of that name on
PATH printing recorded-format output, powermetrics by its text output (the
format Apple documents; not captured on a Mac here: unverified).
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path

import pytest

from benchmarks.bench import bench_cmd
from benchmarks.bench.measures import energy
from benchmarks.bench.measures.energy import (EnergyRecorder, Meter, NvidiaSmiMeter, PowermetricsMeter,
                                              RaplMeter, counter_delta, parse_gpu_csv, parse_powermetrics)
from benchmarks.bench.measures.energy_run import EnergyRun, output_tokens, per_token
from benchmarks.bench.reporting import report
from benchmarks.bench.servers import systems
from benchmarks.bench.workloads import core as workloads
from benchmarks.bench.workloads.loadgen import RequestResult
from tests.support.bench_runs import run_bench_cmd


# ------------------------------------------------------------------ RAPL

def _zone(path: Path, name: str, energy_uj: int, max_uj: int = 262143328850) -> Path:
    path.mkdir(parents=True)
    (path / "name").write_text(name + "\n")
    (path / "energy_uj").write_text(f"{energy_uj}\n")
    (path / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return path


@pytest.fixture
def powercap(tmp_path):
    """Two packages (one with core and dram subzones), a psys zone, and the top-level
    links sysfs also has for subzones: only package-0, package-0/dram and package-1 count."""
    root = tmp_path / "powercap"
    p0 = _zone(root / "intel-rapl:0", "package-0", 900_000, max_uj=1_000_000)
    _zone(p0 / "intel-rapl:0:0", "core", 5_000_000)
    _zone(p0 / "intel-rapl:0:1", "dram", 1_000_000)
    _zone(root / "intel-rapl:0:0", "core", 5_000_000)  # sysfs's top-level alias of the subzone
    _zone(root / "intel-rapl:1", "package-1", 2_000_000)
    _zone(root / "intel-rapl:2", "psys", 9_000_000)
    return root


def _set(zone: Path, energy_uj: int) -> None:
    (zone / "energy_uj").write_text(f"{energy_uj}\n")


def test_rapl_counts_packages_and_dram_once_and_handles_the_wrap(powercap):
    meter = RaplMeter(powercap)
    assert meter.available(), meter.reason
    assert meter.domains == ["package-0", "package-0/dram", "package-1"]
    recorder = EnergyRecorder([meter], interval_s=3600)  # no background poll: marks only
    with recorder:
        a = recorder.mark()
        _set(powercap / "intel-rapl:0", 100_000)  # wrapped at 1 J: 0.1 J to the top, 0.1 J after
        _set(powercap / "intel-rapl:0" / "intel-rapl:0:1", 1_500_000)
        _set(powercap / "intel-rapl:0" / "intel-rapl:0:0", 9_000_000)  # core: inside the package
        _set(powercap / "intel-rapl:2", 99_000_000)  # psys: overlaps the packages
        _set(powercap / "intel-rapl:1", 5_000_000)
        w = recorder.window(a, recorder.mark())
    assert w["by_domain"] == {"rapl:package-0": pytest.approx(0.2), "rapl:package-0/dram": pytest.approx(0.5),
                              "rapl:package-1": pytest.approx(3.0)}
    assert w["joules"] == pytest.approx(3.7)
    assert counter_delta(10, 30, 100) == 20 and counter_delta(90, 5, 100) == 15 and counter_delta(90, 5, None) == 0


def test_rapl_unreadable_counter_is_not_available_with_the_reason(powercap, monkeypatch):
    # The tests run as root here, where chmod 000 does not stop a read: the
    # PermissionError a normal user gets from energy_uj (Linux 5.10+) is raised by a double.
    real = energy._read_int

    def root_only(path):
        if path.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(energy, "_read_int", root_only)
    meter = RaplMeter(powercap)
    assert not meter.available()
    assert "root" in meter.reason and "energy_uj" in meter.reason
    assert EnergyRecorder.open([meter]) == (None, {"rapl": meter.reason})
    missing = RaplMeter(powercap / "nowhere")
    assert not missing.available() and "nowhere" in missing.reason


def test_rapl_garbage_mid_run_is_counted_and_skipped(powercap):
    meter = RaplMeter(powercap)
    assert meter.available()
    meter.start()
    (powercap / "intel-rapl:1" / "energy_uj").write_text("garbage")
    meter.poll()  # must not raise
    assert meter.errors == 1 and "intel-rapl:1" in meter.last_error
    _set(powercap / "intel-rapl:1", 2_500_000)
    meter.poll()  # the next good read covers the interval
    assert meter.joules["package-1"] == pytest.approx(0.5)


# ------------------------------------------------------------------ nvidia-smi

# The documented shape of `nvidia-smi --help-query-gpu` (an excerpt).
HELP = '''List of valid properties to query for the switch "--query-gpu=":

"index"
Zero based index of the GPU. Can change at each boot.

"uuid"
This value is the globally unique immutable alphanumeric identifier of the GPU.

"power.draw"
The last measured power draw for the entire board, in watts. On Ampere or newer devices, returns average
power draw over 1 sec.

"power.draw.instant"
The last measured power draw for the entire board, in watts.
'''


def _fake_nvidia_smi(tmp_path, monkeypatch, samples: list[str], help_text: str = HELP, delay: float = 0) -> Path:
    """A `nvidia-smi` on PATH (this box has no GPU): --help-query-gpu prints `help_text`,
    each --query-gpu the next of `samples` (lines of `index, uuid, value`, GPUs split by ';')."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "help.txt").write_text(help_text)
    (bin_dir / "samples.txt").write_text("\n".join(samples) + "\n")
    (bin_dir / "n").write_text("0")
    script = bin_dir / "nvidia-smi"
    script.write_text(f'''#!/bin/sh
d=$(dirname "$0")
{f"exec sleep {delay}" if delay else ""}
case "$1" in
  --help-query-gpu) cat "$d/help.txt" ;;
  --query-gpu=*) n=$(cat "$d/n"); echo $((n + 1)) > "$d/n"; sed -n "$((n + 1))p" "$d/samples.txt" | tr ';' '\\n' ;;
  *) exit 2 ;;
esac
''')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return bin_dir


class ManualClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_nvidia_smi_power_samples_integrate_over_the_gpus_in_use(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch, [
        "0, GPU-aaaa, 70.00;1, GPU-bbbb, 60.00",  # the availability check
        "0, GPU-aaaa, 100.00;1, GPU-bbbb, 50.00",
        "0, GPU-aaaa, 200.00;1, GPU-bbbb, 50.00",
        "0, GPU-aaaa, 300.00;1, GPU-bbbb, [N/A]",
        "0, GPU-aaaa, 300.00;1, GPU-bbbb, 50.00",
    ])
    clock = ManualClock()
    meter = NvidiaSmiMeter(clock=clock)
    assert meter.available(), meter.reason
    assert meter.field == "power.draw.instant" and meter.domains == ["gpu0 board", "gpu1 board"]
    meter.start()  # t=0: 100 W, 50 W
    for t in (1.0, 2.0, 3.0):
        clock.now = t
        meter.poll()
    # GPU 0: trapezoid over 100, 200, 300, 300 W at 1 s apart; GPU 1: its [N/A] sample
    # is skipped and counted, the 2 s gap between its good samples integrated as one.
    assert meter.joules["gpu0 board"] == pytest.approx(150 + 250 + 300)
    assert meter.joules["gpu1 board"] == pytest.approx(50 + 100)
    assert meter.errors == 1


def test_nvidia_smi_counts_only_cuda_visible_devices(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch, ["0, GPU-aaaa, 70.0;1, GPU-bbbb, 60.0"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")
    meter = NvidiaSmiMeter()
    assert meter.available() and meter.gpus == ["1"]
    assert parse_gpu_csv("0, GPU-a, 71.2\n1, GPU-b, [Not Supported]\ngarbage\n") == {
        "0": ("GPU-a", 71.2), "1": ("GPU-b", None)}


def test_nvidia_smi_energy_counter_when_the_cli_lists_one(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch, ["0, GPU-aaaa, 5000", "0, GPU-aaaa, 6000", "0, GPU-aaaa, 8500"],
                     help_text=HELP + '\n"total_energy_consumption"\nmJ since the driver was loaded.\n')
    meter = NvidiaSmiMeter()
    assert meter.available() and meter.counter and meter.method.startswith("counter")
    meter.start()
    meter.poll()
    assert meter.joules == {"gpu0 board": pytest.approx(2.5)}


def test_nvidia_smi_missing_or_hung_never_raises_nor_hangs(tmp_path, monkeypatch):
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tmp_path))
    meter = NvidiaSmiMeter()
    assert not meter.available() and "not found" in meter.reason
    monkeypatch.setenv("PATH", path)
    _fake_nvidia_smi(tmp_path, monkeypatch, ["0, GPU-aaaa, 70.0"], delay=30)
    hung = NvidiaSmiMeter(timeout_s=0.3)
    assert not hung.available() and "timed out" in hung.reason


# ------------------------------------------------------------------ macOS

# The text `powermetrics --samplers cpu_power,gpu_power -i 200` prints on Apple
# Silicon, in Apple's documented format (not captured on a Mac here: unverified).
POWERMETRICS = """Machine model: Mac14,2
OS version: 23F79
Boot arguments:
Boot time: Mon Jun  3 09:12:01 2024



*** Sampled system activity (Mon Jun  3 10:01:02 2024 +0200) (200.50ms elapsed) ***


**** Processor usage ****

E-Cluster HW active frequency: 1180 MHz
P-Cluster HW active frequency: 3204 MHz

ANE Power: 0 mW
CPU Power: 1144 mW
GPU Power: 22 mW
Combined Power (CPU + GPU + ANE): 1166 mW

**** GPU usage ****

GPU HW active frequency: 389 MHz
GPU Power: 22 mW


*** Sampled system activity (Mon Jun  3 10:01:02 2024 +0200) (201.00ms elapsed) ***

**** Processor usage ****

CPU Power: 4100 mW
GPU Power: 900 mW
Combined Power (CPU + GPU + ANE): 5000 mW

**** GPU usage ****

GPU Power: 900 mW
"""


def test_powermetrics_blocks_parse_to_power_times_elapsed():
    assert parse_powermetrics(POWERMETRICS) == [(pytest.approx(0.2005), pytest.approx(1.166)),
                                                (pytest.approx(0.201), pytest.approx(5.0))]
    intel = ("*** Sampled system activity (Mon Jun  3 10:01:02 2024 +0200) (1000.0ms elapsed) ***\n"
             "Intel energy model derived package power (CPUs+GT+SA): 1.63W\n")
    assert parse_powermetrics(intel) == [(pytest.approx(1.0), pytest.approx(1.63))]
    assert parse_powermetrics("Combined Power (CPU + GPU + ANE): 5 mW\n") == []  # no block header: no figure


def test_powermetrics_meter_streams_the_process_output(tmp_path):
    fake = tmp_path / "powermetrics"
    (tmp_path / "out.txt").write_text(POWERMETRICS)
    fake.write_text(f"#!/bin/sh\ncat {tmp_path / 'out.txt'}\n")
    fake.chmod(0o755)
    meter = PowermetricsMeter(binary=str(fake))
    meter.start()
    meter._reader.join(timeout=10)
    meter.stop()
    assert meter.joules["CPU+GPU+ANE"] == pytest.approx(0.2005 * 1.166 + 0.201 * 5.0)
    if os.uname().sysname != "Darwin":
        assert not PowermetricsMeter().available()


# ------------------------------------------------------------------ the bench

class CountingMeter(Meter):
    """One joule per reading: windows are exact counts of the marks inside them."""

    name = "counting"
    method = "test double"

    def __init__(self):
        super().__init__()
        self.domains = ["all"]
        self.joules = {"all": 0.0}

    def available(self) -> bool:
        return True

    def start(self) -> None:
        pass

    def poll(self) -> None:
        self.joules["all"] += 1.0


def _fake_send(tokens: int):
    async def send(client, target, cfg, messages, max_tokens):
        return RequestResult(200, ok=True, ttft=0.01, chunk_times=[0.01 * (i + 1) for i in range(tokens)],
                             latency=0.01 * tokens, output_tokens=tokens)
    return send


def test_sweep_levels_and_workloads_get_joules_per_output_token(monkeypatch):
    monkeypatch.setattr(workloads, "send", _fake_send(4))
    run = EnergyRun(EnergyRecorder([CountingMeter()], interval_s=3600))
    cfg = workloads.WorkloadConfig(concurrency=(1, 2), requests_per_level=4, warmup_rounds=1)
    target = workloads.Target("fake", "http://127.0.0.1:9", "m")
    results, _ = asyncio.run(bench_cmd._measure(target, cfg, ("sweep",), 0.0, None, energy=run))
    for lv in results["sweep"]:  # a level: two marks, one joule; 4 requests x 4 tokens
        assert lv["energy"]["joules"] == 1.0 and lv["energy"]["joules_per_output_token"] == 1 / 16
    entry = run.report()
    assert entry["workloads"]["sweep"]["joules"] == 5.0  # its own 2 marks and the levels' 4, less the first
    assert entry["output_tokens"] == 32 and entry["joules_per_output_token"] == 5 / 32
    assert entry["scope"].startswith("machine-wide") and entry["domains"] == ["counting:all"]
    assert entry["idle"] is None and entry["joules_per_output_token_above_idle"] is None


def test_above_idle_and_tokens_per_workload():
    w = per_token({"joules": 100.0, "seconds": 10.0, "watts": 10.0}, 50, idle_watts=4.0)
    assert w["joules_per_output_token"] == 2.0 and w["joules_per_output_token_above_idle"] == (100 - 40) / 50
    assert per_token({"joules": 1.0, "seconds": 1.0}, None, 4.0)["joules_per_output_token"] is None
    assert output_tokens("sweep", [{"output_tokens": 3}, {"output_tokens": 4}]) == 7
    assert output_tokens("interference", {"quiet": {"output_tokens": 2}, "loud": {"output_tokens": 5}}) == 7
    assert output_tokens("swarm", {"output_tokens": 9}) == 9
    assert output_tokens("prefix", {"cold_ttft_s": 0.1}) is None


def _system(name: str, tok_s: float, j_tok: float | None) -> dict:
    lv = {"concurrency": 4, "requests": 8, "ok": 8, "errors": {}, "error_count": 0, "rejected_429": 0,
          "output_tok_s": tok_s, "requests_s": 1.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "itl_p50_s": 0.01,
          "itl_p99_s": 0.02, "goodput": 1.0, "output_tokens": 100, "first_error": None}
    energy_entry = None
    if j_tok is not None:
        lv["energy"] = per_token({"joules": j_tok * 100, "seconds": 10.0, "watts": j_tok * 10}, 100, 5.0)
        window = {**lv["energy"], "by_domain": {"rapl:package-0": j_tok * 100}}
        energy_entry = {"scope": energy.SCOPE, "meters": [], "domains": ["rapl:package-0"],
                        "idle": {"seconds": 3.0, "watts": 5.0, "joules": 15.0}, **window,
                        "workloads": {"sweep": window}}
    return {"name": name, "error": None, "memory": None, "energy": energy_entry, "results": {"sweep": [lv]}}


def test_report_carries_energy_and_prints_j_per_token_next_to_tok_s():
    rep = report.build_report([_system("tandem[performance]", 500.0, 0.2), _system("tandem[saver]", 80.0, 0.5),
                               _system("mlx_lm", 400.0, 0.25)], {}, "tandem bench")
    json.dumps(rep)
    text = report.render(rep)
    header = next(line for line in text.splitlines() if line.startswith("system") and "clients" in line)
    assert header.split()[6:8] == ["tok/s", "J/tok"]
    saver = next(line for line in text.splitlines() if line.startswith("tandem[saver]") and " 80.0 " in line)
    assert "0.5000" in saver
    assert "Energy, machine-wide (rapl:package-0)" in text and "J/tok above idle" in text
    ratios = {(r["tandem"], r["peer"]): r for r in rep["ratios"]}
    assert ratios[("tandem[saver]", "mlx_lm")]["joules_per_output_token"] == pytest.approx(2.0)
    assert "joules per output token" in text


def test_report_without_a_meter_says_none_and_why():
    rep = report.build_report([_system("tandem", 500.0, None)],
                              {"energy": {"unavailable": {"rapl": "no /sys/class/powercap"}}}, "tandem bench")
    text = report.render(rep)
    assert "J/tok" not in text
    assert "Energy: none on this machine (rapl: no /sys/class/powercap)" in text


# ------------------------------------------------------------------ power policies

def test_tandem_runs_once_per_power_policy(tmp_path):
    rows = systems.expand_rows(("tandem", "mlx_lm", "tandem-colocate"), ("performance", "saver"))
    assert rows == ("tandem[performance]", "tandem[saver]", "mlx_lm", "tandem-colocate[performance]",
                    "tandem-colocate[saver]")
    assert systems.expand_rows(("tandem", "mlx_lm"), ()) == ("tandem", "mlx_lm")
    opts = systems.Options(model_spec=None, model_dir=tmp_path, peer_model_dir=tmp_path, run_dir=tmp_path,
                           tandem_args=["--power-policy", "auto", "--max-batch", "8"])
    spec = systems.server_spec("tandem-colocate[saver]", 18100, opts)
    assert spec.name == "tandem-colocate[saver]" and "--colocate" in spec.argv
    assert spec.argv[-2:] == ["--power-policy", "saver"]  # after --tandem-args: the row's name is what ran
    assert str(tmp_path / "tandem-colocate-saver-kv") in spec.argv
    assert "--power-policy" not in systems.server_spec("tandem", 18100, systems.Options(
        model_spec=None, model_dir=tmp_path, peer_model_dir=tmp_path, run_dir=tmp_path)).argv
    with pytest.raises(ValueError):
        systems.server_spec("tandem[turbo]", 18100, opts)
    assert report.is_tandem("tandem[saver]")


def test_bench_flag_starts_a_row_per_policy(tmp_path, monkeypatch, capsys):
    rc, started, config = run_bench_cmd(tmp_path, monkeypatch, "--systems", "tandem,mlx_lm",
                                        "--tandem-power-policies", "performance,saver")
    assert rc == 0
    assert started == ["tandem[performance]", "tandem[saver]", "mlx_lm"]
    assert config["tandem_power_policies"] == ["performance", "saver"]
    assert config["energy"]["unavailable"] == {"all": "--energy off"}
    p = bench_cmd.argparse.ArgumentParser()
    bench_cmd.add_arguments(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--tandem-power-policies", "performance,turbo"])
