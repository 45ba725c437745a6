"""The one message codec: dataclass <-> ZeroMQ frames.

Frame 0 is msgpack `{"v": VERSION, "t": type name, "b": body}`; every numpy
array in the body is replaced by `{"~a": index, "d": dtype, "s": shape}` and
sent as its own frame (`copy=False` on send, `np.frombuffer` on receive: no
copies, no pickle). Nested messages are `{"~t": type name, ...fields}`.

`decode` trusts nothing: it reads the body against the dataclass annotations
(list elements included), takes arrays only of plain numeric dtypes whose
shape matches their frame's bytes, bounds the depth of free-form data, and
raises `ProtocolError`, never anything else, on any input it cannot trust:
a receiver logs it and carries on (protos/transport.py).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Callable, Union

import msgpack
import numpy as np

from protos.messages import ALL_MESSAGES, VERSION


class ProtocolError(ValueError):
    """A message of an unknown version, type or shape."""


_BY_NAME = {cls.__name__: cls for cls in ALL_MESSAGES}

# ----------------------------------------------------------------- encoding --

_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})  # msgpack's own (np.generic is not)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}  # a dataclass's field names, looked up once per class


def _pack(value: Any, arrays: list) -> Any:
    cls = type(value)
    names = _FIELD_NAMES.get(cls)
    if names is None and dataclasses.is_dataclass(value):
        # A handoff's 2 slices a layer made `dataclasses.fields` per slice
        # most of its encoding (~0.9 ms for 32 layers).
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(value))
    if names is not None:
        out = {"~t": cls.__name__}
        for name in names:
            out[name] = _pack(getattr(value, name), arrays)
        return out
    if isinstance(value, np.ndarray):
        arr = value if value.flags.c_contiguous else np.ascontiguousarray(value)  # (which makes 0-d 1-d)
        arrays.append(arr)
        return {"~a": len(arrays) - 1, "d": arr.dtype.str, "s": list(arr.shape)}
    if isinstance(value, (list, tuple)):
        # Token lists are most of a request's bytes: msgpack takes a list of
        # scalars as it is, without a Python call per element.
        if set(map(type, value)) <= _SCALARS:
            return value if type(value) is list else list(value)
        return [_pack(v, arrays) for v in value]
    if isinstance(value, dict):
        return {str(k): _pack(v, arrays) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def encode(msg: Any) -> list:
    """A message dataclass -> list of frames for `socket.send_multipart`."""
    if _BY_NAME.get(type(msg).__name__) is not type(msg):
        raise ProtocolError(f"not a wire message: {type(msg).__name__}")
    arrays: list = []
    body = _pack(msg, arrays)
    body.pop("~t")
    header = msgpack.packb({"v": VERSION, "t": type(msg).__name__, "b": body}, use_bin_type=True)
    return [header, *[memoryview(a).cast("B") if a.size else b"" for a in arrays]]


# ---------------------------------------------------------- decoding limits --

_MAX_DEPTH = 32  # nesting of free-form data (KVHandoff.cache_meta, CacheReply.stats)
_MAX_NDIM = 8  # an array's dimensions (a video is [T, H, W, 3])
_MAX_DIM = 1 << 31  # one dimension's length
_MAX_SHOWN = 60  # characters of a hostile value an error message repeats

# Plain numbers only: no object ("O": pickle), void or structured, string or
# time dtypes. Keyed by numpy's dtype.str, as the encoder writes it.
_DTYPES = {
    np.dtype(name).newbyteorder(order).str: np.dtype(name).newbyteorder(order)
    for name in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "float16", "float32", "float64")
    for order in "<>"
}


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN] + "..."


def _wrong(where: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError(f"{where}: expected {expected}, got {type(value).__name__}")


class _Frames:
    """The array frames of one message, and which of them were taken."""

    __slots__ = ("frames", "used")

    def __init__(self, frames: list):
        self.frames = frames
        self.used: set = set()

    def take(self, index: Any, where: str) -> memoryview:
        if type(index) is not int or not 0 <= index < len(self.frames) or index in self.used:
            raise ProtocolError(f"{where}: array frame {_show(index)} is missing or taken twice")
        self.used.add(index)
        return _buffer(self.frames[index], where)


def _buffer(frame: Any, where: str) -> memoryview:
    if hasattr(frame, "buffer"):  # a zmq.Frame
        frame = frame.buffer
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{where}: a frame is a {type(frame).__name__}, not bytes")
    return memoryview(frame)


# ---------------------------------------------------------- readers by type --
# A reader takes one wire value and where it sits (for the error), and returns
# the value the dataclass field gets, or raises ProtocolError. Each message's
# readers are built once from its annotations (_READERS, at import).

Reader = Callable[[Any, _Frames, str], Any]
# Scalar annotations -> the wire types they take (exact: a bool is no int; a float field takes an int).
_EXACT = {int: frozenset({int}), float: frozenset({int, float}), str: frozenset({str}),
          bytes: frozenset({bytes}), bool: frozenset({bool}), type(None): frozenset({type(None)})}
_STR = _EXACT[str]


def _scalar_reader(hint: type) -> Reader:
    allowed = _EXACT[hint]

    def read(value: Any, frames: _Frames, where: str) -> Any:
        if type(value) in allowed:  # exact types: a bool is no int
            return value
        raise _wrong(where, hint.__name__, value)

    return read


def _list_reader(item_hint: Any) -> Reader:
    allowed = _EXACT.get(item_hint)
    if allowed is not None:
        # Token lists: one C-level pass over the element types, no Python
        # call per element (they are most of a request's bytes).
        def read_scalars(value: Any, frames: _Frames, where: str) -> list:
            if type(value) is not list:
                raise _wrong(where, "list", value)
            if set(map(type, value)) <= allowed:
                return value
            i, bad = next((i, v) for i, v in enumerate(value) if type(v) not in allowed)
            raise _wrong(f"{where}[{i}]", item_hint.__name__, bad)

        return read_scalars
    item = _reader(item_hint)

    def read(value: Any, frames: _Frames, where: str) -> list:
        if type(value) is not list:
            raise _wrong(where, "list", value)
        return [item(v, frames, f"{where}[]") for v in value]

    return read


def _tuple_reader(item_hints: tuple) -> Reader:
    items = [_reader(h) for h in item_hints]

    def read(value: Any, frames: _Frames, where: str) -> tuple:
        if type(value) is not list or len(value) != len(items):
            raise _wrong(where, f"a list of {len(items)}", value)
        return tuple(item(v, frames, f"{where}[{i}]") for i, (item, v) in enumerate(zip(items, value)))

    return read


def _dict_reader(key_hint: Any, value_hint: Any) -> Reader:
    if key_hint is not str:
        raise TypeError(f"the codec carries maps with str keys only, not {key_hint!r}")
    item = _reader(value_hint)
    scalars = _EXACT.get(value_hint)

    def read(value: Any, frames: _Frames, where: str) -> dict:
        if type(value) is not dict:
            raise _wrong(where, "map", value)
        if not set(map(type, value)) <= _STR:
            raise ProtocolError(f"{where}: a map key is not a string")
        if scalars is not None and set(map(type, value.values())) <= scalars:
            return value
        return {k: item(v, frames, f"{where}[{_show(k)}]") for k, v in value.items()}

    return read


def _union_reader(hints: tuple) -> Reader:
    optional = type(None) in hints
    options = [_reader(h) for h in hints if h is not type(None)]

    def read(value: Any, frames: _Frames, where: str) -> Any:
        if value is None and optional:
            return None
        if len(options) == 1:
            return options[0](value, frames, where)
        for option in options:
            try:
                return option(value, frames, where)
            except ProtocolError:
                continue
        raise _wrong(where, " or ".join(getattr(h, "__name__", str(h)) for h in hints), value)

    return read


def _read_plain(value: Any, frames: _Frames, where: str, depth: int = 0) -> Any:
    """Free-form data (an `Any` field): msgpack's own values, nested at most
    _MAX_DEPTH deep; no arrays or messages inside."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if depth >= _MAX_DEPTH:
        raise ProtocolError(f"{where}: nested more than {_MAX_DEPTH} deep")
    if kind is list:
        if set(map(type, value)) <= _SCALARS:
            return value
        return [_read_plain(v, frames, where, depth + 1) for v in value]
    if kind is dict:
        if not set(map(type, value)) <= _STR:
            raise ProtocolError(f"{where}: a map key is not a string")
        return {k: _read_plain(v, frames, where, depth + 1) for k, v in value.items()}
    raise _wrong(where, "plain data", value)


def _read_array(value: Any, frames: _Frames, where: str) -> np.ndarray:
    if type(value) is not dict or value.keys() != {"~a", "d", "s"}:
        raise ProtocolError(f"{where}: not an array descriptor (~a, d, s)")
    dtype = _DTYPES.get(value["d"]) if type(value["d"]) is str else None
    if dtype is None:
        raise ProtocolError(f"{where}: array dtype {_show(value['d'])} is not a plain number type")
    shape = value["s"]
    if (type(shape) is not list or len(shape) > _MAX_NDIM
            or not all(type(n) is int and 0 <= n < _MAX_DIM for n in shape)):
        raise ProtocolError(f"{where}: bad array shape {_show(shape)}")
    buf = frames.take(value["~a"], where)
    if math.prod(shape) * dtype.itemsize != buf.nbytes:
        raise ProtocolError(f"{where}: shape {shape} of {dtype} does not fit its frame of {buf.nbytes} bytes")
    try:
        return np.frombuffer(buf, dtype=dtype).reshape(shape)
    except ValueError as exc:  # numpy's own size limits
        raise ProtocolError(f"{where}: bad array ({exc})") from None


def _message_reader(cls: type) -> Reader:
    name = cls.__name__

    def read(value: Any, frames: _Frames, where: str) -> Any:
        if type(value) is not dict:
            raise _wrong(where, name, value)
        tag = value.get("~t")
        if tag != name:
            raise ProtocolError(f"{where}: expected {name}, got message type {_show(tag)}")
        return _build(cls, value, frames, where, nested=True)

    return read


def _reader(hint: Any) -> Reader:
    """The reader for one annotation; TypeError for one the wire cannot carry."""
    if hint is Any or hint is object:
        return _read_plain
    if hint in _EXACT:
        return _scalar_reader(hint)
    if hint is np.ndarray:
        return _read_array
    if hint in ALL_MESSAGES:
        return _message_reader(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union or origin is types.UnionType:
        return _union_reader(args)
    if hint is list or origin is list:
        return _list_reader(args[0] if args else Any)
    if origin is tuple and args and Ellipsis not in args:
        return _tuple_reader(args)
    if hint is dict or origin is dict:
        return _dict_reader(*(args or (str, Any)))
    raise TypeError(f"the codec cannot carry a {hint!r}")


def _field_readers(cls: type) -> dict[str, Reader]:
    hints = typing.get_type_hints(cls)  # in the class's own module (protos/messages.py lists them)
    return {f.name: _reader(hints[f.name]) for f in dataclasses.fields(cls)}


# Built at import: a message whose annotations the codec cannot read fails loudly here.
_READERS: dict[type, dict[str, Reader]] = {cls: _field_readers(cls) for cls in ALL_MESSAGES}


# ----------------------------------------------------------------- decoding --


def _build(cls: type, body: dict, frames: _Frames, where: str, nested: bool = False) -> Any:
    readers = _READERS[cls]
    kwargs = {}
    for key, raw in body.items():
        if nested and key == "~t":
            continue
        reader = readers.get(key) if type(key) is str else None
        if reader is None:
            raise ProtocolError(f"{where}: {cls.__name__} has no field {_show(key)}")
        kwargs[key] = reader(raw, frames, f"{where}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as exc:  # missing required fields
        raise ProtocolError(f"{where}: {cls.__name__}: {exc}") from None


def _header(frames: Any) -> dict:
    if type(frames) not in (list, tuple) or not frames:
        raise ProtocolError("empty message")
    head = frames[0]
    head = head.bytes if hasattr(head, "bytes") else head
    if not isinstance(head, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"header frame is a {type(head).__name__}, not bytes")
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable header: {_show(exc)}") from None
    if type(header) is not dict or "v" not in header:
        raise ProtocolError("header lacks a version")
    version = header["v"]
    if type(version) is not int or version != VERSION:
        raise ProtocolError(f"unsupported protocol version {_show(version)} (this side speaks {VERSION})")
    if header.keys() != {"v", "t", "b"}:
        raise ProtocolError(f"header has keys {_show(sorted(map(str, header)))}, not v, t, b")
    return header


def decode(frames: list) -> Any:
    """Frames from `socket.recv_multipart(copy=False)` (or bytes) -> message.
    ProtocolError, and nothing else, for anything it cannot trust."""
    try:
        header = _header(frames)
        name, body = header["t"], header["b"]
        cls = _BY_NAME.get(name) if type(name) is str else None
        if cls is None:
            raise ProtocolError(f"unknown message type {_show(name)}")
        if type(body) is not dict:
            raise _wrong(name, "a map of fields", body)
        arrays = _Frames(frames[1:])
        msg = _build(cls, body, arrays, name)
        if len(arrays.used) != len(arrays.frames):
            raise ProtocolError(f"{name}: {len(arrays.frames) - len(arrays.used)} frames no field refers to")
        return msg
    except ProtocolError:
        raise
    except Exception as exc:  # a case the checks above missed (a bug): still the sender's fault
        raise ProtocolError(f"malformed message ({type(exc).__name__}: {_show(exc)})") from exc
