"""The wire contract: every message round-trips, arrays travel out of band,
and anything untrustworthy is rejected with ProtocolError (never a crash)."""

import dataclasses

import msgpack
import numpy as np
import pytest
import zmq

from protos import transport
from protos.codec import ProtocolError, decode, encode
from protos.messages import (
    ALL_MESSAGES, VERSION, ArenaSlice, Cancel, DecodeRequest, KVHandoff, SamplingParams, TokenBatch,
    TokenLogprob, TokenUpdate,
)


def _example(cls):
    """An instance of `cls` with every required field filled by its type."""
    fillers = {"int": 7, "str": "x", "float": 0.5, "bool": True, "list": [1, 2], "dict": {"a": 1}, "bytes": b"\x00" * 32}
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            t = str(f.type)
            if t in fillers:
                kwargs[f.name] = fillers[t]
            elif t == "SamplingParams":
                kwargs[f.name] = SamplingParams()
            elif t in ("KVHandoff", "Optional[KVHandoff]"):
                kwargs[f.name] = KVHandoff("r", 3, 3)
            else:
                raise AssertionError(f"no filler for {cls.__name__}.{f.name}: {t}")
    return cls(**kwargs)


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
def test_every_message_round_trips(cls):
    msg = _example(cls)
    assert decode(encode(msg)) == msg


def test_nested_messages_round_trip():
    msg = DecodeRequest("r1", [1, 2, 3], 5,
                        KVHandoff("r1", 3, 3, arena="a", allocation=4,
                                  layers=[[ArenaSlice(0, 12, "float32", [1, 1, 3, 1]), ArenaSlice(64, 12, "float32", [1, 1, 3, 1])]]),
                        SamplingParams(temperature=0.0, seed=3, logit_bias={"5": -100.0}))
    back = decode(encode(msg))
    assert back == msg and isinstance(back.handoff.layers[0][0], ArenaSlice)
    batch = TokenBatch([TokenUpdate("a", 3, TokenLogprob(3, -0.25, [[3, -0.25], [9, -2.0]]), "stop")])
    assert decode(encode(batch)) == batch


def test_token_lists_pack_as_they_are_and_numpy_scalars_still_become_numbers():
    tokens = list(range(5000))
    msg = DecodeRequest("r", tokens, 5, KVHandoff("r", 3, 3), SamplingParams())
    back = decode(encode(msg))
    assert back == msg and type(back.prompt_tokens[0]) is int
    # A list holding numpy scalars or tuples takes the element-wise path.
    mixed = DecodeRequest("r", [np.int32(4), 5, (6, 7)], 5, KVHandoff("r", 3, 3), SamplingParams())
    assert decode(encode(mixed)).prompt_tokens == [4, 5, [6, 7]]


def test_arrays_travel_as_their_own_frames():
    # Any message field may carry a numpy array; it is never inside the msgpack header.
    arr = np.arange(1000, dtype=np.float32).reshape(10, 100)
    assert len(encode(TokenBatch([TokenUpdate("a", 1, None, None)]))) == 1
    frames = encode(TokenLogprob(1, 0.0, top=[arr]))
    assert len(frames) == 2 and len(frames[0]) < 200
    back = decode([bytes(f) for f in frames])
    np.testing.assert_array_equal(back.top[0], arr)


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


@pytest.mark.parametrize("header, why", [
    ({"v": VERSION + 1, "t": "Cancel", "b": {"request_id": "x"}}, "version"),
    ({"v": VERSION, "t": "Nope", "b": {}}, "unknown message type"),
    ({"v": VERSION, "t": "Cancel", "b": {"request_id": 3}}, "expected str"),
    ({"v": VERSION, "t": "Cancel", "b": {}}, "missing"),
    ({"v": VERSION, "t": "Cancel", "b": {"request_id": "x", "extra": 1}}, "no field"),
    ({"v": VERSION, "t": "TokenBatch", "b": {"updates": "notalist"}}, "expected list"),
    ({"t": "Cancel"}, "version"),
])
def test_bad_messages_are_rejected(header, why):
    with pytest.raises(ProtocolError, match=why):
        decode([msgpack.packb(header)])


def test_garbage_is_rejected():
    for frames in ([], [b"\xc1\xc1garbage"], [msgpack.packb([1, 2, 3])]):
        with pytest.raises(ProtocolError):
            decode(frames)


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
