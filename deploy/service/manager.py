"""The one seam through which every launchctl, systemctl and journalctl call
goes: each with a timeout, its failure turned into a message that says what
to do. Tests replace `runner` and assert the calls; `dry_run` prints them."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from dataclasses import dataclass, field

TIMEOUT_S = 30.0  # launchctl bootout waits for the job's ExitTimeOut: callers pass more
# What systemctl/journalctl say when no user service manager can be reached
# (systemd not PID 1, no user session bus: containers, CI, ssh without linger).
NO_USER_MANAGER = ("Failed to connect to bus", "System has not been booted with systemd",
                   "Failed to connect to user scope bus", "$DBUS_SESSION_BUS_ADDRESS")


class ManagerError(Exception):
    """A service-manager call failed; the message says which and why."""


@dataclass
class Result:
    argv: list
    returncode: int
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


@dataclass
class Manager:
    runner: object = subprocess.run  # (argv, **kwargs) -> CompletedProcess-like
    which: object = shutil.which  # (tool) -> its path or None
    dry_run: bool = False
    echo: object = print
    calls: list = field(default_factory=list)  # every argv asked for, in order

    def run(self, argv: list, timeout: float = TIMEOUT_S, check: bool = True) -> Result:
        """Run a service-manager command, capturing its output. With check, a
        non-zero exit raises ManagerError with what it printed."""
        self.calls.append(list(argv))
        if self.dry_run:
            self.echo(f"would run: {shlex.join(argv)}")
            return Result(list(argv), 0)
        try:
            done = self.runner(argv, capture_output=True, text=True, timeout=timeout, check=False)
        except FileNotFoundError:
            raise ManagerError(f"{argv[0]} not found: {_needs(argv[0])}") from None
        except subprocess.TimeoutExpired:
            raise ManagerError(f"{shlex.join(argv)} did not finish in {timeout:.0f}s") from None
        result = Result(list(argv), done.returncode, done.stdout or "", done.stderr or "")
        if check and not result.ok:
            raise ManagerError(explain(result))
        return result

    def require(self, tool: str) -> None:
        """Before anything is written: the tool this service kind needs is here."""
        if not self.dry_run and self.which(tool) is None:
            raise ManagerError(f"{tool} not found: {_needs(tool)}")

    def follow(self, argv: list) -> int:
        """A command that runs until the user stops it (journalctl -f): no
        timeout, output straight to the terminal; Ctrl-C ends it."""
        self.calls.append(list(argv))
        if self.dry_run:
            self.echo(f"would run: {shlex.join(argv)}")
            return 0
        try:
            return self.runner(argv, check=False).returncode
        except FileNotFoundError:
            raise ManagerError(f"{argv[0]} not found: {_needs(argv[0])}") from None
        except KeyboardInterrupt:
            return 0


def _needs(tool: str) -> str:
    if tool == "launchctl":
        return "launchd services need macOS (--dry-run --launchd shows the plist anywhere)"
    return "systemd user services need a Linux system run by systemd (--dry-run shows the unit anywhere)"


def explain(result: Result) -> str:
    said = (result.stderr.strip() or result.stdout.strip() or "(no output)").splitlines()
    text = "\n  ".join(said[-6:])
    head = f"{shlex.join(result.argv)} failed (exit {result.returncode}):\n  {text}"
    if result.argv[0] in ("systemctl", "journalctl") and any(s in result.stderr for s in NO_USER_MANAGER):
        head += ("\n  No systemd user manager answers here (systemd is not the init system, or this session has "
                 "no user bus: log in normally, or `loginctl enable-linger $USER` and retry). "
                 "`tandem service install --dry-run` still shows the unit.")
    if result.argv[0] == "launchctl" and "bootstrap" in result.argv:
        head += ("\n  launchctl bootstrap fails when the job is loaded already or disabled: "
                 "`tandem service uninstall` then install again; or `launchctl enable gui/$UID/LABEL`.")
    return head
