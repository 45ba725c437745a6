"""Property-based fuzzing of the codec (hypothesis).

Values for every message type are generated from its dataclass annotations,
so a new message (or field) is covered without touching this file. Then the
attack: random bytes, random msgpack structures, and valid encodings with one
part mutated. What must not happen: decode raising anything but
ProtocolError, its last-resort catch being the one that saw the problem, or
a message that does not match its annotations getting through."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protos.codec import ProtocolError, decode, encode
from protos.messages import ALL_MESSAGES, VERSION

# A few seconds in all; no example database written into the checkout.
FUZZ = settings(deadline=None, max_examples=100, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def hints(cls) -> dict:
    return typing.get_type_hints(cls)


# ------------------------------------------------------------ valid values --

_DTYPES = [np.dtype(n) for n in ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                                 "uint64", "float16", "float32", "float64")]
_KEYS = st.text(max_size=6)
PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=3),
    max_leaves=8,
)
_SCALAR_STRATEGIES = {
    int: st.integers(-2**63, 2**64 - 1),  # msgpack's range
    float: st.floats(allow_nan=False),
    str: st.text(max_size=12),
    bytes: st.binary(max_size=40),
    bool: st.booleans(),
    type(None): st.none(),
}


def strategy(hint: Any) -> st.SearchStrategy:
    """Valid values of one annotation."""
    if hint in _SCALAR_STRATEGIES:
        return _SCALAR_STRATEGIES[hint]
    if hint is Any or hint is object:
        return PLAIN
    if hint is np.ndarray:
        return hnp.arrays(st.sampled_from(_DTYPES), hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=3))
    if hint in ALL_MESSAGES:
        return st.deferred(lambda: st.builds(hint, **{k: strategy(h) for k, h in hints(hint).items()}))
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return st.one_of([strategy(a) for a in args])
    if origin is list:
        return st.lists(strategy(args[0]), max_size=4)
    if origin is tuple:
        return st.tuples(*map(strategy, args))
    if origin is dict:
        return st.dictionaries(_KEYS, strategy(args[1]), max_size=3)
    raise AssertionError(f"no strategy for {hint!r}: teach this test (and check the codec can carry it)")


ANY_MESSAGE = st.one_of([strategy(cls) for cls in ALL_MESSAGES])


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types all the way down; arrays by dtype, shape and bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(v, b[k]) for k, v in a.items())
    return a == b


def conforms(value: Any, hint: Any, depth: int = 0) -> bool:
    """Does `value` have the type its annotation promises (written apart from the codec's readers)?"""
    if hint is Any or hint is object:
        if depth > 40:
            return False
        if isinstance(value, list):
            return all(conforms(v, Any, depth + 1) for v in value)
        if isinstance(value, dict):
            return all(type(k) is str and conforms(v, Any, depth + 1) for k, v in value.items())
        return type(value) in (int, float, str, bytes, bool, type(None))
    if hint is float:
        return type(value) in (int, float)
    if hint in _SCALAR_STRATEGIES:
        return type(value) is hint
    if hint is np.ndarray:
        return type(value) is np.ndarray and value.dtype.kind in "biuf"
    if hint in ALL_MESSAGES:
        return type(value) is hint and all(conforms(getattr(value, k), h) for k, h in hints(hint).items())
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return any(conforms(value, a) for a in args)
    if origin is list:
        return type(value) is list and all(conforms(v, args[0]) for v in value)
    if origin is tuple:
        return type(value) is tuple and len(value) == len(args) and all(map(conforms, value, args))
    if origin is dict:
        return type(value) is dict and all(type(k) is str and conforms(v, args[1]) for k, v in value.items())
    raise AssertionError(f"cannot check {hint!r}")


def decode_or_refuse(frames: list) -> Any:
    """decode's result, or None when it refused: by ProtocolError alone, raised by its own checks."""
    try:
        msg = decode(frames)
    except ProtocolError as err:
        assert err.__cause__ is None, f"only the codec's last-resort catch saw this: {err.__cause__!r}"
        return None
    assert conforms(msg, type(msg)), f"accepted a message that breaks its annotations: {msg!r}"
    return msg


# --------------------------------------------------------------- round trip --


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
def test_every_message_type_round_trips_with_generated_values(cls):
    @settings(FUZZ, max_examples=20)
    @given(strategy(cls))
    def round_trip(msg):
        frames = encode(msg)
        back = decode(frames)
        assert same(back, msg), (back, msg)
        assert same(decode([bytes(f) for f in frames]), msg)  # the same from copies, as a test sends them

    round_trip()


# ------------------------------------------------------------------ attacks --


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_random_bytes_are_refused_with_a_protocol_error(frames):
    decode_or_refuse(frames)


_BY_NAME = {cls.__name__: cls for cls in ALL_MESSAGES}
_NAMES = st.sampled_from([cls.__name__ for cls in ALL_MESSAGES])


@FUZZ
@given(st.one_of(
    PLAIN,
    st.fixed_dictionaries({"v": st.just(VERSION), "t": _NAMES, "b": st.dictionaries(_KEYS, PLAIN, max_size=4)}),
    # Bodies with the right field names and wrong (free-form) values.
    _NAMES.flatmap(lambda name: st.fixed_dictionaries({
        "v": st.just(VERSION), "t": st.just(name),
        "b": st.dictionaries(st.sampled_from(sorted(hints(_BY_NAME[name]))), PLAIN, max_size=6)
        if hints(_BY_NAME[name]) else st.just({})})),  # a message of no fields (ListModels): its one body
), st.lists(st.binary(max_size=16), max_size=2))
def test_random_msgpack_structures_are_refused_with_a_protocol_error(header, arrays):
    decode_or_refuse([msgpack.packb(header, use_bin_type=True), *arrays])


# Values an attacker puts in place of a valid part: plain data, and what the
# array descriptors and the typed fields are most likely to trip on.
HOSTILE = st.one_of(
    PLAIN,
    st.sampled_from(["O", "|O", "V8", "<U4", "<f4,<i4", "<M8[s]", "S3", "(2,)i4", "|b1", "<f8", -1, 2**63, True,
                     [-1], [2**40, 2**40], [1] * 40, [0, 2**62], [1.5], {"~t": "Nope"}, {"~a": 0},
                     {"~t": "Cancel", "request_id": "x"}, {"~a": 0, "d": "|u1", "s": [1]}, msgpack.ExtType(1, b"x")]),
)


def _paths(value: Any, path: tuple = ()) -> list:
    """Every place in a decoded header, as key paths."""
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, path + (i,))
    return out


def _mutate(tree: Any, path: tuple, op: str, new: Any) -> Any:
    if not path:
        return new
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if op == "delete" and isinstance(parent, dict):
        del parent[last]
    elif op == "add" and isinstance(parent, dict):
        parent[f"extra{len(parent)}"] = new
    elif op == "add" and isinstance(parent, list):
        parent.insert(last, new)
    else:
        parent[last] = new
    return tree


@FUZZ
@given(ANY_MESSAGE, st.data())
def test_valid_messages_with_one_part_mutated_are_refused_or_still_well_typed(msg, data):
    frames = [bytes(f) for f in encode(msg)]
    header = msgpack.unpackb(frames[0], raw=False)
    path = data.draw(st.sampled_from(_paths(header)), label="path")
    op = data.draw(st.sampled_from(["replace", "delete", "add"]), label="op")
    header = _mutate(header, path, op, data.draw(HOSTILE, label="value"))
    frames[0] = msgpack.packb(header, use_bin_type=True)
    tail = data.draw(st.sampled_from(["keep", "drop", "extra", "shorten"]), label="frames")
    if tail == "drop" and len(frames) > 1:
        frames.pop()
    elif tail == "extra":
        frames.append(b"\x00" * 8)
    elif tail == "shorten" and len(frames) > 1 and frames[-1]:
        frames[-1] = frames[-1][:-1]
    decode_or_refuse(frames)


@FUZZ
@given(ANY_MESSAGE, st.data())
def test_valid_encodings_with_flipped_bytes_are_refused_or_still_well_typed(msg, data):
    head = bytearray(encode(msg)[0])
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        i = data.draw(st.integers(0, len(head) - 1), label="at")
        head[i] = data.draw(st.integers(0, 255), label="byte")
    decode_or_refuse([bytes(head), *[bytes(f) for f in encode(msg)[1:]]])
