"""What a service runs: `tandem serve` with the user's flags, checked at
install (a typo fails now, not when launchd starts it at 3 a.m.) and made
independent of the shell it was installed from (absolute paths, its own
environment)."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from deploy import serve_cmd
from environment.settings import Settings
from deploy.supervisor import longest_stop_s

KINDS = ("launchd", "systemd")
DEFAULT_LABEL = {"launchd": "dev.tandem.server", "systemd": "tandem"}
LABEL_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Serve flags naming a file or folder: made absolute, the service's working
# directory being another than the shell's.
PATH_FLAGS = ("--model", "--draft-model", "--api-key-file", "--cache-dir", "--allow-local-media", "--power-state-file",
              "--memory-pressure-file", "--worker-keys")
MODEL_FLAGS = ("--model", "--draft-model")  # a path or a Hugging Face repo id
# What the service keeps from the installing shell's environment, when set.
PASSED_ENV = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT", "TANDEM_CACHE_DIR", "TANDEM_NO_OPENBLAS",
              "XDG_CACHE_HOME", "OPENBLAS_THREAD_TIMEOUT")
SYSTEM_PATH = ("/opt/homebrew/bin", "/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin")
# Beyond the supervisor's longest stop, before the service manager kills it.
STOP_MARGIN_S = 15


class SpecError(Exception):
    """Install flags that cannot make a working service; the message says why."""


@dataclass
class ServiceSpec:
    kind: str  # "launchd" or "systemd"
    label: str  # launchd Label / systemd unit name (without .service)
    program: list  # absolute argv: this install's tandem, "serve", the serve flags
    host: str
    port: int
    stop_timeout_s: int  # launchd ExitTimeOut, systemd TimeoutStopSec
    working_dir: str
    environment: dict = field(default_factory=dict)
    socket_activation: bool = False


def platform_kind(forced: str | None = None) -> str:
    """launchd on macOS, systemd on Linux, unless --launchd / --systemd chose."""
    if forced:
        return forced
    if sys.platform == "darwin":
        return "launchd"
    if sys.platform.startswith("linux"):
        return "systemd"
    raise SpecError(f"no service manager Tandem knows on {sys.platform}: pass --launchd or --systemd with --dry-run")


def check_label(label: str) -> str:
    if not LABEL_PATTERN.fullmatch(label):
        raise SpecError(f"label {label!r}: letters, digits, '.', '_' and '-' only")
    return label


def tandem_command() -> list:
    """This install's `tandem`, absolute: the console script beside the
    interpreter, else the interpreter running deploy.cli. Made absolute, not
    resolved: a virtual environment's python is a symlink whose target would
    run outside the environment."""
    python = os.path.abspath(sys.executable)
    script = os.path.join(os.path.dirname(python), "tandem")
    if os.access(script, os.X_OK):
        return [script]
    return [python, "-m", "deploy.cli"]


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem serve", add_help=False, allow_abbrev=False)
    serve_cmd.add_arguments(parser)
    return parser


def parse_serve_flags(flags: list) -> argparse.Namespace:
    """The serve flags as `tandem serve` would read them; a bad one exits (2)
    with argparse's message, as `tandem serve` would."""
    return serve_parser().parse_args(flags)


def absolute_paths(flags: list, cwd: str) -> list:
    """The serve flags with relative (and ~) paths made absolute; a --model
    or --draft-model that is neither an existing path nor a repo id fails."""
    out, i = [], 0
    while i < len(flags):
        flag, value, joined = flags[i], None, False
        if "=" in flag and flag.split("=", 1)[0] in PATH_FLAGS:
            flag, value = flag.split("=", 1)
            joined = True
        elif flag in PATH_FLAGS and i + 1 < len(flags):
            value = flags[i + 1]
            i += 1
        if value is not None:
            value = _absolute(flag, value, cwd)
            out += [f"{flag}={value}"] if joined else [flag, value]
        else:
            out.append(flag)
        i += 1
    return out


def _absolute(flag: str, value: str, cwd: str) -> str:
    expanded = os.path.expanduser(value)
    path = os.path.normpath(os.path.join(cwd, expanded))
    looks_like_path = value.startswith(("/", ".", "~")) or os.path.exists(path)
    if flag in MODEL_FLAGS:
        if not looks_like_path:
            return value  # a Hugging Face repo id
        if not os.path.exists(path):
            raise SpecError(f"{flag} {value}: no such file or folder")
    return path


def environment(home: str, tandem_bin: str, environ=os.environ) -> dict:
    """The service's environment: PATH with this install's bin first, HOME,
    unbuffered output (lines reach the log at once), and what Tandem reads
    from the installing shell."""
    path = [os.path.dirname(tandem_bin)] + [p for p in SYSTEM_PATH if p != os.path.dirname(tandem_bin)]
    env = {"PATH": ":".join(dict.fromkeys(path)), "HOME": home, "PYTHONUNBUFFERED": "1"}
    env.update({k: environ[k] for k in PASSED_ENV if environ.get(k)})
    return env


def build_spec(kind: str, label: str | None, flags: list, extra_env: list = (), socket_activation: bool = False,
               cwd: str | None = None, home: str | None = None, environ=os.environ) -> ServiceSpec:
    """The service for these serve flags (checked here); SpecError if unusable."""
    if kind not in KINDS:
        raise SpecError(f"unknown service kind {kind!r}")
    label = check_label(label or DEFAULT_LABEL[kind])
    flags = absolute_paths(list(flags), cwd or os.getcwd())
    args = parse_serve_flags(flags)
    home = home or str(Path.home())
    program = tandem_command()
    env = environment(home, program[0], environ)
    if program[1:2] == ["-m"]:  # not installed: the checkout must be importable from anywhere
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    for item in extra_env:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise SpecError(f"--env {item!r}: expected NAME=VALUE")
        env[key] = value
    stop = math.ceil(longest_stop_s(args.drain_timeout)) + STOP_MARGIN_S
    return ServiceSpec(kind=kind, label=label, program=[*program, "serve", *flags], host=args.host, port=args.port,
                       stop_timeout_s=stop, working_dir=home, environment=env, socket_activation=socket_activation)


def health_url(host: str, port: int) -> str:
    """Where a local client reaches a server bound to host (a wildcard: loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_address(program) -> tuple[str, int]:
    """(host, port) of an installed service's argv (read back from its plist
    or unit: garbage is possible), the serve defaults where not readable."""
    defaults = Settings()
    host, port = defaults.host, defaults.port
    items = [str(a) for a in program] if isinstance(program, (list, tuple)) else []
    for i, item in enumerate(items):
        name, sep, value = item.partition("=")
        if not sep:
            value = items[i + 1] if i + 1 < len(items) else ""
        if name == "--host" and value:
            host = value
        elif name == "--port" and value.isdigit() and int(value) < 65536:
            port = int(value)
    return host, port
