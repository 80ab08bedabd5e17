"""A .safetensors file written one tensor at a time, so an export never holds a whole file in memory."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
}


class StreamingSafetensors:
    """A .safetensors file written tensor by tensor: the header (every key's dtype, shape and offsets) is known
    in advance, so each tensor's bytes go to disk as it arrives and memory never holds the whole file."""

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]]):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key, shape, dtype in entries:
            nbytes = math.prod(shape) * dtype.itemsize
            header[key] = {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        self.expected = [key for key, _, _ in entries]
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if not self.expected or self.expected[0] != key:
            raise RuntimeError(f"{self.file.name}: got {key}, expected {self.expected[:1]}")
        self.expected.pop(0)
        self.file.write(tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())

    def close(self) -> None:
        if self.expected:
            raise RuntimeError(
                f"{self.file.name}: {len(self.expected)} tensors never written, first {self.expected[0]}"
            )
        self.file.close()
