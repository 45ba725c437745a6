"""Linux: `tandem serve` as a systemd user unit (~/.config/systemd/user/NAME.service),
with an optional NAME.socket for socket activation, managed with
`systemctl --user` and read with `journalctl --user -u`.

KillMode=mixed: SIGTERM reaches only the supervisor, which drains the router
and stops its own children in order (all at once, as control-group would,
would stop the workers under the router's in-flight streams); SIGKILL for
whatever is left only after TimeoutStopSec.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from deploy.service.manager import Manager
from deploy.service.spec import ServiceSpec

RESTART_SEC = 5
START_LIMIT_BURST = 10  # starts within START_LIMIT_INTERVAL_S before systemd gives up
START_LIMIT_INTERVAL_S = 300
CALL_MARGIN_S = 15
SAFE = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")
SHOW_PROPERTIES = ("LoadState", "ActiveState", "SubState", "MainPID", "NRestarts", "ExecMainStatus", "Result")


def unit_dir(home: str, environ=os.environ) -> Path:
    config = environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    return Path(config) / "systemd" / "user"


def quote(arg: str) -> str:
    """One ExecStart= word: systemd expands % specifiers and $ variables, so
    both are doubled; words with other characters are double-quoted."""
    if "\n" in arg or "\r" in arg:
        raise ValueError(f"a newline cannot be in a unit's command line: {arg!r}")
    arg = arg.replace("%", "%%").replace("$", "$$")
    if SAFE.fullmatch(arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def unquote_exec(line: str) -> list:
    """The words of an ExecStart= value written by `quote`."""
    try:
        words = shlex.split(line)
    except ValueError:
        return []
    return [w.replace("%%", "%").replace("$$", "$") for w in words]


def _environment_line(key: str, value: str) -> str:
    if "\n" in value:
        raise ValueError(f"a newline cannot be in a unit's environment: {key}")
    pair = f"{key}={value}".replace("%", "%%").replace("\\", "\\\\").replace('"', '\\"')
    return f'Environment="{pair}"'


def service_unit(spec: ServiceSpec) -> str:
    socket_lines = [f"Requires={spec.label}.socket", f"After={spec.label}.socket"] if spec.socket_activation else []
    lines = [
        "# Written by `tandem service install`; install again to change it.",
        "[Unit]",
        "Description=Tandem LLM server (tandem serve)",
        f"StartLimitIntervalSec={START_LIMIT_INTERVAL_S}",
        f"StartLimitBurst={START_LIMIT_BURST}",
        *socket_lines,
        "",
        "[Service]",
        "Type=simple",
        "ExecStart=" + " ".join(quote(a) for a in spec.program),
        "WorkingDirectory=" + spec.working_dir.replace("%", "%%"),  # the rest of the line: no quotes
        *(_environment_line(k, v) for k, v in spec.environment.items()),
        "Restart=on-failure",  # tandem serve exits non-zero only when it gives up
        f"RestartSec={RESTART_SEC}",
        "KillSignal=SIGTERM",
        "KillMode=mixed",  # the supervisor stops its own children, in order
        f"TimeoutStopSec={spec.stop_timeout_s}",  # past the drain and the supervisor's kill graces
        f"SyslogIdentifier={spec.label}",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ]
    return "\n".join(lines)


def socket_unit(spec: ServiceSpec) -> str:
    """The port held by systemd across restarts; handed over as LISTEN_FDS."""
    host = spec.host if spec.host not in ("", "0.0.0.0") else "0.0.0.0"
    address = f"[{host}]:{spec.port}" if ":" in host else f"{host}:{spec.port}"
    return "\n".join([
        "# Written by `tandem service install --socket-activation`.",
        "[Unit]",
        f"Description=Tandem HTTP port ({address})",
        "",
        "[Socket]",
        f"ListenStream={address}",
        "Backlog=2048",
        "",
        "[Install]",
        "WantedBy=sockets.target",
        "",
    ])


def parse_show(text: str) -> dict:
    """`systemctl --user show -p ...` output (KEY=VALUE lines) as a dict."""
    return {k: v for k, _, v in (line.partition("=") for line in text.splitlines()) if k in SHOW_PROPERTIES}


class SystemdService:
    kind = "systemd"

    def __init__(self, label: str, manager: Manager, home: str, environ=os.environ):
        self.label, self.manager, self.home = label, manager, home
        self.dir = unit_dir(home, environ)
        self.service = f"{label}.service"
        self.socket = f"{label}.socket"
        self.path = self.dir / self.service
        self.socket_path = self.dir / self.socket

    def files(self, spec: ServiceSpec) -> dict:
        out = {self.path: service_unit(spec).encode()}
        if spec.socket_activation:
            out[self.socket_path] = socket_unit(spec).encode()
        return out

    def folders(self) -> list:
        return []

    def installed(self) -> list:
        return [p for p in (self.path, self.socket_path) if p.exists()]

    def installed_program(self) -> list:
        try:
            text = self.path.read_text(errors="replace")
        except OSError:
            return []
        line = next((ln for ln in text.splitlines() if ln.startswith("ExecStart=")), "")
        return unquote_exec(line.removeprefix("ExecStart="))

    def _units(self) -> list:
        return [self.socket, self.service] if self.socket_path.exists() else [self.service]

    def _systemctl(self, *args: str, timeout: float | None = None, check: bool = True):
        return self.manager.run(["systemctl", "--user", *args], timeout=timeout or self._stop_timeout(), check=check)

    def install(self, spec: ServiceSpec, start: bool = True) -> None:
        units = [self.socket, self.service] if spec.socket_activation else [self.service]
        self._systemctl("daemon-reload")
        self._systemctl("enable", *units)
        if start:  # restart: a reinstall's new flags take effect now
            self._systemctl("restart", *units, timeout=spec.stop_timeout_s + CALL_MARGIN_S)

    def uninstall(self) -> None:
        self._systemctl("disable", "--now", *self._units(), check=False)

    def after_removal(self) -> None:
        self._systemctl("daemon-reload", check=False)

    def start(self) -> None:
        self._systemctl("start", *self._units())

    def stop(self) -> None:
        # With a .socket unit, the socket too: else the next connection starts it again.
        self._systemctl("stop", *self._units())

    def restart(self) -> None:
        self._systemctl("restart", self.service)  # the .socket keeps the port meanwhile

    def status(self) -> dict:
        result = self._systemctl("show", self.service, "--property=" + ",".join(SHOW_PROPERTIES), timeout=10.0)
        return parse_show(result.stdout)

    def log_command(self, lines: int, follow: bool) -> list:
        return ["journalctl", "--user", "-u", self.service, "-n", str(lines), "--no-pager",
                *(["-f"] if follow else [])]

    def _stop_timeout(self) -> float:
        try:
            found = re.search(r"^TimeoutStopSec=(\d+)$", self.path.read_text(errors="replace"), re.M)
        except OSError:
            found = None
        return (int(found.group(1)) if found else 90) + CALL_MARGIN_S
