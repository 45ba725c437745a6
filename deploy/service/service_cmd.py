"""`tandem service install|uninstall|start|stop|restart|status|logs`: run
`tandem serve` as a launchd LaunchAgent (macOS) or a systemd user unit (Linux).

`install` takes `tandem serve`'s flags after its own (a `--` between them
is allowed) and checks them as `tandem serve` would. With --dry-run the files
go to stdout (`--dry-run --launchd > x.plist` is the plist) and what would be
written or run to stderr, on any platform.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

from deploy.service import log_file
from deploy.service.health import fetch_health, health_lines
from deploy.service.launchd import LaunchdService
from deploy.service.manager import Manager, ManagerError
from deploy.service.spec import DEFAULT_LABEL, SpecError, build_spec, check_label, health_url, platform_kind, \
    serve_address
from deploy.service.systemd import SystemdService

INSTALL_EXAMPLE = ("`tandem serve`'s flags follow the service's own, e.g. `tandem service install --model "
                   "mlx-community/Qwen3-4B-4bit --port 8001`; `--` may separate them.")
EXIT_NOT_RUNNING = 3  # status: the server does not answer (LSB's "not running")
ACTIONS = {
    "install": "write the service file and start it (tandem serve's flags follow)",
    "uninstall": "stop the service and remove its file",
    "start": "start the installed service",
    "stop": "stop it (it stays installed: it starts again with `start`, or at the next login or boot)",
    "restart": "stop and start it (the port stays open with --socket-activation)",
    "status": "the service manager's view and the server's /health",
    "logs": "the server's log (launchd: its log file; systemd: journalctl)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, text in ACTIONS.items():
        a = sub.add_parser(name, help=text, description=text, allow_abbrev=False,
                           epilog=INSTALL_EXAMPLE if name == "install" else None)
        a.add_argument("--label", default=None,
                       help=f"the service's name (default: {DEFAULT_LABEL['launchd']} for launchd, "
                            f"{DEFAULT_LABEL['systemd']} for systemd)")
        forced = a.add_mutually_exclusive_group()
        forced.add_argument("--launchd", dest="kind", action="store_const", const="launchd",
                            help="a macOS LaunchAgent whatever this system is (with --dry-run: inspect it anywhere)")
        forced.add_argument("--systemd", dest="kind", action="store_const", const="systemd",
                            help="a systemd user unit whatever this system is")
        a.add_argument("--dry-run", action="store_true", help="print what would be written and run; change nothing")
        a.set_defaults(run=run, takes_serve_flags=name == "install")
        if name == "install":
            a.add_argument("--socket-activation", action="store_true",
                           help="launchd (Sockets) or systemd (a .socket unit) holds the port, so connections "
                                "wait while the server restarts instead of being refused")
            a.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                           help="an environment variable for the server (repeatable)")
            a.add_argument("--no-start", dest="start", action="store_false",
                           help="write and enable it without starting it now")
        if name == "logs":
            a.add_argument("-f", "--follow", action="store_true", help="keep printing new lines (Ctrl-C stops)")
            a.add_argument("-n", "--lines", type=int, default=100, help="how many of the last lines (default 100)")


def serve_flags(extra: list) -> list:
    """The serve flags argparse left over, without the `--` that may separate them."""
    flags = list(extra)
    if "--" in flags:
        flags.remove("--")
    return flags


def _say(text: str) -> None:
    print(text, file=sys.stderr)


def make_service(kind: str, label: str | None, manager: Manager, home: str):
    label = check_label(label or DEFAULT_LABEL[kind])
    if kind == "launchd":
        return LaunchdService(label, manager, home)
    return SystemdService(label, manager, home)


def run(args: argparse.Namespace, manager: Manager | None = None) -> int:
    """`manager`: the service-manager seam (tests pass one with a fake runner)."""
    manager = manager or Manager(dry_run=args.dry_run, echo=_say)
    try:
        kind = platform_kind(args.kind)
        service = make_service(kind, args.label, manager, str(Path.home()))
        if args.action != "status":  # status still asks /health without a service manager
            manager.require("launchctl" if kind == "launchd" else "systemctl")
        if args.action in ("start", "stop", "restart") and not args.dry_run and not service.installed():
            _say(f"tandem service: {service.path} is not installed: `tandem service install` first")
            return 1
        return HANDLERS[args.action](args, service)
    except (SpecError, ManagerError, ValueError) as exc:
        _say(f"tandem service {args.action}: {exc}")
        return 1


def install(args, service) -> int:
    spec = build_spec(service.kind, service.label, serve_flags(getattr(args, "extra", [])), args.env,
                      args.socket_activation)
    files = service.files(spec)
    for path, data in files.items():
        if args.dry_run:
            _say(f"would write {path}:")
            sys.stdout.write(data.decode())
            sys.stdout.flush()
        else:
            _write(path, data)
    for folder in service.folders():
        if args.dry_run:
            _say(f"would create {folder}/")
        else:
            folder.mkdir(parents=True, exist_ok=True)
    service.install(spec, start=args.start)
    if not args.dry_run:
        _say(f"installed {', '.join(str(p) for p in files)}")
        _say(f"serving at {health_url(spec.host, spec.port)} once it has started: `tandem service status`")
    if any(f == "--api-key" or f.startswith("--api-key=") for f in spec.program):
        _say("note: --api-key is stored in the service file and visible in the process list; "
             "--api-key-file keeps it out of both")
    if service.kind == "systemd":
        _say("note: to keep it running after you log out and start it at boot: loginctl enable-linger $USER")
    return 0


def _write(path: Path, data: bytes) -> None:
    """Whole or not at all (a half-written plist is one launchd refuses), and
    only the user's to read whatever the umask: the file holds --api-key
    values and Environment= entries such as HF_TOKEN. Written 0600 from its
    first byte (mkstemp), then moved over the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # mkstemp's 0600 less the umask: exactly 0600
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def uninstall(args, service) -> int:
    paths = service.installed()
    service.uninstall()
    for path in paths:
        if args.dry_run:
            _say(f"would remove {path}")
        else:
            path.unlink(missing_ok=True)
    if hasattr(service, "after_removal"):
        service.after_removal()
    if not args.dry_run:
        _say(f"removed {', '.join(str(p) for p in paths)}" if paths else f"{service.path} was not installed")
    return 0


def start(args, service) -> int:
    service.start()
    if not args.dry_run:
        _say(f"started {service.label}: `tandem service status` shows when it is ready")
    return 0


def stop(args, service) -> int:
    service.stop()
    if not args.dry_run:
        _say(f"stopped {service.label}")
    return 0


def restart(args, service) -> int:
    service.restart()
    if not args.dry_run:
        _say(f"restarted {service.label}")
    return 0


def status(args, service) -> int:
    print(f"service   {service.label} ({service.kind}, {service.path}"
          f"{'' if service.installed() else ': not installed'})")
    try:
        view = service.status()
        print("manager   " + (", ".join(f"{k.replace('_', ' ')} {v}" for k, v in view.items()) or "(nothing said)"))
    except ManagerError as exc:
        print(f"manager   {exc}")
    host, port = serve_address(service.installed_program())
    url = health_url(host, port)
    if args.dry_run:
        _say(f"would ask {url}/health")
        return 0
    code, body, error = fetch_health(url)
    for line in health_lines(url, code, body, error):
        print(line)
    return 0 if code == 200 else EXIT_NOT_RUNNING


def logs(args, service) -> int:
    command = service.log_command(args.lines, args.follow)
    if command is not None:
        if args.follow:
            return service.manager.follow(command)
        sys.stdout.write(service.manager.run(command, timeout=30.0).stdout)
        return 0
    if args.dry_run:
        _say(f"would read {service.log}")
        return 0
    if not service.log.exists():
        _say(f"no log yet at {service.log}")
        return 1
    end = service.log.stat().st_size  # follow from here: no line lost or printed twice
    for line in log_file.last_lines(str(service.log), args.lines, end):
        print(line)
    if args.follow:
        sys.stdout.flush()
        log_file.follow(str(service.log), end)
    return 0


HANDLERS = {"install": install, "uninstall": uninstall, "start": start, "stop": stop, "restart": restart,
            "status": status, "logs": logs}
