"""workers/kv/store_thread.py: a prefill worker's block stores off the MLX
thread. Real threads; the prefix cache is a double that records, the cache
service tests/support/cache_fakes.py's FakeCacheService. (The arena write
itself is tested in tests/workers/kv/test_prefix_cache.py, the whole path through the real
processes in the end-to-end tests, where every split prefill worker on this
machine uses the store thread.)"""

from __future__ import annotations

import threading
import time

from tests.support.cache_fakes import FakeCacheService
from workers.kv.store_thread import StoreThread


class Prefix:
    def __init__(self, fail_on=()):
        self.written = []
        self.threads = set()
        self.fail_on = set(fail_on)

    def write_store(self, prepared, client=None):
        self.threads.add(threading.get_ident())
        time.sleep(0.01)  # a copy takes a while: jobs queue up behind it
        if prepared in self.fail_on:
            raise RuntimeError("arena gone")
        self.written.append((prepared, client))
        return 1


def test_handoffs_leave_in_order_after_their_store_even_when_a_store_fails():
    prefix, client, sent = Prefix(fail_on={"p2"}), FakeCacheService(), []
    stores = StoreThread(prefix, client, lambda h: sent.append((h, [p for p, _ in prefix.written])))
    for i in range(5):
        stores.submit(f"p{i}", f"h{i}")
    stores.close(timeout_s=10)
    assert [h for h, _ in sent] == ["h0", "h1", "h2", "h3", "h4"]
    # each handoff left after its own store (p2's failed: sent all the same)
    assert sent[0][1] == ["p0"] and sent[3][1] == ["p0", "p1", "p3"]
    assert all(c is client for _, c in prefix.written)
    assert prefix.threads and threading.get_ident() not in prefix.threads
    assert client.closed


def test_a_handoff_copy_runs_first_and_a_failed_copy_sends_its_failure_instead():
    """A prefill worker's handoff tail is copied into the arena on this
    thread: before the store (which reads it) and before the handoff leaves.
    A copy that fails sends the job's failure message and stores nothing."""
    prefix, order = Prefix(), []
    stores = StoreThread(prefix, FakeCacheService(), lambda m: order.append(("sent", m, len(prefix.written))))

    def copy(name, fail=False):
        def run():
            order.append(("copied", name, len(prefix.written)))
            if fail:
                raise OSError("arena gone")
        return run

    stores.submit("p0", "h0", copy=copy("t0"), failed="f0", keep=["a0"])
    stores.submit("p1", "h1", copy=copy("t1", fail=True), failed="f1", keep=["a1"])
    stores.submit(None, "h2", copy=copy("t2"), failed="f2", keep=["a2"])  # nothing to store: still copied, then sent
    stores.close(timeout_s=10)
    # What the jobs read stays with the submitter until it lets go, on its own thread.
    assert [k for _, k in stores.kept] == [["a0"], ["a1"], ["a2"]]
    stores.release_done()
    assert not stores.kept
    assert order == [("copied", "t0", 0), ("sent", "h0", 1), ("copied", "t1", 1), ("sent", "f1", 1),
                     ("copied", "t2", 1), ("sent", "h2", 1)]
    assert [p for p, _ in prefix.written] == ["p0"]
    assert stores.finished == 3


def test_a_failing_send_does_not_stop_the_thread():
    prefix, sent = Prefix(), []

    def send(h):
        if h == "bad":
            raise OSError("socket closed")
        sent.append(h)

    stores = StoreThread(prefix, FakeCacheService(), send)
    for h in ("a", "bad", "b"):
        stores.submit(h, h)
    stores.close(timeout_s=10)
    assert sent == ["a", "b"]


def test_a_send_after_the_socket_loop_stopped_gives_up_and_close_does_not_hang():
    """Real ZeroMQ: once the I/O thread's PULL is gone, a PUSH blocks for
    ever. The store thread sends with a deadline, so neither it nor the MLX
    thread's Outbox.close (which takes the same lock) hangs at shutdown."""
    import zmq

    from protos import transport
    from protos.messages import KVHandoff
    from workers.socket_loop import _OUTBOX_ADDR, Outbox

    ctx = zmq.Context()
    pull = transport.make_socket(ctx, zmq.PULL)
    pull.bind(_OUTBOX_ADDR)
    outbox = Outbox(ctx)
    try:
        outbox.send(KVHandoff("r0", 3, 3), wait_s=1.0)
        assert pull.poll(2000) and transport.recv(pull).request_id == "r0"
        pull.close()  # the socket loop stops
        time.sleep(0.1)
        stores = StoreThread(Prefix(), FakeCacheService(), lambda h: outbox.send(h, wait_s=0.3))
        stores.submit("p", KVHandoff("r1", 3, 3))
        t0 = time.monotonic()
        stores.close(timeout_s=5)
        assert time.monotonic() - t0 < 3 and not stores._thread.is_alive()
        closed = threading.Thread(target=outbox.close)
        closed.start()
        closed.join(2)
        assert not closed.is_alive()
    finally:
        ctx.term()
