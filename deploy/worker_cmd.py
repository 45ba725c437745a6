"""`tandem worker`: a model worker on another host that joins a router over
ZeroMQ tcp with CURVE keys (`tandem keys`; the router runs
`tandem serve --worker-listen tcp://HOST:PORT --worker-keys DIR`).

It is a small supervisor of its own (deploy/supervisor.py's, without the
router and the HTTP port): a cache service on this host for the worker's
prefix cache, and the worker, each restarted when it dies, both stopped on
SIGTERM / Ctrl-C. Its id `remote-<host>-<index>` is the same after a restart,
so the router takes it back as the same worker.

`--role colocated` (the default): prefill and decode in one process, so no KV
crosses hosts. `--role prefill` or `--role decode`: one role; a prompt's KV
between it and a worker of another host goes by value over the socket
(router/routing/handoff_route.py). Its cache service is its own (its prefix cache, its
handoffs' arena), so its `kv_host` is its own id: two `tandem worker`s of one
host share no arena, and the router never hands KV between them by reference.
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import socket
import sys

from deploy.keys_cmd import tcp_address_error
from environment.logs import setup_logging
from environment.model_folder import ModelError, weight_bytes
from deploy.serve_cmd import _bytes, _positive
from environment.settings import Settings, default_cache_memory
from deploy.models.slots import worker_children
from deploy.supervisor import Child, Supervisor
from protos.transport import KeysError, worker_keys
from workers.models.store import model_id_for, resolve_model

log = logging.getLogger(__name__)

ROLES = {"colocated": ["prefill", "decode"], "prefill": ["prefill"], "decode": ["decode"]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Settings()
    p.add_argument("--connect", required=True, metavar="tcp://ROUTER:PORT",
                   help="the router's --worker-listen address, as reached from this host")
    p.add_argument("--keys", required=True, metavar="DIR",
                   help="this worker's folder from `tandem keys`: its pair and the router's public key")
    p.add_argument("--model", default=None, help="the router's model, as --model takes it (default: the embedded one)")
    p.add_argument("--role", default="colocated", choices=list(ROLES),
                   help="colocated: prefill and decode in this process (no KV crosses hosts); prefill or decode: "
                        "that role alone, a prompt's KV going to or from another host over the socket")
    p.add_argument("--index", type=int, default=0, help="tells several workers of one host apart (the id's end)")
    p.add_argument("--cache-memory", type=_bytes, default=None, help="this host's KV arena for the prefix cache, e.g. 2G")
    p.add_argument("--cache-dir", default=d.cache_dir, help="disk tier for KV blocks, kept across restarts")
    p.add_argument("--no-disk-cache", action="store_true", help="keep KV blocks in memory only")
    p.add_argument("--max-batch", type=_positive, default=d.max_batch, help="decode batch size")
    p.add_argument("--prefill-chunk", type=_positive, default=d.prefill_chunk, help="tokens per prefill step")
    p.add_argument("--block-size", type=_positive, default=d.block_size, help="tokens per KV block (as the router's)")
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false", help="say ready without a warm-up prompt")
    p.add_argument("--join-timeout", type=float, default=d.router_join_timeout_s,
                   help="seconds without an answer from the router before an error is logged (then again, less often)")
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    p.set_defaults(run=run)


class WorkerSupervisor(Supervisor):
    """The supervisor without a router or an HTTP port: this host's cache
    service and one worker that joins a router elsewhere."""

    def __init__(self, settings: Settings, worker_id: str, roles: list[str]):
        super().__init__(settings)
        self.worker_id = worker_id
        self.roles = roles

    def _listen(self) -> bool:
        return True  # no HTTP port: clients reach the router

    def _plan(self) -> None:
        self.children.append(Child("cache", "cache_service.main:run", lambda: (self.settings,)))
        self.children += worker_children(self.settings, lambda: self.settings, self.worker_id, self.roles, "")

    def _announce(self) -> None:
        log.info("tandem worker %s serving %s for the router at %s (run dir %s)", self.worker_id,
                 self.settings.model_id, self.settings.router_address, self.settings.run_dir)


def host_name() -> str:
    """This host's name as a worker id may carry it."""
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname()).strip("-.") or "host"


def _fail(message: str) -> int:
    print(f"tandem worker: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    if args.index < 0:
        return _fail(f"--index {args.index}: must be 0 or more")
    why = tcp_address_error("--connect", args.connect)
    if why:
        return _fail(why)
    try:
        worker_keys(args.keys)
    except KeysError as exc:
        return _fail(f"--keys: {exc}")
    try:
        model_dir = resolve_model(args.model)
    except ModelError as exc:
        return _fail(str(exc))
    setup_logging(args.log_level, "worker-supervisor")
    host = host_name()
    worker_id, colocated = f"remote-{host}-{args.index}", args.role == "colocated"
    settings = Settings(
        model=args.model, model_dir=str(model_dir), model_id=model_id_for(args.model, model_dir), colocate=colocated,
        router_address=args.connect, router_keys=args.keys, kv_host=host if colocated else worker_id,
        router_join_timeout_s=args.join_timeout, prefill_workers=int(args.role != "decode"),
        decode_workers=int(args.role != "prefill"),  # its plan is this one process (memory shares)
        cache_memory_bytes=args.cache_memory or default_cache_memory(weights=weight_bytes(model_dir), copies=1),
        cache_dir=None if args.no_disk_cache else args.cache_dir, max_batch=args.max_batch,
        prefill_chunk=args.prefill_chunk, block_size=args.block_size, warm_up=args.warm_up, log_level=args.log_level)
    supervisor = WorkerSupervisor(settings, worker_id, ROLES[args.role])
    signal.signal(signal.SIGTERM, supervisor.request_stop)
    signal.signal(signal.SIGINT, supervisor.request_stop)
    return supervisor.run()
