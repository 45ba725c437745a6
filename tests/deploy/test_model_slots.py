"""Many models on one endpoint, the supervisor's half (deploy/models/slots.py,
control.py): a real supervisor loop in a thread of this process, its real
control socket over ZeroMQ, real spawned children, but each model worker a
stand-in (`stand_in_worker`: it records what it was started with, then
sleeps, or dies at once for a model named "broken"); no cache service, no
router. The Hugging Face cache is a folder of this test's, laid out as
huggingface_hub lays it out (environment/hub_cache.py).

And `tandem ps` / `tandem stop` (deploy/models/loaded_cmd.py) against a
stand-in of the server's Ollama endpoints."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import zmq

from protos import transport
from protos.model_messages import ListModels, LoadModel, ModelRefused, ModelsState, UnloadModel

STAND_IN = "tests.deploy.test_model_slots:stand_in_worker"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
WEIGHTS = 1000  # bytes of each stand-in model's model.safetensors


def stand_in_worker(settings, roles, name) -> None:
    """A model worker's stand-in (a spawned child): says what it was started
    with in `<run dir>/<name>.<pid>.json`, then sleeps until stopped; one of
    a "broken" model exits at once, as a worker that cannot load would."""
    record = {"pid": os.getpid(), "roles": roles, "model_id": settings.model_id, "model_dir": settings.model_dir,
              "router_socket": settings.router_socket, "worker_listen": settings.worker_listen,
              "draft_model_dir": settings.draft_model_dir}
    path = Path(settings.run_dir) / f"{name}.{os.getpid()}.json"
    path.with_suffix(".tmp").write_text(json.dumps(record))
    path.with_suffix(".tmp").rename(path)
    if "broken" in settings.model_id:
        sys.exit(3)
    time.sleep(60)


def _model_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (folder / "model.safetensors").write_bytes(b"\0" * WEIGHTS)
    (folder / "tokenizer.json").write_text("{}")
    return folder


def _hub_cache(root: Path, repos: list[str]) -> Path:
    """huggingface_hub's cache layout: refs/main names the commit, the snapshot holds the files."""
    for repo in repos:
        folder = root / f"models--{repo.replace('/', '--')}"
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text(COMMIT)
        _model_folder(folder / "snapshots" / COMMIT)
    return root


@pytest.fixture(scope="module")
def server():
    """A supervisor serving the model in `<tmp>/startup` (as `--model PATH`),
    the cache holding tests/tiny and tests/broken. Stopped at the end: every
    worker it started must be gone, and its run dir."""
    from huggingface_hub import constants
    from huggingface_hub.utils import _cache_manager

    from deploy import supervisor as sup
    from environment.settings import Settings

    root = Path(tempfile.mkdtemp(prefix="tms-"))  # short: an ipc socket's path has a limit
    cache = _hub_cache(root / "hub", ["tests/tiny", "tests/broken"])
    startup = _model_folder(root / "startup")
    run_dir = root / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "HF_HUB_CACHE", str(cache))
        mp.setattr(_cache_manager, "HF_HUB_CACHE", str(cache))
        mp.setattr(sup, "sweep_leftovers", lambda: [])  # other servers' leftovers are not this test's
        mp.setattr(sup, "MAX_RESTARTS", 1)  # a worker dying twice within the window is broken

        class WorkersOnly(sup.Supervisor):
            def _plan(self):  # no cache service, no router: the --model one's workers only
                self.children += self.slots.startup()

        settings = Settings(model=str(startup), model_id="startup", model_dir=str(startup), port=0, colocate=True,
                            run_dir=str(run_dir), drain_timeout_s=0.5)
        supervisor = WorkersOnly(settings, worker_targets=(STAND_IN, STAND_IN))
        thread = threading.Thread(target=supervisor.run, daemon=True)
        thread.start()
        address = transport.ipc_address(str(run_dir), "models")
        ctx = zmq.Context()
        sock = transport.make_socket(ctx, zmq.DEALER)
        try:
            _wait(lambda: (run_dir / "models.sock").exists(), "the control socket")
            sock.connect(address)
            yield Server(supervisor, thread, sock, run_dir, cache)
        finally:
            sock.close()
            ctx.term()
            supervisor.request_stop()
            thread.join(30)
            pids = Server.pids_of(run_dir)
            shutil.rmtree(root, ignore_errors=True)
    assert not thread.is_alive()
    assert not run_dir.exists()
    assert [p for p in pids if _alive(p)] == []  # shutdown stopped every slot


class Server:
    def __init__(self, supervisor, thread, sock, run_dir: Path, cache: Path):
        self.supervisor, self.thread, self.sock, self.run_dir, self.cache = supervisor, thread, sock, run_dir, cache

    def ask(self, msg, timeout_s: float = 20.0):
        transport.send(self.sock, msg)
        assert self.sock.poll(int(timeout_s * 1000)), f"no answer to {msg}"
        return transport.recv(self.sock)

    def slot(self, model_id: str):
        state = self.ask(ListModels())
        return next((s for s in state.slots if s.model_id == model_id), None)

    def started(self, worker: str, after: set = frozenset()) -> dict:
        """The record of `worker`'s newest start (not one of the pids `after`)."""
        def found():
            records = [json.loads(p.read_text()) for p in self.run_dir.glob(f"{worker}.*.json")]
            return [r for r in records if r["pid"] not in after]
        _wait(found, f"{worker} to start")
        return found()[-1]

    @staticmethod
    def pids_of(run_dir: Path) -> list[int]:
        return [json.loads(p.read_text())["pid"] for p in run_dir.glob("*.json")] if run_dir.exists() else []


def _wait(check, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"waited {timeout_s:.0f}s for {what}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_startup_model_is_slot_empty_under_todays_names(server):
    state = server.ask(ListModels())
    assert isinstance(state, ModelsState)
    (slot,) = [s for s in state.slots if s.slot == ""]
    assert (slot.model_id, slot.router_socket, slot.workers, slot.processes) == ("startup", "router", ["worker-0"], 1)
    record = server.started("worker-0")
    assert record["router_socket"] == "router" and record["roles"] == ["prefill", "decode"]


def test_a_downloaded_repo_loads_in_a_slot_of_its_own_and_unloads(server):
    state = server.ask(LoadModel("tests/tiny"))
    assert isinstance(state, ModelsState), state
    slot = next(s for s in state.slots if s.model_id == "tests/tiny")
    key = slot.slot
    assert key.startswith("m") and slot.router_socket == f"router-{key}" and slot.workers == [f"{key}.worker-0"]
    assert (slot.name, slot.kind, slot.weight_bytes, slot.processes, slot.state) == (
        "tests/tiny", "chat", WEIGHTS, 1, "loading")
    record = server.started(f"{key}.worker-0")
    assert record["model_dir"] == slot.model_dir == str(server.cache / "models--tests--tiny" / "snapshots" / COMMIT)
    assert (record["router_socket"], record["model_id"]) == (f"router-{key}", "tests/tiny")
    assert (record["worker_listen"], record["draft_model_dir"]) == ("", None)

    # Ollama's clients say "name:latest", and the repo's case may differ: the same model, not a second copy.
    again = server.ask(LoadModel("Tests/Tiny:latest"))
    assert [s.slot for s in again.slots] == [s.slot for s in state.slots]

    gone = server.ask(UnloadModel("tests/tiny:latest"))  # answered once its workers are gone
    assert isinstance(gone, ModelsState) and "tests/tiny" not in [s.model_id for s in gone.slots]
    assert not _alive(record["pid"])
    refused = server.ask(UnloadModel("tests/tiny"))
    assert isinstance(refused, ModelRefused) and refused.status == 404


@pytest.mark.parametrize("name", ["/etc", "../models/x", "~/m", "a/b/c", "C:\\models\\m"])
def test_a_path_is_refused(server, name):
    refused = server.ask(LoadModel(name))
    assert isinstance(refused, ModelRefused) and refused.status == 400, refused
    assert refused.message.startswith("models are named by their Hugging Face repo")


def test_a_repo_not_downloaded_is_refused_with_the_pull_to_run(server):
    for name in ("tests/absent", "tests/absent:latest"):
        refused = server.ask(LoadModel(name))
        assert isinstance(refused, ModelRefused) and refused.status == 404
        assert refused.message == "model 'tests/absent' is not downloaded; pull it first: tandem pull tests/absent"


def test_a_model_whose_workers_keep_dying_fails_alone(server):
    startup_pid = server.started("worker-0")["pid"]
    state = server.ask(LoadModel("tests/broken"))
    assert next(s for s in state.slots if s.model_id == "tests/broken").state == "loading"
    failed = _wait(lambda: (s := server.slot("tests/broken")) and s.state == "failed" and s, "the slot to fail")
    assert "died 2 times" in failed.error and (failed.processes, failed.workers) == (0, [])
    assert server.thread.is_alive() and server.supervisor.failed is None  # the server goes on
    assert _alive(startup_pid)

    retried = server.ask(LoadModel("tests/broken"))  # loading it again retries, in the same slot
    slot = next(s for s in retried.slots if s.model_id == "tests/broken")
    assert (slot.slot, slot.state, slot.error) == (failed.slot, "loading", "")
    gone = server.ask(UnloadModel("tests/broken"))
    assert "tests/broken" not in [s.model_id for s in gone.slots]


def test_the_startup_model_unloads_and_comes_back_as_slot_empty(server):
    before = server.started("worker-0")
    gone = server.ask(UnloadModel("startup"))
    assert "" not in [s.slot for s in gone.slots] and not _alive(before["pid"])
    back = server.ask(LoadModel("startup:latest"))
    (slot,) = [s for s in back.slots if s.slot == ""]
    assert (slot.model_id, slot.router_socket, slot.workers) == ("startup", "router", ["worker-0"])
    assert server.started("worker-0", after={before["pid"]})["router_socket"] == "router"


# ------------------------------------------------------ tandem ps / stop --
class OllamaStandIn(BaseHTTPRequestHandler):
    """/api/ps with two models; /api/generate knows tests/tiny only."""

    seen: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.seen.append(("GET", self.path, self.headers.get("Authorization"), None))
        now = datetime.now(timezone.utc)
        self._json(200, {"models": [
            {"name": "tests/tiny", "model": "tests/tiny", "size": 3 << 30, "size_vram": 3 << 30,
             "expires_at": (now + timedelta(minutes=4, seconds=30)).isoformat()},
            {"name": "tests/cpu", "size": 1 << 20, "size_vram": 0, "expires_at": "2318-01-01T00:00:00Z"},
        ]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(("POST", self.path, self.headers.get("Authorization"), body))
        if body.get("model") == "tests/tiny":
            self._json(200, {"model": "tests/tiny", "response": "", "done": True, "done_reason": "unload"})
        else:
            self._json(404, {"error": f"model '{body.get('model')}' not found"})

    def _json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def ollama():
    OllamaStandIn.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), OllamaStandIn)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def tandem(*argv: str) -> int:
    from deploy.cli import build_parser

    args = build_parser().parse_args(list(argv))
    return args.run(args)


def test_ps_prints_the_loaded_models_as_ollama_ps_does(ollama, capsys):
    assert tandem("ps", "--port", str(ollama), "--api-key", "k1") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "PROCESSOR", "UNTIL"]
    assert lines[1].split()[0] == "tests/tiny" and "100% GPU" in lines[1] and lines[1].endswith("4 minutes from now")
    assert lines[2].split()[0] == "tests/cpu" and "100% CPU" in lines[2] and lines[2].endswith("Forever")
    assert OllamaStandIn.seen == [("GET", "/api/ps", "Bearer k1", None)]


def test_stop_unloads_with_keep_alive_zero(ollama, capsys):
    assert tandem("stop", "tests/tiny", "--port", str(ollama)) == 0
    assert OllamaStandIn.seen == [("POST", "/api/generate", None, {"model": "tests/tiny", "keep_alive": 0})]
    assert tandem("stop", "tests/other", "--port", str(ollama)) == 1
    assert 'couldn\'t find model "tests/other" to stop' in capsys.readouterr().err


def test_a_gguf_is_converted_in_a_child_so_the_supervisor_never_maps_mlx(tmp_path):
    """The conversion imports MLX; the supervisor's process must not (its
    libraries are 1.3 GiB of address space on CUDA, for the server's life)."""
    import subprocess

    from tests.support.gguf_fixtures import write_tiny_llama

    write_tiny_llama(tmp_path / "tiny.gguf")
    code = ("import sys; from pathlib import Path; from deploy.models.slots import resolve_apart; "
            "folder = resolve_apart(Path(sys.argv[1])); assert (folder / 'config.json').is_file(), folder; "
            "mlx = sorted(m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')); assert not mlx, mlx")
    env = {**os.environ, "TANDEM_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tiny.gguf")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list((tmp_path / "cache").rglob("config.json"))  # converted, where the store keeps conversions
