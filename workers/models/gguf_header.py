"""A GGUF file's header, read and bounds-checked without touching tensor
data: its metadata, its tensors (name, shape, type, offset), and that each
lies wholly inside the file.

Apart from the conversion (gguf_convert.py: what Tandem can run, the MLX
folder written) because this is the untrusted-input side: every read is
bounded, and anything malformed is a ModelError, never an IndexError or a
giant allocation.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from environment.model_folder import ModelError

# Tensor types whose MLX form mlx_lm can run: plain floats, and the legacy
# 32-wide block quants that map one-to-one onto MLX affine quantization.
QUANT_BITS = {
    GGMLQuantizationType.Q4_0: 4,
    GGMLQuantizationType.Q4_1: 4,
    GGMLQuantizationType.Q8_0: 8,
}
FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16}
SUPPORTED_TYPES = FLOAT_TYPES | set(QUANT_BITS)
GROUP_SIZE = 32  # the block size of every type in QUANT_BITS


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    type: int
    offset: int  # relative to the start of the data section

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.type).name
        except ValueError:
            return f"unknown type {self.type}"


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict  # scalar and string values; arrays appear as their length
    tensors: list[TensorInfo] = field(default_factory=list)
    data_start: int = 0
    file_size: int = 0


class _Truncated(Exception):
    pass


# GGUF value type id → struct format of a scalar of that type.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Bounds-checked sequential reads; running off the end means a truncated
    or corrupt file, never an IndexError or a giant allocation."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > len(self.buf):
            raise _Truncated
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, fmt: str):
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        start = self.take(n)
        return bytes(self.buf[start : start + n]).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self.take(self.scalar("<Q"))

    def value(self, vtype: int):
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _SCALAR:
                self.take(count * struct.calcsize(_SCALAR[etype]))
            elif etype == _STRING:
                for _ in range(count):  # bounded: each string costs >= 8 bytes
                    self.skip_string()
            else:  # nested arrays do not occur in GGUF files we can run
                raise ValueError(f"unsupported array element type {etype}")
            return count
        raise ValueError(f"unknown metadata value type {vtype}")


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse and check a GGUF header without loading tensor data.
    Raises ModelError for anything that is not a complete, well-formed file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise ModelError(f"{path}: not a GGUF file (only {size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                header = _parse(path, buf, size)
    except FileNotFoundError:
        raise ModelError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ModelError(f"{path}: is a directory, not a GGUF file") from None
    except PermissionError:
        raise ModelError(f"{path}: permission denied") from None
    _check_extent(header)
    return header


def _parse(path: Path, buf, size: int) -> GGUFHeader:
    if bytes(buf[:4]) != b"GGUF":
        raise ModelError(f"{path}: not a GGUF file (bad magic bytes)")
    cur = _Cursor(buf)
    cur.take(4)
    try:
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ModelError(f"{path}: unsupported GGUF version {version} (expected 2 or 3)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        tensors = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if not 1 <= n_dims <= 4:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            shape = tuple(cur.scalar("<Q") for _ in range(n_dims))
            tensors.append(TensorInfo(name, shape, cur.scalar("<I"), cur.scalar("<Q")))
    except _Truncated:
        raise ModelError(f"{path}: truncated or corrupt GGUF header") from None
    except ValueError as e:
        raise ModelError(f"{path}: corrupt GGUF header ({e})") from None
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ModelError(f"{path}: corrupt GGUF header (alignment {alignment!r})")
    data_start = -(-cur.pos // alignment) * alignment
    return GGUFHeader(path, version, metadata, tensors, data_start, size)


def _check_extent(h: GGUFHeader) -> None:
    """Every tensor must lie wholly inside the file: a short file is a download
    or copy that stopped early."""
    end = h.data_start
    for t in h.tensors:
        if t.type not in SUPPORTED_TYPES:
            continue  # reported by validate() with a better message
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.type)]
        n = 1
        for d in t.shape:
            n *= d
        if t.shape[0] % block:
            raise ModelError(
                f"{h.path}: corrupt GGUF (tensor {t.name} has rows of {t.shape[0]}, not a multiple of {block})"
            )
        end = max(end, h.data_start + t.offset + n // block * block_bytes)
    if end > h.file_size:
        raise ModelError(
            f"{h.path}: truncated GGUF file ({h.file_size} bytes, tensor data needs {end})"
        )
