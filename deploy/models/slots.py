"""The models the supervisor runs, one "slot" each (protos/model_messages.py):
the --model one is slot "" (its workers keep the names "prefill-0",
"decode-0", "worker-0" and the socket "router"); one loaded on demand is
"m1", "m2", ... (never reused within a run), its workers "m1.decode-0", ...,
on the socket "router-m1". Each slot's workers run with the supervisor's
settings but for the model's own fields (`Slot.overrides`), read again at
every (re)start so the arena's name stays current.

The router decides which model and when (router/models/); this table only
carries it out, in the supervisor's loop, the one thread that touches
children. `resolve` and `known` are for the control socket's thread
(deploy/models/control.py): a name resolved there (a GGUF converted) never
holds up the loop, and `known` reads only a snapshot the loop publishes.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from deploy.group_plan import is_remote, local_index, rank_environment
from deploy.models.children import Child
from environment.hub_cache import HubRef, cached, parse_ref, repo_folder
from environment.model_folder import ModelError, is_vlm, missing_part, model_kind, weight_bytes
from environment.settings import Settings
from protos.group_plan import RankSpec
from protos.model_messages import ModelRefused, ModelSlot, ModelsState
from workers.models.sharding import folder_shard_problem
from workers.models.store import model_id_for, resolve_model

log = logging.getLogger(__name__)

WORKER_TARGET = "workers.main:run"
GROUP_TARGET = "workers.group.main:run"
REMOTE_TARGET = "deploy.remote_rank:run"
LATEST = ":latest"  # what Ollama's clients add to a name
NAMED_BY_REPO = "models are named by their Hugging Face repo"
CONVERT_TIMEOUT_S = 900.0  # a GGUF's conversion (a 70B's reads and writes tens of GB)


def hostfile_path(run_dir: str, group: str) -> str:
    """A group's hostfile (written at each of its starts: deploy/supervisor.py)."""
    return os.path.join(run_dir, f"{group}.hosts.json")


def worker_children(settings: Settings, settings_fn, name: str, roles: list[str], slot: str,
                    targets: tuple[str, str] = (WORKER_TARGET, GROUP_TARGET)) -> list[Child]:
    """The children of one model worker of the plan: one process, or a group
    (tensor or pipeline parallel) whose rank 0 takes the name the router knows
    and the followers "<name>.r<rank>" (workers/group/). With --hosts, a rank on
    another host is an ssh client here (deploy/remote_rank.py): its exit is that
    rank's death. `settings_fn` gives the settings at each (re)start."""
    size = settings.group_size
    if size <= 1:
        return [Child(name, targets[0], lambda: (settings_fn(), roles, name), slot=slot)]
    hosts, out = settings.group_hosts, []
    for rank in range(size):
        spec = RankSpec(name, rank, size, hostfile_path(settings.run_dir, name))
        target = REMOTE_TARGET if is_remote(hosts, rank) else targets[1]
        env = {} if is_remote(hosts, rank) else {**rank_environment(local_index(hosts, rank), os.environ),
                                                 **dict(e.split("=", 1) for e in settings.group_envs)}
        out.append(Child(spec.name, target, lambda spec=spec: (settings_fn(), roles, spec), group=name, env=env,
                         slot=slot))
    return out


def bare(name: str) -> str:
    """The name without Ollama's ":latest"."""
    name = name.strip()
    return name[: -len(LATEST)] if name.lower().endswith(LATEST) else name


def model_key(name: str) -> str:
    """What two names of one model share: a hub ref with its repo's case
    folded, ":latest" dropped; any other name as it is."""
    name = bare(name)
    try:
        ref = parse_ref(name)
    except ModelError:
        return name
    return str(HubRef(ref.repo.lower(), ref.revision, ref.file))


def same_model(asked: str, *names: str) -> bool:
    key = model_key(asked)
    return any(n and (n == asked or model_key(n) == key) for n in names)


@dataclass(frozen=True)
class Resolved:
    """A model name resolved to its folder (in the control socket's thread)."""

    name: str
    model_id: str
    model_dir: str
    startup: bool = False  # the --model one: it runs as slot ""


@dataclass
class Slot:
    info: ModelSlot  # what the router is told
    overrides: dict  # the settings fields its workers run with, over the supervisor's
    children: list[Child] = field(default_factory=list)


def _repo_spelling(ref: HubRef) -> HubRef:
    """`ref` spelled as the cache spells its repo (names are matched ignoring
    the repo's case, as Ollama's clients may send them); `ref` if none is."""
    folder = repo_folder(ref.repo)
    try:
        names = [p.name for p in folder.parent.iterdir() if p.name.lower() == folder.name.lower()]
    except OSError:
        return ref
    if len(names) != 1:
        return ref
    return HubRef(names[0][len("models--"):].replace("--", "/"), ref.revision, ref.file)


def resolve_apart(local: Path, timeout_s: float = CONVERT_TIMEOUT_S) -> Path:
    """The model folder of a cached model. A GGUF's first conversion imports
    MLX: it runs in a child process, so the supervisor never maps MLX's
    libraries (1.3 GiB on CUDA) for the rest of its life."""
    if not str(local).lower().endswith(".gguf"):
        return resolve_model(str(local))
    with mp.get_context("spawn").Pool(1) as pool:
        return Path(pool.apply_async(resolve_model, (str(local),)).get(timeout_s))


def _refused(name: str, status: int, message: str) -> ModelRefused:
    log.info("model %r refused (%d): %s", name, status, message)
    return ModelRefused(name, status, message)


class Slots:
    """The slot table. Every method but `resolve` and `known` runs in the
    supervisor's loop."""

    def __init__(self, settings_fn, targets: tuple[str, str] = (WORKER_TARGET, GROUP_TARGET)):
        self._settings = settings_fn  # () -> the supervisor's settings now
        self._targets = targets  # (a worker's, a group rank's): tests run stand-ins
        s = settings_fn()
        self._startup = Resolved(s.model or s.model_id, s.model_id, s.model_dir, startup=True)
        self.table: dict[str, Slot] = {}
        self._next = 1
        self._published: tuple = ()  # ((name, model_id, state), ...) for `known`

    # ------------------------------------------------- the control thread's --
    def known(self, name: str) -> bool:
        """Whether `name` is a slot that runs or loads (a failed one is not:
        loading it again retries)."""
        return any(state != "failed" and same_model(name, n, i) for n, i, state in self._published)

    def resolve(self, name: str) -> Resolved | ModelRefused:
        """`name` as a model to load: the --model one by its name or id, else
        a repo already in the Hugging Face cache (a GGUF converted once, here).
        Nothing else: a path or a download is never a client's to ask for."""
        asked = bare(name)
        if same_model(name, self._startup.name, self._startup.model_id):
            return self._startup
        if not asked or asked.startswith((".", "/", "~")) or "\\" in asked or asked.count("/") > 1:
            return _refused(name, 400, f"{NAMED_BY_REPO} (owner/name), not a path: {name!r}")
        try:
            ref = parse_ref(asked)
        except ModelError:
            return _refused(name, 400, f"{NAMED_BY_REPO} (owner/name[:FILE][@REVISION]): {name!r}")
        local = cached(ref)
        if local is None:
            ref = _repo_spelling(ref)
            local = cached(ref)
        if local is None:
            return _refused(name, 404, f"model '{asked}' is not downloaded; pull it first: tandem pull {asked}")
        try:
            folder = resolve_apart(local)  # an absolute path in the cache; a GGUF is converted
        except ModelError as exc:
            return _refused(name, 400, str(exc))
        except (mp.TimeoutError, OSError) as exc:
            return _refused(name, 503, f"converting {asked} did not finish: {exc or 'timed out'}")
        why = missing_part(folder)
        if why:
            return _refused(name, 400, f"{asked} is not a whole model ({why}): tandem pull {asked} finishes it")
        spec = str(ref)
        return Resolved(spec, model_id_for(spec, folder), str(folder))

    # ---------------------------------------------------------- the loop's --
    def find(self, name: str) -> Slot | None:
        return next((s for s in self.table.values() if same_model(name, s.info.name, s.info.model_id)), None)

    def startup(self) -> list[Child]:
        """Slot "": the --model one, started with the server."""
        return self._start(self._new_slot(self._startup))

    def load(self, name: str, resolved: Resolved | None) -> list[Child] | ModelRefused:
        """The children to start for `name` (none when it runs already); a
        failed slot starts again."""
        slot = self.find(name) or (resolved and next(
            (s for s in self.table.values() if s.info.model_dir == resolved.model_dir), None))
        if slot is not None and slot.info.state != "failed":
            return []
        if slot is None:
            if resolved is None:  # it went between the control thread's look and now
                return _refused(name, 503, f"model '{bare(name)}' changed state while loading; ask again")
            slot = self._new_slot(resolved)
        return self._start(slot)

    def unload(self, name: str) -> list[Child] | ModelRefused:
        """The children to stop; the slot is forgotten."""
        slot = self.find(name)
        if slot is None:
            return _refused(name, 404, f"model '{bare(name)}' is not loaded")
        del self.table[slot.info.slot]
        self._publish()
        log.info("model %s (slot %r) unloaded", slot.info.model_id, slot.info.slot)
        return slot.children

    def fail(self, key: str, why: str) -> list[Child]:
        """The slot's workers kept dying: the children to stop; the slot stays,
        failed, saying why, until it is unloaded or loaded again."""
        slot = self.table[key]
        log.error("model %s (slot %r) failed: %s; its workers are stopped", slot.info.model_id, key, why)
        children, slot.children = slot.children, []
        slot.info = replace(slot.info, state="failed", error=why, processes=0, workers=[])
        self._publish()
        return children

    def state(self) -> ModelsState:
        """Every slot, copied (the control thread encodes it while the loop goes on)."""
        return ModelsState([replace(s.info, workers=list(s.info.workers)) for s in self.table.values()])

    def _new_slot(self, model: Resolved) -> Slot:
        if model.startup:
            key, overrides = "", {}
        else:
            key = f"m{self._next}"
            self._next += 1
            overrides = dict(model=model.name, model_dir=model.model_dir, model_id=model.model_id,
                             router_socket=f"router-{key}", worker_listen="", draft_model_dir=None,
                             **_layout(self._settings(), model.model_dir))
        settings = replace(self._settings(), **overrides)
        info = ModelSlot(model.name, model.model_id, model.model_dir, key, settings.router_socket,
                         model_kind(model.model_dir), weight_bytes(model.model_dir), processes=0)
        slot = self.table[key] = Slot(info, overrides)
        return slot

    def _start(self, slot: Slot) -> list[Child]:
        key, overrides = slot.info.slot, slot.overrides
        settings = replace(self._settings(), **overrides)
        plan = settings.worker_plan()
        settings_fn = (lambda: replace(self._settings(), **overrides)) if overrides else self._settings
        slot.children = [c for name, roles in plan for c in worker_children(
            settings, settings_fn, f"{key}.{name}" if key else name, roles, key, self._targets)]
        copies = sum(1 for _, roles in plan if {"prefill", "decode"} & set(roles))  # as serve sizes the arena
        slot.info = replace(slot.info, state="loading", error="", processes=copies,
                            workers=[c.name for c in slot.children])
        self._publish()
        log.info("model %s (slot %r): starting %s", slot.info.model_id, key, ", ".join(slot.info.workers))
        return slot.children

    def _publish(self) -> None:
        self._published = tuple((s.info.name, s.info.model_id, s.info.state) for s in self.table.values())


def _layout(settings: Settings, folder: str) -> dict:
    """How a model loaded on demand runs where the --model one's layout does
    not fit it: whole (no group) when its group spans hosts (the others hold
    no copy of it) or cannot split it; no draft model (it is the --model
    one's), so --speculative draft falls back to prompt lookup."""
    out = {"speculative": "auto"} if settings.speculative == "draft" else {}
    size = settings.group_size
    if size <= 1:
        return out
    why = ("a group across hosts (--hosts) serves the --model one only" if settings.group_hosts
           else "vision models are not sharded" if is_vlm(folder)
           else folder_shard_problem(folder, size, pipeline=settings.pipeline_parallel > 1))
    if why:
        log.warning("%s runs whole, not split over %d ranks: %s", Path(folder).name, size, why)
        out.update(tensor_parallel=1, pipeline_parallel=1, group_hosts=())
    return out
