"""Fixtures shared by the suite: the embedded model and real `tandem serve` instances."""

from __future__ import annotations

import pytest

from tests.server_harness import TandemServer


@pytest.fixture(scope="session")
def embedded_model_dir():
    from workers.model_store import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def embedded_model(embedded_model_dir):
    """The embedded model loaded exactly as the workers load it (fp32 on the CPU)."""
    from workers.loading import load_model

    return load_model(str(embedded_model_dir))


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


def module_server(request, tmp_path_factory, *args: str) -> TandemServer:
    """A server shared by one test module (set-up costs seconds; most tests only read)."""
    srv = TandemServer(*args, log_path=tmp_path_factory.mktemp("srv") / "server.log")
    request.addfinalizer(srv.stop)
    return srv.start()
