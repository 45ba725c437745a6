"""Fixtures shared by the suite: the embedded model, a tiny random llama and
real `tandem serve` instances. Helpers and fakes are in tests/support/."""

from __future__ import annotations

import pytest

from tests.support.server import TandemServer
from tests.support.tiny_models import load_tiny_model, make_tiny_llama

E2E = "tests/e2e/"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With pytest-xdist's two workers (`make test`): the end-to-end tests
    go to one worker as one unit, first, one after another (each runs whole
    servers; two at once would starve each other's deadlines), while the
    other worker takes the other modules, each whole (its module fixtures
    made once)."""
    from xdist.scheduler import LoadScopeScheduling

    class EndToEndApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "e2e" if nodeid.startswith(E2E) else nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False  # the collection's order: the end-to-end unit first
    return EndToEndApart(config, log)


def pytest_collection_modifyitems(config, items):
    """The end-to-end tests first (each part keeps its order): their unit is
    the longest, so it starts at once on its worker. (Under xdist only: a
    worker has `workerinput`; a plain run keeps the files' order.)"""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: not item.nodeid.startswith(E2E))


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
