"""Checkpoints that run no code. A checkpoint is a pickle, and unpickling calls whatever the pickle names: a `.ckpt`
downloaded from elsewhere and given to `init_from` or `ckpt_path` could run code on every rank of the cluster.

So every checkpoint glm46 reads is unpickled with only the types its own checkpoints hold (CHECKPOINT_TYPES,
found by listing the globals of every file each engine writes: one-process and DDP files, DCP folders, DeepSpeed
folders): torch's `weights_only` unpickler for torch's files (the types registered with
`torch.serialization.add_safe_globals` on import), a restricted `pickle.Unpickler` for DCP's `.metadata` (torch
reads it with a plain `pickle.load`), and each file of a DeepSpeed folder is vetted before DeepSpeed (which
unpickles without limits) opens it. A pickle that names anything else is refused before any of it runs, naming the
file and what it asked for (https://docs.python.org/3/library/pickle.html#restricting-globals).
"""

from __future__ import annotations

import collections
import functools
import importlib
import io
import pathlib
import pickle
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import filesystem as dcp_files
from torch.distributed.checkpoint import metadata as dcp_metadata

from glm46.errors import ConfigError

DTYPES = tuple(t for t in vars(torch).values() if isinstance(t, torch.dtype))
CHECKPOINT_TYPES: tuple = (
    collections.OrderedDict,
    pathlib.PosixPath,  # DCP's StorageMeta.checkpoint_id
    torch.Size,
    torch.serialization._get_layout,  # how a DCP TensorProperties pickles its layout
    dcp_files._StorageInfo,
    dcp_metadata.Metadata,
    dcp_metadata.MetadataIndex,
    dcp_metadata.StorageMeta,
    dcp_metadata.TensorProperties,
    dcp_metadata.TensorStorageMetadata,
    dcp_metadata.ChunkStorageMetadata,
    dcp_metadata.BytesStorageMetadata,
    dcp_metadata._MEM_FORMAT_ENCODING,
)
DEEPSPEED_TYPES = (  # in a DeepSpeed folder's model states, beside tensors
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
)
DCP_METADATA = ".metadata"
DEEPSPEED_LATEST = "latest"  # the file DeepSpeed writes last into its checkpoint folder


class UnsafeCheckpointError(ConfigError):
    """A checkpoint whose pickle asks for a type glm46's own checkpoints never hold."""


def _name(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


@functools.cache
def _allow_deepspeed_types() -> None:
    """Registered when a DeepSpeed folder is vetted (importing DeepSpeed takes seconds; reading its folder needs it)."""
    torch.serialization.add_safe_globals(
        [getattr(importlib.import_module(module), name) for module, name in DEEPSPEED_TYPES]
    )


torch.serialization.add_safe_globals(list(CHECKPOINT_TYPES))
# The raw unpickler resolves `module.name` only for these; torch's zip files' own rebuild functions and storages are
# what torch's weights_only unpickler allows by default (never seen by this one).
ALLOWED_NAMES = {_name(t) for t in CHECKPOINT_TYPES} | {str(t) for t in DTYPES}  # str(torch.float32): torch.float32


def refusal(what: str, asked: list[str]) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{what}: refused: its pickle asks for {', '.join(asked)}, which no glm46 checkpoint holds, and unpickling it "
        f"could run code. Read only checkpoints you trust; a model from elsewhere comes in as an HF folder "
        f"(safetensors) through init_from=<folder>"
    )


def load(source: str | Path | BinaryIO, what: str | None = None, **kwargs: Any) -> Any:
    """`torch.load(source, weights_only=True, **kwargs)`; a pickle that asks for other types is refused, naming
    them and `what` (default: the path)."""
    what = what or str(source)
    try:
        return torch.load(source, weights_only=True, **kwargs)
    except pickle.UnpicklingError as error:
        if not any(word in str(error) for word in ("GLOBAL", "allowlisted")):  # not a type it asked for: bytes
            raise  # that are no pickle ("Unsupported operand"), which the reader reports as unreadable
        if not isinstance(source, (str, Path)):
            source.seek(0)
        try:
            asked = torch.serialization.get_unsafe_globals_in_checkpoint(source)
        except Exception:  # not a torch.save archive: torch's own words name what it met
            asked = [line for line in str(error).splitlines() if "GLOBAL" in line][:1]
        raise refusal(what, asked or ["a type outside the allowlist"]) from None


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, what: str):
        super().__init__(file)
        self.what = what

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" not in ALLOWED_NAMES:
            raise refusal(self.what, [f"{module}.{name}"])
        return super().find_class(module, name)


def dcp_metadata_of(folder: Path) -> dcp_metadata.Metadata:
    """A DCP folder's `.metadata`, unpickled with the allowlist."""
    with open(folder / DCP_METADATA, "rb") as f:
        return _RestrictedUnpickler(f, str(folder / DCP_METADATA)).load()


def _check_dcp_bytes(folder: Path) -> None:
    """DCP stores non-tensor values (optimizer param groups, ...) as torch.save blobs inside its `.distcp` files and
    reads them back with `weights_only=False`: each is vetted here first, where `.metadata` says it lies."""
    metadata = dcp_metadata_of(folder)
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), dcp_metadata.BytesStorageMetadata):
            continue
        with open(folder / info.relative_path, "rb") as f:
            f.seek(info.offset)
            blob = io.BytesIO(f.read(info.length))
        what = f"{folder / info.relative_path} (item {index.fqn})"
        if info.transform_descriptors:
            raise refusal(what, [f"transforms {list(info.transform_descriptors)}"])
        load(blob, what, map_location="cpu")


def check_safe(path: str | Path) -> None:
    """Refuse `path` (a checkpoint file, or a DCP or DeepSpeed folder) if any pickle in it asks for a type outside
    the allowlist. Files are memory-mapped: the check reads the pickled structures, not the tensors' bytes. Only
    unsafe pickles are its business: a file that does not read at all is left to the reader, which names it."""
    path = Path(path)
    try:
        if (path / DCP_METADATA).is_file():
            _check_dcp_bytes(path)
        elif (path / DEEPSPEED_LATEST).is_file():
            _allow_deepspeed_types()
        files = sorted(path.rglob("*.pt")) if path.is_dir() else [path]  # DCP's meta.pt, DeepSpeed's states
        for file in files:
            load(file, map_location="cpu", mmap=zipfile.is_zipfile(file))
    except UnsafeCheckpointError:
        raise
    except Exception:  # truncated, empty, not a checkpoint
        return
