"""Streaming safetensors: read one tensor at a time, write one tensor at a time.

The format (https://github.com/huggingface/safetensors) is an 8-byte little-endian header length, a JSON
header `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}` and the raw
little-endian bytes. The `safetensors` package memory-maps whole files (every page read stays in the
process's resident set until the file is closed) and its writer needs every tensor in memory at once; these
~100 lines read each tensor with one `readinto` into a fresh array and write from one array at a time, so
loading and saving a checkpoint never hold more than one tensor beyond the parameters themselves.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from jaxrl.models.safe_read import loads_json, open_regular

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100_000_000  # bytes, as the safetensors library
_MAX_HEADER_DEPTH = 8  # the format nests 3 levels: {name: {"shape": [...]}}


class SafetensorsError(ValueError):
    """A malformed or inconsistent safetensors file; the message names the file (and tensor)."""


class TensorInfo(NamedTuple):
    file: str
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in `file`
    nbytes: int


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """`({name: TensorInfo}, metadata)` of one file, validated against the file's size.

    Refused (`SafetensorsError` naming the file): anything but a regular file (a FIFO would block the read
    forever), a header longer than 100 MB (safetensors' own limit) or than the file, a header that is not a JSON
    object of `{dtype, shape, data_offsets}` entries nested at most `_MAX_HEADER_DEPTH` levels (the format's 3),
    and `__metadata__` other than a string -> string object.
    """
    path = os.fspath(path)
    try:
        with open_regular(path, SafetensorsError) as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise SafetensorsError(f"{path}: not a safetensors file (only {size} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(_MAX_HEADER, size - 8):
                raise SafetensorsError(f"{path}: not a safetensors file (header length {header_len} "
                                       f"in a {size}-byte file; at most {_MAX_HEADER:,} bytes)")
            raw = f.read(header_len)
    except OSError as e:
        raise SafetensorsError(f"{path}: cannot read: {e.strerror or e}") from None
    header = loads_json(raw, f"{path}: the safetensors header", max_depth=_MAX_HEADER_DEPTH, error=SafetensorsError)
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise SafetensorsError(f"{path}: the safetensors header's __metadata__ must map strings to strings")
    data_start, data_len = 8 + header_len, size - 8 - header_len
    tensors = {}
    for name, entry in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise SafetensorsError(f"{where}: malformed header entry {_short(entry)}")
        try:
            dtype, shape, (begin, end) = DTYPES[entry["dtype"]], tuple(entry["shape"]), entry["data_offsets"]
        except KeyError as e:
            raise SafetensorsError(f"{where}: unsupported dtype or missing field {_short(e.args[0])}") from None
        except (TypeError, ValueError):
            raise SafetensorsError(f"{where}: malformed header entry {_short(entry)}") from None
        if not all(_is_count(n) for n in (*shape, begin, end)):
            raise SafetensorsError(f"{where}: shape and data offsets must be non-negative integers, got "
                                   f"{_short(entry)}")
        nbytes = math.prod(shape) * dtype.itemsize
        if not 0 <= begin <= end <= data_len or end - begin != nbytes:
            raise SafetensorsError(f"{where}: data offsets {[begin, end]} do not fit shape {list(shape)} "
                                   f"{entry['dtype']} in a {data_len}-byte data section (truncated file?)")
        tensors[name] = TensorInfo(path, name, dtype, shape, data_start + begin, nbytes)
    return tensors, metadata


def _short(value: Any, limit: int = 120) -> str:
    """`repr(value)`, cut to `limit` characters (a header entry may be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an `alignment`-byte boundary. XLA:CPU adopts such host
    arrays without copying them (`jax.device_put`), so a tensor read into one is never held twice."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def read_tensor(info: TensorInfo) -> np.ndarray:
    """The tensor's data as a fresh, 64-byte aligned array (one `readinto`, no memory map)."""
    out = aligned_empty(info.shape, info.dtype)
    with open_regular(info.file, SafetensorsError) as f:
        f.seek(info.offset)
        read = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
    if read != info.nbytes:
        raise SafetensorsError(f"{info.file}: tensor {info.name!r}: read {read} of {info.nbytes} bytes")
    return out


class TensorSpec(NamedTuple):
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]


def write_file(path: str | os.PathLike, specs: list[TensorSpec], arrays: Iterable[np.ndarray],
               metadata: dict[str, str] | None = None) -> None:
    """Write tensors to `path` in the order of `specs`, pulling each array from `arrays` only when its
    bytes are written. Written to `path + ".tmp"` and renamed, so an interrupted save leaves no half file."""
    header, offset = {}, 0
    for spec in specs:
        nbytes = math.prod(spec.shape) * spec.dtype.itemsize
        header[spec.name] = {"dtype": _NAMES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header = {"__metadata__": metadata, **header}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for spec, array in zip(specs, arrays, strict=True):
            array = np.ascontiguousarray(array)
            if array.dtype != spec.dtype or array.shape != spec.shape:
                raise ValueError(f"{path}: tensor {spec.name!r} is {array.dtype}{list(array.shape)}, expected "
                                 f"{spec.dtype}{list(spec.shape)}")
            f.write(memoryview(array.reshape(-1).view(np.uint8)))
    os.replace(tmp, path)
