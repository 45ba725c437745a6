"""What `tandem service install` writes: the LaunchAgent plist (parsed back
with plistlib, key by key), the systemd user unit and socket unit (checked by
systemd-analyze where it exists), the serve flags checked and made absolute,
and `--dry-run --launchd` printing a valid plist on any platform (the real CLI,
in a subprocess)."""

from __future__ import annotations

import math
import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.service.listen_socket import LAUNCHD_SOCKET_ENV
from deploy.service.launchd import SOCKET_NAME, THROTTLE_S, plist, plist_bytes
from deploy.service.spec import SpecError, build_spec, serve_address, tandem_command
from deploy.service.systemd import quote, service_unit, socket_unit, unquote_exec
from deploy.supervisor import longest_stop_s

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    return tmp_path


def test_the_plist_key_by_key(home, tmp_path):
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    spec = build_spec("launchd", None, ["--model", "models/m", "--port", "8123", "--drain-timeout", "20"],
                      extra_env=["HF_HUB_OFFLINE=1"], cwd=str(tmp_path), home=str(home),
                      environ={"HF_HOME": "/data/hf", "SECRET": "not passed"})
    log = str(home / "Library" / "Logs" / "Tandem" / "dev.tandem.server.log")
    job = plistlib.loads(plist_bytes(spec, log))
    assert job == plist(spec, log)  # nothing lost in the XML
    assert job["Label"] == "dev.tandem.server"
    assert job["ProgramArguments"] == [*tandem_command(), "serve", "--model", str(model), "--port", "8123",
                                       "--drain-timeout", "20"]
    assert all(os.path.isabs(p) for p in tandem_command()[:1]) and os.access(job["ProgramArguments"][0], os.X_OK)
    assert job["RunAtLoad"] is True
    assert job["KeepAlive"] == {"SuccessfulExit": False}
    assert job["ThrottleInterval"] == THROTTLE_S
    assert job["ExitTimeOut"] == math.ceil(longest_stop_s(20.0)) + 15 and job["ExitTimeOut"] > 20 + 14
    assert job["ProcessType"] == "Interactive"
    assert job["StandardOutPath"] == job["StandardErrorPath"] == log
    assert job["WorkingDirectory"] == str(home)
    env = job["EnvironmentVariables"]
    assert env["HOME"] == str(home) and env["PYTHONUNBUFFERED"] == "1"
    assert env["PATH"].split(":")[0] == os.path.dirname(job["ProgramArguments"][0])
    assert env["HF_HOME"] == "/data/hf" and env["HF_HUB_OFFLINE"] == "1" and "SECRET" not in env
    assert "Sockets" not in job and LAUNCHD_SOCKET_ENV not in env


@pytest.mark.parametrize("host, family, node", [("127.0.0.1", "IPv4", "127.0.0.1"), ("0.0.0.0", "IPv4", None),
                                                ("::1", "IPv6", "::1")])
def test_socket_activation_puts_the_port_in_sockets_and_names_it_to_tandem(home, host, family, node):
    spec = build_spec("launchd", "my.label", ["--host", host, "--port", "8124"], socket_activation=True, home=str(home))
    job = plistlib.loads(plist_bytes(spec, "/tmp/x.log"))
    listener = job["Sockets"][SOCKET_NAME]
    assert listener["SockServiceName"] == "8124" and listener["SockType"] == "stream"
    assert listener["SockFamily"] == family and listener.get("SockNodeName") == node
    assert job["EnvironmentVariables"][LAUNCHD_SOCKET_ENV] == SOCKET_NAME


def test_serve_flags_are_checked_at_install_not_at_3_am(home):
    with pytest.raises(SystemExit) as exc:
        build_spec("launchd", None, ["--prot", "8001"], home=str(home))
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        build_spec("systemd", None, ["--max-batch", "0"], home=str(home))
    with pytest.raises(SpecError, match="no such file"):
        build_spec("launchd", None, ["--model", "./not-here"], cwd=str(home), home=str(home))
    with pytest.raises(SpecError, match="letters, digits"):
        build_spec("launchd", "../evil", [], home=str(home))
    with pytest.raises(SpecError, match="NAME=VALUE"):
        build_spec("launchd", None, [], extra_env=["no-equals"], home=str(home))


def test_paths_become_absolute_and_repo_ids_stay(home, tmp_path):
    (tmp_path / "keys").write_text("k\n")
    spec = build_spec("systemd", None, ["--model", "org/some-model", "--api-key-file=keys", "--cache-dir", "~/kv"],
                      cwd=str(tmp_path), home=str(home))
    flags = spec.program[spec.program.index("serve") + 1:]
    assert flags == ["--model", "org/some-model", f"--api-key-file={tmp_path / 'keys'}", "--cache-dir",
                     os.path.expanduser("~/kv")]


def test_the_address_is_read_back_from_an_installed_argv_even_garbage():
    assert serve_address(["/x/tandem", "serve", "--host", "0.0.0.0", "--port=9001"]) == ("0.0.0.0", 9001)
    assert serve_address(["/x/tandem", "serve", "--port", "nope"]) == ("127.0.0.1", 8000)
    assert serve_address("not a list") == ("127.0.0.1", 8000)


@pytest.mark.parametrize("word", ["plain/path", "with space", "50%", "$HOME", 'quote"d', "back\\slash", ""])
def test_execstart_words_survive_systemd_quoting(word):
    assert unquote_exec(quote(word)) == [word]


def test_the_unit_says_what_a_supervisor_needs(home):
    spec = build_spec("systemd", None, ["--drain-timeout", "30", "--api-key-file", str(home)], home=str(home),
                      extra_env=["NOTE=50% of $HOME"])
    unit = service_unit(spec)
    lines = unit.splitlines()
    for line in ("Restart=on-failure", "KillSignal=SIGTERM", "KillMode=mixed", "Type=simple",
                 f"TimeoutStopSec={math.ceil(longest_stop_s(30.0)) + 15}", f"WorkingDirectory={home}",
                 "WantedBy=default.target", 'Environment="NOTE=50%% of $HOME"'):
        assert line in lines
    exec_line = next(ln for ln in lines if ln.startswith("ExecStart="))
    assert unquote_exec(exec_line.removeprefix("ExecStart=")) == spec.program
    assert not any(ln.startswith(("Requires=", "After=")) for ln in lines)


def test_socket_activation_adds_a_socket_unit_the_service_requires(home):
    spec = build_spec("systemd", "tandem", ["--host", "::1", "--port", "8125"], socket_activation=True, home=str(home))
    assert {"Requires=tandem.socket", "After=tandem.socket"} <= set(service_unit(spec).splitlines())
    assert "ListenStream=[::1]:8125" in socket_unit(spec).splitlines()


ANALYZE = shutil.which("systemd-analyze")


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed here")
@pytest.mark.parametrize("activation", [False, True])
def test_systemd_analyze_verifies_the_units(home, tmp_path, activation):
    """Verified as system units: `--user` needs a running user manager, which
    a container has not; the checks of the unit's contents are the same.
    systemd-analyze exits 0 even on bad lines, so its stderr must be empty."""
    spec = build_spec("systemd", "tandem", ["--port", "8126"], socket_activation=activation, home=str(home),
                      extra_env=["ODD=a \"b\" 50% $c"])
    units = tmp_path / "units"
    units.mkdir()
    (units / "tandem.service").write_text(service_unit(spec))
    paths = [str(units / "tandem.service")]
    if activation:
        (units / "tandem.socket").write_text(socket_unit(spec))
        paths.append(str(units / "tandem.socket"))
    done = subprocess.run([ANALYZE, "verify", *paths], capture_output=True, text=True, timeout=60, cwd=units)
    assert (done.returncode, done.stderr) == (0, "")
    # The check can fail: a bad line is reported.
    (units / "tandem.service").write_text(service_unit(spec).replace("KillMode=mixed", "KillMode=gentle"))
    bad = subprocess.run([ANALYZE, "verify", *paths], capture_output=True, text=True, timeout=60, cwd=units)
    assert "kill mode" in bad.stderr


def test_dry_run_launchd_prints_a_valid_plist_on_any_platform(tmp_path):
    """The real CLI in a subprocess: the plist alone on stdout, what would be
    written and run on stderr, nothing written."""
    env = {**os.environ, "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "service", "install", "--dry-run", "--launchd",
                           "--port", "8127", "--", "--drain-timeout", "5"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr
    job = plistlib.loads(done.stdout.encode())
    assert job["Label"] == "dev.tandem.server"
    assert job["ProgramArguments"][-5:] == ["serve", "--port", "8127", "--drain-timeout", "5"]
    uid = os.getuid()
    assert f"would write {tmp_path}/Library/LaunchAgents/dev.tandem.server.plist" in done.stderr
    assert f"would run: launchctl bootstrap gui/{uid} {tmp_path}/Library/LaunchAgents/dev.tandem.server.plist" \
        in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_draft_model_and_worker_keys_paths_become_absolute_too(home, tmp_path):
    """The service runs from another folder than the installing shell: every
    flag naming a file or folder is made absolute (a draft model like the
    model, a repo id left as it is; the remote workers' keys folder)."""
    (tmp_path / "draft").mkdir()
    (tmp_path / "keys").mkdir()
    spec = build_spec("systemd", None, ["--draft-model", "draft", "--worker-listen", "tcp://0.0.0.0:7100",
                                        "--worker-keys=keys", "--memory-pressure-file", "p"],
                      cwd=str(tmp_path), home=str(home))
    flags = spec.program[spec.program.index("serve") + 1:]
    assert flags == ["--draft-model", str(tmp_path / "draft"), "--worker-listen", "tcp://0.0.0.0:7100",
                     f"--worker-keys={tmp_path / 'keys'}", "--memory-pressure-file", str(tmp_path / "p")]
    spec = build_spec("systemd", None, ["--draft-model", "org/small-draft"], cwd=str(tmp_path), home=str(home))
    assert spec.program[-2:] == ["--draft-model", "org/small-draft"]
    with pytest.raises(SpecError, match="--draft-model ./nope: no such file or folder"):
        build_spec("systemd", None, ["--draft-model", "./nope"], cwd=str(tmp_path), home=str(home))
