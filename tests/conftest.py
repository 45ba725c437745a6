"""Fixtures shared by the suite: the embedded model, a tiny random llama and
real `tandem serve` instances. Helpers and fakes are in tests/support/."""

from __future__ import annotations

import pytest

from tests.support.server import TandemServer
from tests.support.tiny_models import load_tiny_model, make_tiny_llama

E2E = "tests/e2e/"
# End-to-end modules that run last, on the other worker, once its own modules
# are done: the end-to-end unit alone took ~840 s of a ~860 s run, the other
# worker ~490 s. Modules without kills or tight deadlines, so a second server
# beside the unit's is safe. The prefix-cache module joined them (issue 39) when
# the agents module's CPU halved (169 -> ~80 CPU-s, a tiny model for what the
# grammars decide) and this session's model-service modules joined the unit:
# by CPU (measured alone) the unit is then pipeline 189, tensor-parallel 164,
# faults 79, remote-worker 49, group-hosts ~30 and the new modules; late are
# prefix-cache ~80, agents ~80 and vision ~65, after ~330 CPU-s of the other modules.
E2E_LATE = ("tests/e2e/test_e2e_agents.py", "tests/e2e/test_e2e_vision.py", "tests/e2e/test_e2e_prefix_cache.py")


def _part(nodeid: str) -> int:
    """0: the end-to-end unit; 1: every other module; 2: the late end-to-end modules."""
    if nodeid.startswith(E2E_LATE):
        return 2
    return 0 if nodeid.startswith(E2E) else 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With pytest-xdist's two workers (`make test`): the end-to-end tests
    go to one worker as one unit, first, one after another (each runs whole
    servers; two at once would starve each other's deadlines), while the
    other worker takes the other modules, each whole (its module fixtures
    made once), then the late end-to-end modules (E2E_LATE), as one unit."""
    from xdist.scheduler import LoadScopeScheduling

    class EndToEndApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return ("e2e", "", "e2e-late")[_part(nodeid)] or nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False  # the collection's order: the end-to-end unit first
    return EndToEndApart(config, log)


def pytest_collection_modifyitems(config, items):
    """The end-to-end unit first (each part keeps its order): it is the
    longest, so it starts at once on its worker; the late end-to-end modules
    last, so the other worker takes them after its own. (Under xdist only:
    a worker has `workerinput`; a plain run keeps the files' order.)"""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: _part(item.nodeid))


@pytest.fixture(scope="session")
def embedded_model_dir():
    from workers.models.store import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def embedded_model(embedded_model_dir):
    """The embedded model loaded exactly as the workers load it (fp32 on the CPU)."""
    from workers.models.loading import load_model

    return load_model(str(embedded_model_dir))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random llama's folder (tests/support/tiny_models.py), one per test module."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def model(tiny_dir):
    """The tiny llama of `tiny_dir`, loaded (fp32, no tokenizer)."""
    return load_tiny_model(tiny_dir)


@pytest.fixture
def server_factory(tmp_path, embedded_model_dir):
    """Start servers with given flags; every one is stopped at the end of the test."""
    started: list[TandemServer] = []

    def start(*args: str, **kwargs) -> TandemServer:
        srv = TandemServer(*args, log_path=tmp_path / f"server{len(started)}.log", **kwargs)
        started.append(srv)
        return srv.start()

    yield start
    for srv in started:
        srv.stop()
