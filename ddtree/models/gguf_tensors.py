"""The tensors of a GGUF file, found without decoding its metadata.

gguf-py's GGUFReader builds a Python object for every metadata value, and a tokenizer's vocabulary and merges are
tens of thousands of strings, decoded each time the integer or block modes load the file. Here the metadata is only
stepped over (each value's length read, the value skipped) to reach the tensor table, and each tensor's bytes are a
view of one read-only map of the file.

The layout (GGUF v2 and v3, little-endian): "GGUF", the version (uint32), the tensor and metadata counts (uint64);
each metadata pair as a key (a string: uint64 length, then bytes), a value type (uint32) and a value (a scalar, a
string, or an array: element type uint32, count uint64, the elements); each tensor as its name, its dimension count
(uint32), its dimensions (uint64 each, the fastest-varying first), its type (uint32) and its data offset (uint64);
then the data, from the first multiple of `general.alignment` (32 where absent) past the table.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# value types: the byte size of each scalar one; 8 is a string, 9 an array
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    kind: str  # the GGML type's name: "Q4_1", "Q8_0", "F32", ...
    shape: tuple[int, ...]  # the file's order: the row length (fastest-varying) first
    data: np.ndarray  # its bytes, uint8 [rows, bytes a row], a view of a read-only map of the file


class _Cursor:
    """Little-endian reads from a bytes-like buffer, advancing a position."""

    def __init__(self, buffer, pos: int = 0):
        self.buffer, self.pos = buffer, pos

    def unpack(self, fmt: str):
        values = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> bytes:
        n = self.unpack("<Q")
        self.pos += n
        return bytes(self.buffer[self.pos - n:self.pos])

    def skip_value(self, kind: int) -> None:
        if kind in _SCALAR_BYTES:
            self.pos += _SCALAR_BYTES[kind]
        elif kind == _STRING:
            n = self.unpack("<Q")  # read first: `self.pos += self.unpack(...)` would add to the position before it
            self.pos += n
        elif kind == _ARRAY:
            element, count = self.unpack("<IQ")
            if element in _SCALAR_BYTES:
                self.pos += count * _SCALAR_BYTES[element]
            else:  # strings (a vocabulary), or arrays: each one's length read
                for _ in range(count):
                    self.skip_value(element)
        else:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self.pos - 4}")


def read_tensors(path: str | Path) -> dict[str, GGUFTensor]:
    """Every tensor of the GGUF file at `path`, by name. ValueError where the file is not a little-endian GGUF v2 or
    v3 (a big-endian or v1 file: gguf-py's reader takes those) or its table is cut short."""
    import gguf  # its type table only (names and block sizes)

    data = np.memmap(path, dtype=np.uint8, mode="r")
    if len(data) < 24 or bytes(data[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no 'GGUF' magic)")
    cursor = _Cursor(data, 4)
    try:
        version, n_tensors, n_fields = cursor.unpack("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (byte order or version not read here)")
        alignment = _DEFAULT_ALIGNMENT
        for _ in range(n_fields):
            key, kind = cursor.string(), cursor.unpack("<I")
            if key == b"general.alignment" and kind == _UINT32:
                alignment = cursor.unpack("<I")
            else:
                cursor.skip_value(kind)
        table = []
        for _ in range(n_tensors):
            name = cursor.string().decode("utf-8")
            n_dims = cursor.unpack("<I")
            if not 1 <= n_dims <= 8:
                raise ValueError(f"{path}: tensor {name} has {n_dims} dimensions")
            dims = tuple(cursor.unpack("<Q") for _ in range(n_dims))
            kind, offset = cursor.unpack("<IQ")
            table.append((name, dims, kind, offset))
    except struct.error as e:
        raise ValueError(f"{path}: its header ends early ({e})") from e
    start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in table:
        ggml = gguf.GGMLQuantizationType(kind)
        block, block_bytes = gguf.GGML_QUANT_SIZES[ggml]
        row_bytes = dims[0] // block * block_bytes
        rows = int(np.prod(dims[1:], dtype=np.int64))
        at = start + offset
        if dims[0] % block or at + rows * row_bytes > len(data):
            raise ValueError(f"{path}: tensor {name} ({ggml.name} {list(dims)}) does not fit the file")
        tensors[name] = GGUFTensor(name, ggml.name, dims,
                                   data[at:at + rows * row_bytes].reshape(rows, row_bytes))
    return tensors
