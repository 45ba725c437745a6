"""Router <-> supervisor: which models are loaded (many models on one endpoint).

The router decides (which model a request names, when an idle one goes: its
keep-alive, the memory budget, least recently used first); the supervisor
carries it out (a model's name resolved to a folder, its worker processes
started and stopped). A model loaded on demand is a "slot": its workers talk
to the router on their own socket (`ModelSlot.router_socket`, an ipc name in
the run folder), so each model has its own dispatcher in the router and its
workers never see another model's requests. The cache service is shared: KV
block keys carry the model's fingerprint (workers/kv/block_hash.py).

Every request is answered by `ModelsState` (the slots now, after the request
took effect) or `ModelRefused` (why not). A router that restarts asks
`ListModels` and rebuilds its dispatchers from the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CONTROL_SOCKET = "models"  # the supervisor's control socket: its ipc name in the run folder


@dataclass
class ModelSlot:
    """One loaded (or loading) model, as the supervisor runs it."""

    name: str  # the name it was asked by (a hub repo, the served id)
    model_id: str  # the id clients see
    model_dir: str  # its resolved local MLX folder
    slot: str  # "" for the model `tandem serve` started with, else "m1", "m2", ...
    router_socket: str  # the ipc name its workers say hello on ("router", "router-m1", ...)
    kind: str  # "chat", "vision" or "embedding" (environment/model_folder.py model_kind)
    weight_bytes: int  # its weights' size on disk
    processes: int  # model worker processes holding a copy of the weights
    workers: list[str] = field(default_factory=list)  # the processes' names (what /health lists)
    state: str = "loading"  # "loading" (its workers started) | "failed" (they kept dying: `error` says why)
    error: str = ""


@dataclass
class LoadModel:
    """Start a model's workers (nothing happens when it already runs)."""

    name: str


@dataclass
class UnloadModel:
    """Stop a model's workers and forget the slot."""

    name: str


@dataclass
class ListModels:
    pass


@dataclass
class ModelsState:
    slots: list[ModelSlot] = field(default_factory=list)


@dataclass
class ModelRefused:
    name: str
    status: int  # the HTTP status it means: 404 not downloaded / unknown, 400 not servable, 503 no room
    message: str
