"""What a prompt's KV handoff costs through the arena vs by value over a socket.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/probes/handoff_over_socket.py [--model M] [--tokens 256 2048] [--repeats 7]

On the embedded model (float32 on the CPU backend, as the workers run it),
the KV of an N-token prompt (a real prefill) handed from a "prefill" end to
a "decode" end, both in this process, each with its own sockets, timed from
the prefill end's write_handoff to the decode end's caches evaluated:
  * arena: write_handoff into a real cache service's shared-memory arena
    (its reservation an ipc round trip), the KVHandoff of handles sent over
    an ipc DEALER -> ROUTER pair, take_in reading the arena (and freeing the
    slot) -- the single-host path;
  * by value, tcp+CURVE: write_handoff(by_value=True), the KVHandoff with
    its payload frame sent over a tcp DEALER -> ROUTER pair on 127.0.0.1
    with CURVE encryption, take_in reading the payload -- a split worker on
    another host (workers/kv/handoff.py);
  * by value, plain tcp: the same without CURVE, to show what the
    encryption costs.
One hop: between hosts the router relays the message (prefill -> router ->
decode), so a real handoff crosses two such sockets and the network's
bandwidth (1 GbE moves ~110 MB/s) besides. Prints one row per N: median ms
and the bytes moved.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import mlx.core as mx  # noqa: E402
import zmq  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from benchmarks.probes.block_size import Service  # noqa: E402
from cache_service.arena import ArenaAttachment  # noqa: E402
from protos import transport  # noqa: E402
from tests.support.server import free_port  # noqa: E402
from workers.kv import handoff  # noqa: E402
from workers.loop_clock import LoopClock  # noqa: E402
from workers.models.loading import load_model  # noqa: E402
from workers.models.store import resolve_model  # noqa: E402


def prefilled(model, n: int) -> SimpleNamespace:
    """A prefill result's shape: the KV of an n-token prompt."""
    cache = make_prompt_cache(model)
    tokens = mx.array([[(i * 37) % 1000 + 10 for i in range(n)]])
    for start in range(0, n, 512):  # in chunks, as a prefill worker runs it
        model(tokens[:, start:start + 512], cache=cache)
        mx.eval([c.state for c in cache])
    return SimpleNamespace(cache=cache, num_tokens=n, rope_offset=n)


def socket_pair(ctx, kind: str, run_dir: str):
    """(prefill end, decode end): "ipc" in `run_dir`, "curve" or "tcp" on 127.0.0.1."""
    decode = transport.make_socket(ctx, zmq.ROUTER)
    prefill = transport.make_socket(ctx, zmq.DEALER, identity="prefill")
    if kind == "curve":
        server_public, server_secret = zmq.curve_keypair()
        decode.setsockopt(zmq.CURVE_SECRETKEY, server_secret)
        decode.setsockopt(zmq.CURVE_PUBLICKEY, server_public)
        decode.setsockopt(zmq.CURVE_SERVER, 1)
        transport.curve_client(prefill, *zmq.curve_keypair(), server_public)
    address = f"tcp://127.0.0.1:{free_port()}" if kind != "ipc" else transport.ipc_address(run_dir, "probe")
    decode.bind(address)
    prefill.connect(address)
    return prefill, decode


def hand_over(result, prefill, decode, client, arenas, by_value: bool) -> float:
    """Milliseconds from writing a handoff to its caches evaluated at the other end."""
    t0 = time.perf_counter()
    h = handoff.write_handoff(client, lambda name: arenas.get(name).buf, "r", result, by_value=by_value)
    transport.send(prefill, h)
    if not decode.poll(60_000):
        raise RuntimeError("the handoff never arrived")
    _, got = transport.recv(decode, routed=True)
    cache = handoff.take_in(got, client, lambda name: arenas.get(name).buf, None, LoopClock("probe"))
    mx.eval([c.state for c in cache])
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    model, _ = load_model(str(resolve_model(args.model)))
    service = Service()
    arenas = ArenaAttachment()
    ctx = zmq.Context()
    run_dir = tempfile.mkdtemp(prefix="tprobe-")
    pairs = {kind: socket_pair(ctx, kind, run_dir) for kind in ("ipc", "curve", "tcp")}
    ways = (("arena", "ipc", False), ("by value, tcp+CURVE", "curve", True), ("by value, plain tcp", "tcp", True))
    print(f"{'tokens':>7} {'KV MB':>7} " + " ".join(f"{name + ' ms':>24}" for name, _, _ in ways))
    try:
        for n in args.tokens:
            result = prefilled(model, n)
            nbytes = handoff.kv_nbytes(result.cache)
            row = []
            for _, kind, by_value in ways:
                hand_over(result, *pairs[kind], service.client, arenas, by_value)  # warm-up
                row.append(statistics.median(hand_over(result, *pairs[kind], service.client, arenas, by_value)
                                             for _ in range(args.repeats)))
            print(f"{n:>7} {nbytes / 1e6:>7.1f} " + " ".join(f"{ms:>24.2f}" for ms in row))
    finally:
        ctx.destroy(linger=0)
        arenas.close()
        service.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(service.settings.run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
