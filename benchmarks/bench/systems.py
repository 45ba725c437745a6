"""Start, watch and stop the servers `tandem bench` compares.

Each system runs in its own session (process group) on a port of the bench's
range, with its log in the run's log folder. Stopping is SIGTERM to the group,
then SIGKILL after a deadline: nothing outlives the bench.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.bench.memory import ProcessTreeMemory
from deploy.blas import openblas_path
from deploy.power.policy import POLICIES
from deploy.settings import default_cache_dir

SYSTEMS = ("tandem", "tandem-colocate", "mlx_lm", "mlx_vlm", "vllm-mlx")
POWER_POLICIES = ("auto", *POLICIES)  # `tandem serve --power-policy`


def with_power_policies(systems: tuple[str, ...], policies: tuple[str, ...]) -> tuple[str, ...]:
    """Each Tandem system once per power policy, as rows of their own: tandem -> tandem[performance],
    tandem[saver]; the peers as they are."""
    return tuple(row for s in systems
                 for row in ([f"{s}[{p}]" for p in policies] if policies and s.startswith("tandem") else [s]))


def split_policy(name: str) -> tuple[str, str | None]:
    """"tandem[saver]" -> ("tandem", "saver"); "mlx_lm" -> ("mlx_lm", None)."""
    if name.endswith("]") and "[" in name:
        base, policy = name[:-1].split("[", 1)
        return base, policy
    return name, None


def file_label(name: str) -> str:
    """A system's name as it appears in file names: tandem[saver] -> tandem-saver."""
    base, policy = split_policy(name)
    return f"{base}-{policy}" if policy else base


@dataclass
class ServerSpec:
    name: str
    argv: list[str]
    env: dict[str, str]
    request_model: str  # the "model" field this server accepts
    port: int
    metrics_path: str | None = None  # Prometheus counters the swarm workload reads (Tandem only)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Options:
    """What the specs need besides the system's name."""

    model_spec: str | None  # as the user gave it to --model (None: the embedded default)
    model_dir: Path  # the folder Tandem resolves it to
    peer_model_dir: Path  # the folder the peers load (a float32 copy on the CPU backend, see peer_weights)
    run_dir: Path  # logs and per-run state
    tandem_args: list[str] = field(default_factory=list)
    mlx_lm_args: list[str] = field(default_factory=list)
    mlx_vlm_args: list[str] = field(default_factory=list)
    vllm_mlx_args: list[str] = field(default_factory=list)
    vllm_mlx_bin: str | None = None
    vllm_mlx_mllm: bool = False  # start vllm-mlx in MLLM mode (--mllm): the vision workload


def openblas_env() -> dict[str, str]:
    """MLX's Linux CPU wheel needs OpenBLAS preloaded to be fast (deploy/blas.py).
    `tandem` sets it itself; the peers get it here."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    lib = openblas_path()
    if lib and lib not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = f"{lib} {env.get('LD_PRELOAD', '')}".strip()
    return env


def default_vllm_mlx_bin() -> Path:
    return Path(default_cache_dir()) / "peers" / "vllm-mlx" / "bin" / "vllm-mlx"


def server_spec(name: str, port: int, opts: Options) -> ServerSpec:
    base, policy = split_policy(name)
    if base in ("tandem", "tandem-colocate") and policy in (None, *POWER_POLICIES):
        argv = [sys.executable, "-m", "deploy.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                # A fresh disk tier per start: every system begins with an empty cache, as the peers do.
                "--cache-dir", str(opts.run_dir / f"{file_label(name)}-kv"),
                # The vision workload serves its media from 127.0.0.1 (vision_workload.MediaServer).
                "--allow-media-hosts", "127.0.0.1"]
        if opts.model_spec:
            argv += ["--model", opts.model_spec]
        if base == "tandem-colocate":
            argv.append("--colocate")
        # After --tandem-args, so that the row's name says the policy that ran.
        argv += opts.tandem_args + (["--power-policy", policy] if policy else [])
        return ServerSpec(name, argv, dict(os.environ), "default", port, "/metrics")
    if name == "mlx_lm":
        argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(opts.peer_model_dir),
                "--host", "127.0.0.1", "--port", str(port)]
        return ServerSpec(name, argv + opts.mlx_lm_args, openblas_env(), "default_model", port)
    if name == "mlx_vlm":
        # The "model" field names the folder it preloaded: any other name makes it load that model.
        argv = [sys.executable, "-m", "mlx_vlm.server", "--model", str(opts.peer_model_dir),
                "--host", "127.0.0.1", "--port", str(port)]
        env = openblas_env()
        # Its prefix cache (APC, image-aware block hashes) is off by default: on, as Tandem's is,
        # with a disk tier of its own per start (the default one outlives the run). An
        # APC_* variable in the bench's environment wins.
        env.setdefault("APC_ENABLED", "1")
        env.setdefault("APC_DISK_PATH", str(opts.run_dir / f"{name}-apc"))
        return ServerSpec(name, argv + opts.mlx_vlm_args, env, str(opts.peer_model_dir), port)
    if name == "vllm-mlx":
        binary = Path(opts.vllm_mlx_bin) if opts.vllm_mlx_bin else default_vllm_mlx_bin()
        if not binary.exists():
            raise RuntimeError(f"vllm-mlx not found at {binary}: create its environment with "
                               f"`bash benchmarks/bench/peers/setup_vllm_mlx.sh`, or pass --vllm-mlx-bin")
        argv = [str(binary), "serve", str(opts.peer_model_dir), "--host", "127.0.0.1", "--port", str(port),
                "--continuous-batching", "--served-model-name", "default"]
        if opts.vllm_mlx_mllm:
            argv.append("--mllm")
        env = openblas_env()
        # vllm-mlx saves its prefix cache to ~/.cache/vllm-mlx/prefix_cache/<model path> when it
        # stops and loads it when it starts: a second run of the same seeded prompts would start
        # warm. A home of its own per start gives it an empty cache, as Tandem's --cache-dir does.
        env["HOME"] = str(opts.run_dir / f"{name}-home")
        return ServerSpec(name, argv + opts.vllm_mlx_args, env, "default", port)
    raise ValueError(f"unknown system {name!r} (known: {', '.join(SYSTEMS)})")


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_port(start: int, taken: set[int]) -> int:
    port = start
    while port in taken or not port_is_free(port):
        port += 1
    taken.add(port)
    return port


class ManagedServer:
    """One system's server process (and its children) for the length of a benchmark."""

    def __init__(self, spec: ServerSpec, log_path: Path):
        self.spec = spec
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.memory: ProcessTreeMemory | None = None

    @property
    def command(self) -> str:
        return shlex.join(self.spec.argv)

    def start(self, timeout: float) -> None:
        """Start and wait until /health answers 200 (generation readiness is
        the warm-up's job: some servers answer /health while still loading)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.spec.argv, stdout=log, stderr=subprocess.STDOUT, env=self.spec.env,
                                         start_new_session=True, cwd=_repo_root())
        self.memory = ProcessTreeMemory(self.proc.pid)
        self.memory.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode} while starting; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.spec.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.spec.name} not healthy after {timeout:.0f}s; "
                           f"log {self.log_path}:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        if self.memory:
            self.memory.stop()
        if self.proc is None or self.proc.poll() is not None:
            return
        _signal_group(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        # The group may still hold children that ignored SIGTERM (or a parent
        # that died first): make sure nothing of this server survives.
        _signal_group(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return "(no log)"


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[1])
