"""macOS: `tandem serve` as a user LaunchAgent.

The plist is a dict written with plistlib to ~/Library/LaunchAgents/LABEL.plist
and managed with launchctl's domain commands (bootstrap, bootout, kickstart,
print on gui/$UID). KeepAlive restarts the server only when it exits
non-zero (it gives up: deploy/supervisor.py), never after a requested stop.
"""

from __future__ import annotations

import os
import plistlib
import re
from pathlib import Path

from deploy.service.listen_socket import LAUNCHD_SOCKET_ENV
from deploy.service.manager import Manager
from deploy.service.spec import ServiceSpec

THROTTLE_S = 10  # launchd's minimum between two starts of a job that keeps failing
SOCKET_NAME = "Listeners"  # the plist's Sockets entry, handed to launch_activate_socket
CALL_MARGIN_S = 15  # bootout and kickstart -k wait for the job to stop


def plist_path(label: str, home: str) -> Path:
    return Path(home) / "Library" / "LaunchAgents" / f"{label}.plist"


def log_path(label: str, home: str) -> Path:
    return Path(home) / "Library" / "Logs" / "Tandem" / f"{label}.log"


def plist(spec: ServiceSpec, log: str) -> dict:
    """The LaunchAgent for a service spec, as the dict plistlib writes; stdout
    and stderr go to `log`."""
    env = dict(spec.environment)
    job = {
        "Label": spec.label,
        "ProgramArguments": list(spec.program),
        "WorkingDirectory": spec.working_dir,
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},  # restart on failure, not after a requested stop
        "ThrottleInterval": THROTTLE_S,
        "ExitTimeOut": spec.stop_timeout_s,  # past the supervisor's drain and kill graces
        "ProcessType": "Interactive",  # an unset type gets CPU and I/O throttled
        "StandardOutPath": log,
        "StandardErrorPath": log,
    }
    if spec.socket_activation:
        listener = {"SockServiceName": str(spec.port), "SockType": "stream",
                    "SockFamily": "IPv6" if ":" in spec.host else "IPv4"}
        if spec.host not in ("0.0.0.0", "::", ""):
            listener["SockNodeName"] = spec.host
        job["Sockets"] = {SOCKET_NAME: listener}
        env[LAUNCHD_SOCKET_ENV] = SOCKET_NAME
    job["EnvironmentVariables"] = env
    return job


def plist_bytes(spec: ServiceSpec, log: str) -> bytes:
    return plistlib.dumps(plist(spec, log), fmt=plistlib.FMT_XML, sort_keys=False)


def parse_print(text: str) -> dict:
    """The job's own lines of `launchctl print gui/UID/LABEL` (one tab deep):
    state, pid, runs, last exit code."""
    found = dict(re.findall(r"^\t(state|pid|runs|last exit code|last exit reason) = (.+)$", text, re.M))
    return {k.replace(" ", "_"): v.strip() for k, v in found.items()}


class LaunchdService:
    kind = "launchd"

    def __init__(self, label: str, manager: Manager, home: str, uid: int | None = None):
        self.label, self.manager, self.home = label, manager, home
        self.domain = f"gui/{os.getuid() if uid is None else uid}"
        self.target = f"{self.domain}/{label}"
        self.path = plist_path(label, home)
        self.log = log_path(label, home)

    def files(self, spec: ServiceSpec) -> dict:
        return {self.path: plist_bytes(spec, str(self.log))}

    def folders(self) -> list:
        return [self.log.parent]  # launchd opens the log file but makes no folder

    def installed(self) -> list:
        return [self.path] if self.path.exists() else []

    def installed_program(self) -> list:
        try:
            with open(self.path, "rb") as f:
                program = plistlib.load(f).get("ProgramArguments")
        except (OSError, plistlib.InvalidFileException, ValueError, AttributeError):
            return []
        return program if isinstance(program, list) else []

    def _loaded(self) -> bool:
        return self.manager.run(["launchctl", "print", self.target], check=False).ok

    def install(self, spec: ServiceSpec, start: bool = True) -> None:
        """After the plist is written: load it (replacing a loaded one), which
        starts it (RunAtLoad). `start=False` writes it for the next login."""
        if self._loaded():
            self.manager.run(["launchctl", "bootout", self.target], timeout=spec.stop_timeout_s + CALL_MARGIN_S,
                             check=False)
        self.manager.run(["launchctl", "enable", self.target])
        if start:
            self.manager.run(["launchctl", "bootstrap", self.domain, str(self.path)])

    def uninstall(self) -> None:
        self.manager.run(["launchctl", "bootout", self.target], timeout=self._stop_timeout(), check=False)

    def start(self) -> None:
        if not self._loaded():
            self.manager.run(["launchctl", "bootstrap", self.domain, str(self.path)])
            return
        self.manager.run(["launchctl", "kickstart", self.target])

    def stop(self) -> None:
        """Unloads the job (SIGTERM: the supervisor drains, exits 0). Unloaded,
        not just killed: a job with Sockets would be started again by the next
        connection. It loads again at the next login, or with `start`."""
        self.manager.run(["launchctl", "bootout", self.target], timeout=self._stop_timeout())

    def restart(self) -> None:
        self.manager.run(["launchctl", "kickstart", "-k", self.target], timeout=self._stop_timeout())

    def status(self) -> dict:
        result = self.manager.run(["launchctl", "print", self.target], check=False)
        if not result.ok:
            return {"state": "not loaded", "detail": (result.stderr or result.stdout).strip()[:200]}
        return parse_print(result.stdout)

    def log_command(self, lines: int, follow: bool) -> list | None:
        return None  # a file: read by service_cmd

    def _stop_timeout(self) -> float:
        try:
            with open(self.path, "rb") as f:
                exit_timeout = float(plistlib.load(f).get("ExitTimeOut", 60))
        except (OSError, plistlib.InvalidFileException, ValueError, TypeError, AttributeError):
            exit_timeout = 60.0
        return exit_timeout + CALL_MARGIN_S
