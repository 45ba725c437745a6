"""`tandem bench` run with its servers replaced by a recorder (what its flags start)."""

from __future__ import annotations

import json

from benchmarks.bench import bench_cmd


def run_bench_cmd(tmp_path, monkeypatch, *flags) -> tuple[int, list[str], dict]:
    """`tandem bench FLAGS` with no server started: (exit code, the rows it
    would have started, the JSON report's config)."""
    started = []

    def fake_started(name, opts, port, cfg, workloads_, args, recorder=None):
        started.append(name)
        return {"name": name, "error": None, "memory": None, "energy": None, "results": {}}

    monkeypatch.setattr(bench_cmd, "_options", lambda *a, **k: None)
    monkeypatch.setattr(bench_cmd, "_bench_started", fake_started)
    p = bench_cmd.argparse.ArgumentParser()
    bench_cmd.add_arguments(p)
    out = tmp_path / "r.json"
    out.unlink(missing_ok=True)
    rc = bench_cmd.run(p.parse_args(["--energy", "off", "--log-dir", str(tmp_path), "--json", str(out), *flags]))
    return rc, started, json.loads(out.read_text())["config"] if out.exists() else {}
