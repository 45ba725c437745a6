"""Fixtures shared by the suite: the embedded model, a tiny random llama and
real `tandem serve` instances. Helpers and fakes are in tests/support/."""

from __future__ import annotations

import pytest

from tests.support.server import TandemServer
from tests.support.tiny_models import load_tiny_model, make_tiny_llama

E2E = "tests/e2e/"
# End-to-end modules that run last, each a unit of its own, longest first, so
# whichever worker is free takes the next: modules without kills or tight
# deadlines, so a second server beside the end-to-end unit's is safe. A full
# run (base 823b37d, two workers, seconds from its first test): the end-to-end
# unit (faults, pipeline, groups, remote workers, the model service's modules)
# done at 529 s, the other worker's modules at 478 s, then the late modules as
# one unit until 634 s on that worker alone, the first idle for 105 s. With
# three workers, these modules and the pipeline's queued first instead (three
# servers at once from the start) gained nothing: 541, 542 s in fresh clones
# against 492-552 s so.
E2E_LATE = ("tests/e2e/test_e2e_agents.py", "tests/e2e/test_e2e_prefix_cache.py", "tests/e2e/test_e2e_vision.py",
            "tests/e2e/test_many_models.py", "tests/e2e/test_ollama_client.py", "tests/e2e/test_embeddings.py")


def _part(nodeid: str) -> tuple[int, int]:
    """(0, 0): the end-to-end unit; (1, 0): every other module; (2, i): the i-th late end-to-end module."""
    for i, module in enumerate(E2E_LATE):
        if nodeid.startswith(module):
            return 2, i
    return (0, 0) if nodeid.startswith(E2E) else (1, 0)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With pytest-xdist's workers (`make test`: three): the end-to-end tests
    go to one worker as one unit, first, one after another (each runs whole
    servers; two at once would starve each other's deadlines), while the
    other workers take the other modules, each whole (its module fixtures
    made once); then the late end-to-end modules (E2E_LATE), each whole, go
    to whichever worker is free first."""
    from xdist.scheduler import LoadScopeScheduling

    class EndToEndApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "e2e" if _part(nodeid) == (0, 0) else nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False  # the collection's order: the end-to-end unit first
    return EndToEndApart(config, log)


def pytest_collection_modifyitems(config, items):
    """The end-to-end unit first (each part keeps its order): it is the
    longest, so it starts at once on its worker; the late end-to-end modules
    last, longest first. (Under xdist only: a worker has `workerinput`; a
    plain run keeps the files' order.)"""
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
