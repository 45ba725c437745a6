"""The one message codec: dataclass <-> ZeroMQ frames.

Frame 0 is msgpack `{"v": VERSION, "t": type name, "b": body}`; every numpy
array in the body is replaced by `{"~a": index, "d": dtype, "s": shape}` and
sent as its own frame (`copy=False` on send, `np.frombuffer` on receive: no
copies, no pickle). Nested messages are `{"~t": type name, ...fields}`.

`decode` checks the version, the type name, and every field's type against the
dataclass annotations, and raises `ProtocolError` (never anything else) on a
message it cannot trust: a receiver logs it and carries on.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Union

import msgpack
import numpy as np

from protos import messages as _messages
from protos.messages import ALL_MESSAGES, VERSION


class ProtocolError(ValueError):
    """A message of an unknown version, type or shape."""


_BY_NAME = {cls.__name__: cls for cls in ALL_MESSAGES}
_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls, vars(_messages))
        _HINTS[cls] = hints
    return hints


# ----------------------------------------------------------------- encoding --

_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})  # msgpack's own (np.generic is not)


def _pack(value: Any, arrays: list) -> Any:
    if dataclasses.is_dataclass(value):
        out = {"~t": type(value).__name__}
        for f in dataclasses.fields(value):
            out[f.name] = _pack(getattr(value, f.name), arrays)
        return out
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        arrays.append(arr)
        return {"~a": len(arrays) - 1, "d": arr.dtype.str, "s": list(arr.shape)}
    if isinstance(value, (list, tuple)):
        # Token lists are most of a request's bytes: msgpack takes a list of
        # scalars as it is, without a Python call per element.
        if all(type(v) in _SCALARS for v in value):
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


# ----------------------------------------------------------------- decoding --


def _check(value: Any, hint: Any, where: str) -> None:
    """Raise ProtocolError unless `value` fits the annotation `hint`."""
    origin = typing.get_origin(hint)
    if origin is Union:
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return
        hint = next(a for a in args if a is not type(None))
        origin = typing.get_origin(hint)
    if hint is Any:
        return
    base = origin or hint
    if base is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(base, type):
        ok = isinstance(value, base)
    else:
        ok = True
    if not ok:
        raise ProtocolError(f"{where}: expected {getattr(base, '__name__', base)}, got {type(value).__name__}")


def _unpack(value: Any, frames: list, where: str) -> Any:
    if isinstance(value, dict):
        if "~a" in value:
            try:
                buf = frames[value["~a"]]
                data = buf.buffer if hasattr(buf, "buffer") else buf
                return np.frombuffer(data, dtype=np.dtype(value["d"])).reshape(value["s"])
            except (IndexError, TypeError, ValueError) as exc:
                raise ProtocolError(f"{where}: bad array frame ({exc})") from None
        if "~t" in value:
            name = value.pop("~t")
            return _build(name, value, frames, where)
        return {k: _unpack(v, frames, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        if all(type(v) in _SCALARS for v in value):  # a token list: nothing inside to rebuild
            return value
        return [_unpack(v, frames, where) for v in value]
    return value


def _build(name: str, body: Any, frames: list, where: str) -> Any:
    cls = _BY_NAME.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"{where}: unknown message type {name!r}")
    if not isinstance(body, dict):
        raise ProtocolError(f"{where}: body of {name} is not a map")
    hints = _hints(cls)
    kwargs = {}
    for key, raw in body.items():
        if key not in hints:
            raise ProtocolError(f"{where}: {name} has no field {key!r}")
        val = _unpack(raw, frames, f"{where}.{key}")
        _check(val, hints[key], f"{name}.{key}")
        kwargs[key] = val
    try:
        return cls(**kwargs)
    except TypeError as exc:  # missing required fields
        raise ProtocolError(f"{where}: {name}: {exc}") from None


def decode(frames: list) -> Any:
    """Frames from `socket.recv_multipart(copy=False)` (or bytes) -> message."""
    if not frames:
        raise ProtocolError("empty message")
    head = frames[0]
    head = head.bytes if hasattr(head, "bytes") else bytes(head)
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable header: {exc}") from None
    if not isinstance(header, dict) or "v" not in header or "t" not in header:
        raise ProtocolError("header lacks version or type")
    if header["v"] != VERSION:
        raise ProtocolError(f"unsupported protocol version {header['v']!r} (this side speaks {VERSION})")
    return _build(header["t"], header.get("b", {}), frames[1:], header["t"])
