"""The wire contract: messages round-trip, arrays travel out of band, and
anything untrustworthy is rejected with ProtocolError (never a crash). Every
message type under generated values and hostile input: test_codec_fuzz.py."""

import logging

import msgpack
import numpy as np
import pytest
import zmq

from protos import transport
from protos.codec import ProtocolError, decode, encode
from protos.messages import (
    VERSION, ArenaSlice, Cancel, DecodeRequest, ImageInput, KVHandoff, SamplingParams, TokenBatch, TokenLogprob,
    TokenUpdate, WorkerHello,
)
from workers.socket_loop import SocketLoop


def test_nested_messages_round_trip():
    msg = DecodeRequest("r1", [1, 2, 3], 5,
                        KVHandoff("r1", 3, 3, arena="a", allocation=4,
                                  layers=[[ArenaSlice(0, 12, "float32", [1, 1, 3, 1]), ArenaSlice(64, 12, "float32", [1, 1, 3, 1])]]),
                        SamplingParams(temperature=0.0, seed=3, logit_bias={"5": -100.0}))
    back = decode(encode(msg))
    assert back == msg and isinstance(back.handoff.layers[0][0], ArenaSlice)
    batch = TokenBatch([TokenUpdate("a", 3, TokenLogprob(3, -0.25, [(3, -0.25), (9, -2.0)]), "stop")])
    assert decode(encode(batch)) == batch


def test_token_lists_pack_as_they_are_and_numpy_scalars_still_become_numbers():
    tokens = list(range(5000))
    msg = DecodeRequest("r", tokens, 5, KVHandoff("r", 3, 3), SamplingParams())
    back = decode(encode(msg))
    assert back == msg and type(back.prompt_tokens[0]) is int
    # A list holding numpy scalars takes the element-wise path and arrives as ints.
    mixed = DecodeRequest("r", [np.int32(4), 5, np.int64(6)], 5, KVHandoff("r", 3, 3), SamplingParams())
    assert decode(encode(mixed)).prompt_tokens == [4, 5, 6]
    # One that is not all ints is refused at the receiver, whatever the sender packed.
    nested = DecodeRequest("r", [4, 5, (6, 7)], 5, KVHandoff("r", 3, 3), SamplingParams())
    with pytest.raises(ProtocolError, match=r"prompt_tokens\[2\]: expected int, got list"):
        decode(encode(nested))


def test_arrays_travel_as_their_own_frames():
    # An array is never inside the msgpack header.
    arr = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    assert len(encode(TokenBatch([TokenUpdate("a", 1, None, None)]))) == 1
    frames = encode(ImageInput("aa" * 32, arr, 3, 4))
    assert len(frames) == 2 and len(frames[0]) < 200
    back = decode([bytes(f) for f in frames])
    np.testing.assert_array_equal(back.pixels, arr)
    assert back.pixels.dtype == np.uint8 and not back.pixels.flags.writeable  # a view of the frame


def test_a_video_travels_as_one_media_input():
    """A video (Qwen3-VL) is one ImageInput: kind, its frames as one
    out-of-band array, its sampling and frame times, and a span over all
    its blocks."""
    from protos.messages import ImageInput, VisionRequest

    frames = np.arange(2 * 4 * 6 * 3, dtype=np.uint8).reshape(2, 4, 6, 3)
    msg = VisionRequest("r", [ImageInput("aa" * 32, frames[0], 3, 4),
                              ImageInput("bb" * 32, frames, 10, 12, "video", 1.6, [0.0, 0.6], 21)])
    wire = encode(msg)
    assert len(wire) == 3
    image, video = decode([bytes(f) for f in wire]).images
    assert (image.kind, image.end, video.kind, video.fps, video.timestamps, video.end) == (
        "image", 7, "video", 1.6, [0.0, 0.6], 31)
    np.testing.assert_array_equal(video.pixels, frames)


def _wire(name, body, *frames, header=None):
    """Frames of a hand-made message: what a broken or hostile peer sends."""
    return [msgpack.packb(header if header is not None else {"v": VERSION, "t": name, "b": body}), *frames]


def _pixels(d="|u1", s=(2, 2, 3), index=0, **extra):
    """An ImageInput body whose pixels descriptor says `d`, `s`, `index`."""
    desc = {"~a": index, "d": d, "s": list(s) if isinstance(s, tuple) else s, **extra}
    return {"content_hash": "aa", "pixels": desc}


_DEEP = [[[]]]
for _ in range(100):
    _DEEP = [_DEEP]
_RGB = bytes(12)


@pytest.mark.parametrize("frames, why", [
    (_wire("Cancel", {"request_id": "x"}, header={"v": VERSION + 1, "t": "Cancel", "b": {"request_id": "x"}}), "version"),
    (_wire("", {}, header={"v": True, "t": "Cancel", "b": {"request_id": "x"}}), "version"),  # True == 1
    (_wire("", {}, header={"t": "Cancel"}), "version"),
    (_wire("", {}, header={"v": VERSION, "t": "Cancel"}), "not v, t, b"),  # no body
    (_wire("", {}, header={"v": VERSION, "t": "Cancel", "b": {"request_id": "x"}, "x": 1}), "not v, t, b"),
    (_wire("", {}, header={"v": VERSION, "t": ["Cancel"], "b": {}}), "unknown message type"),
    (_wire("Nope", {}), "unknown message type"),
    (_wire("Cancel", []), "map of fields"),
    (_wire("Cancel", {"request_id": 3}), "expected str"),
    (_wire("", {}, header={"v": VERSION, "t": "Cancel", "b": {1: "x"}}), "undecodable header"),  # msgpack's own check
    (_wire("Cancel", {}), "missing"),
    (_wire("Cancel", {"request_id": "x", "extra": 1}), "no field"),
    (_wire("Cancel", {"request_id": "x", "~t": "Cancel"}), "no field"),
    (_wire("TokenBatch", {"updates": "notalist"}), "expected list"),
    # List elements are checked against the annotation.
    (_wire("SamplingParams", {"stop_token_ids": ["a", None]}), r"stop_token_ids\[0\]: expected int, got str"),
    (_wire("SamplingParams", {"stop_token_ids": [1, True]}), r"stop_token_ids\[1\]: expected int, got bool"),
    (_wire("SamplingParams", {"logit_bias": {"5": "high"}}), "expected float, got str"),
    (_wire("TokenBatch", {"updates": [{"~t": "TokenUpdate", "request_id": "a", "token": 1}, 5]}), "expected TokenUpdate"),
    (_wire("TokenBatch", {"updates": [{"~t": "Cancel", "request_id": "a"}]}), "expected TokenUpdate, got message type 'Cancel'"),
    (_wire("TokenBatch", {"updates": [{"request_id": "a", "token": 1}]}), "expected TokenUpdate, got message type None"),
    (_wire("PrefillDone", {"request_id": "a", "first_token": 1, "handoff": {"~t": "Nope"}}), "expected KVHandoff"),
    (_wire("KVLookup", {"call_id": 1, "hashes": [b"h" * 32, "x"], "owner": "o"}), r"hashes\[1\]: expected bytes"),
    (_wire("TokenLogprob", {"token": 1, "logprob": 0.0, "top": [[1, 0.5, 3]]}), "a list of 2"),
    (_wire("TokenLogprob", {"token": 1, "logprob": 0.0, "top": [[0.5, 1]]}), "expected int, got float"),
    (_wire("KVHandoff", {"request_id": "a", "num_tokens": 1, "rope_offset": 1, "layers": [[{"offset": 1}]]}),
     "expected ArenaSlice"),
    # Free-form data (Any) is bounded in depth, has string keys, holds no foreign objects.
    (_wire("CacheReply", {"call_id": 1, "ok": True, "stats": {"a": _DEEP}}), "nested more than"),
    (_wire("KVHandoff", {"request_id": "a", "num_tokens": 1, "rope_offset": 1, "cache_meta": [{"a": {b"k": 2}}]}),
     "key is not a string"),
    (_wire("CacheReply", {"call_id": 1, "ok": True, "stats": {"a": msgpack.ExtType(5, b"x")}}), "plain data"),
    # Array descriptors: every part present and sane, dtypes plain numbers only, one frame each.
    (_wire("ImageInput", {"content_hash": "aa", "pixels": {"~a": 0}}, _RGB), "not an array descriptor"),
    (_wire("ImageInput", {"content_hash": "aa", "pixels": {"~a": 0, "s": [12]}}, _RGB), "not an array descriptor"),
    (_wire("ImageInput", {"content_hash": "aa", "pixels": {"~a": 0, "d": "|u1"}}, _RGB), "not an array descriptor"),
    (_wire("ImageInput", _pixels(extra=1), _RGB), "not an array descriptor"),
    (_wire("ImageInput", _pixels(d="O", s=(1,)), bytes(8)), "not a plain number type"),  # pickle
    (_wire("ImageInput", _pixels(d="|O", s=(1,)), bytes(8)), "not a plain number type"),
    (_wire("ImageInput", _pixels(d="|V12", s=(1,)), _RGB), "not a plain number type"),
    (_wire("ImageInput", _pixels(d="<f4,<i4", s=(1,)), bytes(8)), "not a plain number type"),
    (_wire("ImageInput", _pixels(d="<U3", s=(1,)), _RGB), "not a plain number type"),
    (_wire("ImageInput", _pixels(d="<M8[s]", s=(1,)), bytes(8)), "not a plain number type"),
    (_wire("ImageInput", _pixels(d=["|u1"]), _RGB), "not a plain number type"),
    (_wire("ImageInput", _pixels(s=(-2, -2, 3)), _RGB), "bad array shape"),
    (_wire("ImageInput", _pixels(s=(2**62, 2**62, 0)), b""), "bad array shape"),
    (_wire("ImageInput", _pixels(s=[1] * 40), b"x"), "bad array shape"),
    (_wire("ImageInput", _pixels(s=(2, 2.0, 3)), _RGB), "bad array shape"),
    (_wire("ImageInput", _pixels(s="12"), _RGB), "bad array shape"),
    (_wire("ImageInput", _pixels(s=(4, 4, 3)), _RGB), "does not fit its frame"),
    (_wire("ImageInput", _pixels(d="<f8"), _RGB), "does not fit its frame"),
    (_wire("ImageInput", _pixels()), "missing or taken twice"),  # no frame
    (_wire("ImageInput", _pixels(index=-1), _RGB), "missing or taken twice"),
    (_wire("ImageInput", _pixels(index=True), _RGB), "missing or taken twice"),
    (_wire("ImageInput", _pixels(), _RGB, _RGB), "1 frames no field refers to"),
    (_wire("VisionRequest", {"request_id": "r", "images": [{"~t": "ImageInput", **_pixels()}] * 2}, _RGB), "taken twice"),
])
def test_bad_messages_are_rejected(frames, why):
    with pytest.raises(ProtocolError, match=why) as err:
        decode(frames)
    assert err.value.__cause__ is None, "the codec's own checks missed it; only its last-resort catch saw it"


def test_garbage_is_rejected():
    for frames in ([], None, "text", [None], [7], [b"\xc1\xc1garbage"], [msgpack.packb([1, 2, 3])],
                   [b"\x91" * 100_000 + b"\xc0"], [msgpack.packb({"v": VERSION, "t": "Cancel", "b": {b"k": 1}})]):
        with pytest.raises(ProtocolError):
            decode(frames)


def test_unwrap_never_raises_and_a_flood_of_bad_frames_is_logged_a_few_times(caplog):
    bad = [[], [b"peer"], [b"peer", b"\xc1"], [zmq.Frame(b"peer")], [7, b"x"], [b"peer", *_wire("Cancel", {})]]
    for frames in bad:
        assert transport._unwrap(frames, routed=True)[1] is None
        assert transport._unwrap(frames, routed=False) is None
    assert transport._unwrap([b"peer", *encode(Cancel("x"))], routed=True) == (b"peer", Cancel("x"))

    clock = [0.0]
    rejects = transport.RejectLog(limit=3, window_s=60.0, clock=lambda: clock[0])
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="protos.transport"):
        for _ in range(1000):
            rejects(b"peer", ProtocolError("bad"))
        assert len(caplog.records) == 3
        clock[0] = 61.0
        rejects(b"peer", ProtocolError("bad"))
    assert rejects.total == 1001
    assert [r.getMessage() for r in caplog.records[3:]] == [
        "997 more rejected messages were not logged", "rejected message from b'peer': bad"]


def test_receiver_survives_bad_messages_over_a_real_socket(tmp_path):
    ctx = zmq.Context()
    try:
        pull = transport.make_socket(ctx, zmq.PULL)
        addr = transport.ipc_address(str(tmp_path), "t")
        pull.bind(addr)
        push = transport.make_socket(ctx, zmq.PUSH)
        push.connect(addr)
        push.send_multipart([b"garbage"])
        push.send_multipart([msgpack.packb({"v": 99, "t": "Cancel", "b": {"request_id": "x"}})])
        transport.send(push, Cancel("ok"))
        assert pull.poll(5000)
        got = [transport.recv(pull) for _ in range(3)]
        assert got == [None, None, Cancel("ok")]
    finally:
        ctx.destroy(linger=0)


class _NotAMessage:
    """A hello the socket loop cannot copy: a stand-in for a bug that kills it."""

    state = "ready"


def test_a_workers_socket_loop_drops_bad_frames_and_its_death_stops_the_worker(tmp_path):
    ctx = zmq.Context()
    try:
        router = transport.make_socket(ctx, zmq.ROUTER)
        addr = transport.ipc_address(str(tmp_path), "router")
        router.bind(addr)
        loop = SocketLoop(ctx, addr, WorkerHello("w0", ["decode"], 1, "ready"), interval_s=0.05)
        loop.start()
        assert router.poll(5000)
        peer, hello = transport.recv(router, routed=True)
        assert peer == b"w0" and hello.worker_id == "w0"
        for frames in ([b"garbage"], [b""], _wire("Cancel", {"request_id": {"~a": 0, "s": [1]}}, b"x"),
                       _wire("DecodeRequest", {"request_id": "r", "prompt_tokens": [1, "2"]})):
            router.send_multipart([peer, *frames])
        transport.send(router, Cancel("ok"), to=peer)
        assert loop.inbox.get(timeout=5) == Cancel("ok") and loop.inbox.empty()
        assert loop.is_alive() and loop.error is None

        loop.hello = _NotAMessage()  # its next heartbeat fails
        assert loop.inbox.get(timeout=5) is None  # the worker's stop signal: it exits, non-zero (workers/main.py)
        loop.join(5)
        assert not loop.is_alive() and isinstance(loop.error, TypeError)
    finally:
        ctx.destroy(linger=0)
