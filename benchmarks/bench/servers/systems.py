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

from benchmarks.bench.measures.memory import ProcessTreeMemory
from deploy.blas import openblas_path
from environment.power.policy import POLICIES
from environment.settings import default_cache_dir

SYSTEMS = ("tandem", "tandem-colocate", "mlx_lm", "mlx_vlm", "vllm-mlx")
POWER_POLICIES = ("auto", *POLICIES)  # `tandem serve --power-policy`
SPECULATIVE = ("off", "prompt-lookup", "draft", "auto")  # `tandem serve --speculative`
DRAFT_PEER = "mlx_lm[draft]"  # mlx_lm.server --draft-model: the peer with speculative decoding


@dataclass(frozen=True)
class Variant:
    """What a row's brackets say about how its system runs: tandem[saver],
    tandem[spec=draft], tandem[saver,spec=draft], mlx_lm[draft]."""

    power_policy: str | None = None  # Tandem: `--power-policy`
    speculative: str | None = None  # Tandem: `--speculative`
    draft: bool = False  # mlx_lm: `--draft-model`

    def label(self) -> str:
        parts = [self.power_policy or "", f"spec={self.speculative}" if self.speculative else "",
                 "draft" if self.draft else ""]
        return ",".join(p for p in parts if p)


def row_name(base: str, variant: Variant) -> str:
    label = variant.label()
    return f"{base}[{label}]" if label else base


def split_row(name: str) -> tuple[str, Variant]:
    """"tandem[saver,spec=off]" -> ("tandem", Variant("saver", "off")); "mlx_lm" -> ("mlx_lm", Variant())."""
    if not (name.endswith("]") and "[" in name):
        return name, Variant()
    base, inner = name[:-1].split("[", 1)
    fields: dict = {}
    for part in filter(None, inner.split(",")):
        if part.startswith("spec="):
            fields["speculative"] = part[len("spec="):]
        elif part == "draft":
            fields["draft"] = True
        else:
            fields["power_policy"] = part
    return base, Variant(**fields)


def expand_rows(systems: tuple[str, ...], power_policies: tuple[str, ...] = (), speculative: tuple[str, ...] = (),
                draft_peer: bool = False) -> tuple[str, ...]:
    """The rows to run: each Tandem system once per power policy and speculation
    mode given (tandem -> tandem[saver,spec=off], tandem[saver,spec=draft], ...),
    the peers as they are, and with `draft_peer` mlx_lm[draft] after mlx_lm."""
    rows: list[str] = []
    for s in systems:
        if s.startswith("tandem"):
            rows += [row_name(s, Variant(p, k)) for p in power_policies or (None,) for k in speculative or (None,)]
        else:
            rows += [s, DRAFT_PEER] if draft_peer and s == "mlx_lm" else [s]
    return tuple(rows)


def spec_baseline(name: str) -> str | None:
    """The row a Tandem row with speculation compares with: the same row with
    spec=off (None for spec=off itself, rows without spec=, and peers)."""
    base, v = split_row(name)
    if not base.startswith("tandem") or v.speculative in (None, "off"):
        return None
    return row_name(base, Variant(v.power_policy, "off"))


def file_label(name: str) -> str:
    """A row's name as it appears in file names: tandem[saver,spec=off] -> tandem-saver-spec-off."""
    base, variant = split_row(name)
    label = variant.label().replace(",", "-").replace("=", "-")
    return f"{base}-{label}" if label else base


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
    draft_model: str | None = None  # --draft-model as given: Tandem's spec=draft and spec=auto rows
    peer_draft_model_dir: Path | None = None  # the folder mlx_lm[draft] loads as its draft
    spec_tokens: int | None = None  # draft tokens per step: Tandem's --spec-tokens, mlx_lm's --num-draft-tokens


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
    base, variant = split_row(name)
    policy = variant.power_policy
    if base in ("tandem", "tandem-colocate") and policy in (None, *POWER_POLICIES) and \
            variant.speculative in (None, *SPECULATIVE) and not variant.draft:
        argv = [sys.executable, "-m", "deploy.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                # A fresh disk tier per start: every system begins with an empty cache, as the peers do.
                "--cache-dir", str(opts.run_dir / f"{file_label(name)}-kv"),
                # The vision workload serves its media from 127.0.0.1 (vision_workload.MediaServer).
                "--allow-media-hosts", "127.0.0.1"]
        if opts.model_spec:
            argv += ["--model", opts.model_spec]
        if base == "tandem-colocate":
            argv.append("--colocate")
        # After --tandem-args, so that the row's name says the policy and speculation that ran.
        argv += opts.tandem_args + (["--power-policy", policy] if policy else [])
        argv += speculation_args(variant.speculative, opts)
        return ServerSpec(name, argv, dict(os.environ), "default", port, "/metrics")
    if base == "mlx_lm" and variant in (Variant(), Variant(draft=True)):
        argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(opts.peer_model_dir),
                "--host", "127.0.0.1", "--port", str(port)]
        if variant.draft:
            if not opts.peer_draft_model_dir:
                raise ValueError(f"{name} needs --draft-model")
            # mlx_lm.server then decodes one request at a time (no continuous batching with a draft).
            argv += ["--draft-model", str(opts.peer_draft_model_dir)]
            argv += ["--num-draft-tokens", str(opts.spec_tokens)] if opts.spec_tokens else []
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


def speculation_args(mode: str | None, opts: Options) -> list[str]:
    """`tandem serve` flags of a row's spec= (none without one): the draft model
    where the mode can use it (draft, and auto, which picks it when given)."""
    if mode is None:
        return []
    if mode == "draft" and not opts.draft_model:
        raise ValueError("spec=draft needs --draft-model")
    args = ["--speculative", mode]
    if mode in ("draft", "auto") and opts.draft_model:
        args += ["--draft-model", opts.draft_model]
    if mode != "off" and opts.spec_tokens:
        args += ["--spec-tokens", str(opts.spec_tokens)]
    return args


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
