"""`tandem service ACTION` through the one seam (deploy/service/manager.py):
the launchctl / systemctl / journalctl calls each subcommand makes, asserted.

launchctl cannot run here (Linux) and `systemctl --user` cannot either
(systemd is not PID 1 in this container), so the runner is a double that
records each argv and answers as the tool would; the `launchctl print` text
below follows its documented layout (not recorded on a Mac). The real tools
are called only to check that their absence or failure reads clearly."""

from __future__ import annotations

import json
import os
import plistlib
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deploy import cli
from deploy.service import service_cmd
from deploy.service.manager import Manager, ManagerError

UID = os.getuid()
LAUNCHD_PRINT = """gui/{uid}/dev.tandem.server = {{
\tactive count = 1
\tpath = /Users/u/Library/LaunchAgents/dev.tandem.server.plist
\tstate = running

\tprogram = /Users/u/.venv/bin/tandem
\targuments = {{
\t\t/Users/u/.venv/bin/tandem
\t\tserve
\t}}

\truns = 3
\tpid = 4242
\tlast exit code = 1
\tspawn type = interactive (4)
}}
"""


class FakeRunner:
    """subprocess.run's stand-in: records argv and the keywords, answers from
    `replies` (the first word after the tool and `--user`) or with success."""

    def __init__(self, replies: dict | None = None):
        self.calls, self.kwargs, self.replies = [], [], replies or {}

    def __call__(self, argv, **kwargs):
        self.calls.append(list(argv))
        self.kwargs.append(kwargs)
        verb = next((a for a in argv[1:] if a != "--user"), "")
        code, out, err = self.replies.get(verb, (0, "", ""))
        return subprocess.CompletedProcess(argv, code, out, err)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    return tmp_path


def run_cli(*argv: str, runner: FakeRunner) -> int:
    args, extra = cli.build_parser().parse_known_args(["service", *argv])
    args.extra = extra
    return service_cmd.run(args, manager=Manager(runner=runner, which=lambda tool: f"/usr/bin/{tool}",
                                                 echo=lambda s: None))


def _plist(home):
    return home / "Library" / "LaunchAgents" / "dev.tandem.server.plist"


def test_launchd_install_writes_the_plist_then_replaces_a_loaded_job(home):
    runner = FakeRunner()  # print answers 0: a job of that label is loaded already
    assert run_cli("install", "--launchd", "--port", "8130", runner=runner) == 0
    target = f"gui/{UID}/dev.tandem.server"
    assert runner.calls == [["launchctl", "print", target], ["launchctl", "bootout", target],
                            ["launchctl", "enable", target], ["launchctl", "bootstrap", f"gui/{UID}", str(_plist(home))]]
    assert all(kw["timeout"] > 0 for kw in runner.kwargs)
    with open(_plist(home), "rb") as f:
        job = plistlib.load(f)
    assert job["ProgramArguments"][-3:] == ["serve", "--port", "8130"]
    assert (home / "Library" / "Logs" / "Tandem").is_dir()


def test_launchd_install_of_a_job_not_loaded_only_bootstraps(home):
    runner = FakeRunner({"print": (113, "", "Could not find service")})
    assert run_cli("install", "--launchd", runner=runner) == 0
    assert [c[1] for c in runner.calls] == ["print", "enable", "bootstrap"]


@pytest.mark.parametrize("action, expected", [
    ("stop", [["bootout", "gui/{uid}/dev.tandem.server"]]),
    ("restart", [["kickstart", "-k", "gui/{uid}/dev.tandem.server"]]),
    ("start", [["print", "gui/{uid}/dev.tandem.server"], ["kickstart", "gui/{uid}/dev.tandem.server"]]),
    ("uninstall", [["bootout", "gui/{uid}/dev.tandem.server"]]),
])
def test_launchd_subcommands(home, action, expected):
    run_cli("install", "--launchd", runner=FakeRunner())
    runner = FakeRunner()
    assert run_cli(action, "--launchd", runner=runner) == 0
    assert runner.calls == [["launchctl", *(a.format(uid=UID) for a in call)] for call in expected]
    assert _plist(home).exists() == (action != "uninstall")


def test_launchd_start_of_an_unloaded_job_bootstraps_it(home):
    run_cli("install", "--launchd", runner=FakeRunner())
    runner = FakeRunner({"print": (113, "", "Could not find service")})
    assert run_cli("start", "--launchd", runner=runner) == 0
    assert runner.calls[-1] == ["launchctl", "bootstrap", f"gui/{UID}", str(_plist(home))]


def test_start_stop_restart_of_nothing_installed_say_so_and_call_nothing(home, capsys):
    runner = FakeRunner()
    for action in ("start", "stop", "restart"):
        assert run_cli(action, "--launchd", runner=runner) == 1
    assert runner.calls == []
    assert "tandem service install` first" in capsys.readouterr().err


@pytest.mark.parametrize("activation, units", [(False, ["tandem.service"]), (True, ["tandem.socket", "tandem.service"])])
def test_systemd_subcommands(home, activation, units):
    runner = FakeRunner()
    flags = ["--socket-activation"] if activation else []
    assert run_cli("install", "--systemd", *flags, runner=runner) == 0
    assert runner.calls == [["systemctl", "--user", "daemon-reload"], ["systemctl", "--user", "enable", *units],
                            ["systemctl", "--user", "restart", *units]]
    unit_dir = home / ".config" / "systemd" / "user"
    assert sorted(p.name for p in unit_dir.iterdir()) == sorted(units)
    for action, expected in (("start", ["start", *units]), ("stop", ["stop", *units]),
                             ("restart", ["restart", "tandem.service"])):
        runner = FakeRunner()
        assert run_cli(action, "--systemd", runner=runner) == 0
        assert runner.calls == [["systemctl", "--user", *expected]]
    runner = FakeRunner()
    assert run_cli("uninstall", "--systemd", runner=runner) == 0
    assert runner.calls == [["systemctl", "--user", "disable", "--now", *units], ["systemctl", "--user", "daemon-reload"]]
    assert list(unit_dir.iterdir()) == []


def test_systemd_logs_go_through_journalctl(home, capsys):
    runner = FakeRunner({"-u": (0, "line one\nline two\n", "")})
    assert run_cli("logs", "--systemd", "-n", "20", runner=runner) == 0
    assert runner.calls == [["journalctl", "--user", "-u", "tandem.service", "-n", "20", "--no-pager"]]
    assert capsys.readouterr().out == "line one\nline two\n"
    runner = FakeRunner()
    assert run_cli("logs", "--systemd", "-f", runner=runner) == 0
    assert runner.calls == [["journalctl", "--user", "-u", "tandem.service", "-n", "100", "--no-pager", "-f"]]
    assert "timeout" not in runner.kwargs[0]  # follows until Ctrl-C


def test_launchd_logs_are_the_log_files_last_lines(home, capsys):
    log = home / "Library" / "Logs" / "Tandem" / "dev.tandem.server.log"
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"line {i}\n" for i in range(500)))
    runner = FakeRunner()
    assert run_cli("logs", "--launchd", "-n", "3", runner=runner) == 0
    assert capsys.readouterr().out == "line 497\nline 498\nline 499\n"
    assert runner.calls == []


def test_a_user_manager_that_does_not_answer_is_said_clearly(home, capsys):
    runner = FakeRunner({"daemon-reload": (1, "", "Failed to connect to bus: No medium found")})
    assert run_cli("install", "--systemd", runner=runner) == 1
    err = capsys.readouterr().err
    assert "systemctl --user daemon-reload failed (exit 1)" in err and "No systemd user manager answers here" in err


@pytest.mark.skipif(not shutil.which("systemctl") or os.path.isdir("/run/systemd/system"),
                    reason="needs systemctl on a system not run by systemd (as this container is)")
def test_the_real_systemctl_without_a_user_manager_fails_clearly():
    with pytest.raises(ManagerError, match="No systemd user manager answers here"):
        Manager().run(["systemctl", "--user", "show", "tandem-test-none.service"], timeout=20)


@pytest.mark.skipif(sys.platform == "darwin", reason="launchctl exists on macOS")
def test_launchctl_off_macos_says_it_needs_macos_before_anything_is_written(home, capsys):
    with pytest.raises(ManagerError, match="launchctl not found: launchd services need macOS"):
        Manager().run(["launchctl", "print", "gui/501/x"])
    args, extra = cli.build_parser().parse_known_args(["service", "install", "--launchd"])
    args.extra = extra
    assert service_cmd.run(args) == 1
    assert "launchctl not found" in capsys.readouterr().err
    assert list(home.iterdir()) == []


def test_a_hung_tool_times_out():
    def hung(argv, **kwargs):
        raise subprocess.TimeoutExpired(argv, kwargs["timeout"])

    with pytest.raises(ManagerError, match="did not finish in 7s"):
        Manager(runner=hung).run(["launchctl", "print", "x"], timeout=7)


class _Health(BaseHTTPRequestHandler):
    body = {}

    def do_GET(self):
        data = json.dumps(self.body).encode()
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_status_joins_the_managers_view_and_health(home, capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    _Health.body = {"status": "ok", "model": "SmolLM2", "uptime_s": 3725.0, "expected": ["prefill-0", "decode-0"],
                    "workers": [{"id": "prefill-0", "state": "ready", "pid": 11}, {"id": "decode-0", "state": "ready",
                                                                                    "pid": 12}],
                    "cache_service": {"state": "ready"}, "requests_in_flight": 2,
                    "power": {"source": "battery", "percent": 41, "low_power_mode": True, "thermal": "fair",
                              "policy": "saver", "reason": "Low Power Mode"}}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        run_cli("install", "--launchd", "--port", str(server.server_address[1]), runner=FakeRunner())
        runner = FakeRunner({"print": (0, LAUNCHD_PRINT.format(uid=UID), "")})
        assert run_cli("status", "--launchd", runner=runner) == 0
    finally:
        server.shutdown()
        server.server_close()
    out = capsys.readouterr().out
    assert runner.calls == [["launchctl", "print", f"gui/{UID}/dev.tandem.server"]]
    assert "manager   state running, runs 3, pid 4242, last exit code 1" in out
    assert f"server    http://127.0.0.1:{server.server_address[1]}: ready" in out
    assert "model     SmolLM2" in out and "uptime    1h 02m 05s" in out
    assert "workers   prefill-0 ready (pid 11), decode-0 ready (pid 12) of 2 expected" in out
    assert "power     battery 41%, Low Power Mode, thermal fair, policy saver (Low Power Mode)" in out


def test_status_says_clearly_when_nothing_answers(home, capsys):
    from tests.support.server import free_port

    port = free_port()
    run_cli("install", "--systemd", "--port", str(port), runner=FakeRunner())
    runner = FakeRunner({"show": (0, "LoadState=loaded\nActiveState=failed\nSubState=failed\nMainPID=0\n"
                                     "NRestarts=4\nResult=exit-code\nJunk=1\n", "")})
    assert run_cli("status", "--systemd", runner=runner) == service_cmd.EXIT_NOT_RUNNING
    out = capsys.readouterr().out
    assert "ActiveState failed" in out and "NRestarts 4" in out and "Junk" not in out
    assert f"server    http://127.0.0.1:{port}: does not answer" in out


def test_following_a_log_file_prints_what_is_appended_and_survives_truncation(tmp_path):
    import io

    from deploy.service import log_file

    log = tmp_path / "server.log"
    log.write_text("old line\n")
    out = io.StringIO()
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write("first\nsecond\n")
    follower = threading.Thread(target=log_file.follow,
                                args=(str(log), start, out, 0.01, lambda: "third" in out.getvalue()))
    follower.start()
    deadline = time.monotonic() + 10
    while "second" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    log.write_text("third\n")  # truncated and rewritten, as a rotated log
    follower.join(timeout=10)
    assert not follower.is_alive()
    assert out.getvalue() == "first\nsecond\nthird\n"
