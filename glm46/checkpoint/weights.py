"""Start from earlier weights (`init_from`): fill a model, whole or sharded, from an HF directory or a run
directory's hf/ export (each rank reads its slices), a Lightning checkpoint file (memory-mapped, each rank copies its
slices), or a sharded layout's checkpoint folder (DCP reads in place, resharding into the model's layout; a DeepSpeed
folder is read whole).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from glm46.parallel.boxes import local_box, local_tensor
from glm46.peft.inject import base_state_dict

from .hf_read import load_hf
from .hub_files import find_weights
from .safe_load import check_safe, load


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Fill `model` (a GLM46ForCausalLM, whole or sharded) with the weights at `path` (see the module docstring).
    Only the weights: optimizer, schedules and data position start afresh."""
    path = Path(path)
    if path.is_dir() and not (path / ".metadata").is_file() and not _is_deepspeed_folder(path):
        load_hf(find_weights(path), model=model)  # an HF directory or a run directory's hf/; safetensors: no pickle
        return
    if path.is_dir():  # before DCP or DeepSpeed unpickles anything of it (a file's `load` is its own check)
        check_safe(path)
    if (path / ".metadata").is_file():
        _load_dcp(model, path)
        return
    if path.is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(path)  # whole, in one process
    else:
        state = load(path, map_location="cpu", mmap=True)["state_dict"]
    state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    own = base_state_dict(model, keep_vars=True)  # a PEFT run's adapters start afresh (glm46.peft)
    if not model.is_whole():  # a pipeline stage's part: only its weights
        state = {name: state[name] for name in own.keys() & state.keys()}
    if own.keys() != state.keys():
        missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
        raise RuntimeError(
            f"{path}: the weights do not fit the model: missing {missing[:10]}, unexpected {unexpected[:10]}"
        )
    with torch.no_grad():
        for name, tensor in own.items():
            if state[name].shape != tensor.shape:
                raise RuntimeError(
                    f"{path}: {name} has shape {tuple(state[name].shape)}, the model {tuple(tensor.shape)}"
                )
            local_tensor(tensor).copy_(state[name][local_box(tensor)])  # a memory-mapped source reads only this


def _is_deepspeed_folder(path: Path) -> bool:
    return (path / "latest").is_file() or bool(list(path.glob("*/zero_pp_rank_*_model_states.pt")))


def _load_dcp(model: torch.nn.Module, path: Path) -> None:
    """Read a distributed checkpoint (the mesh layouts' checkpoint folders: `*.distcp` + `.metadata`) into the
    model in place: each rank reads its shards, whatever layout wrote it (DCP reshards), or the whole weights
    into a whole model, also in one process. The LightningModule's `model.` prefix is in the checkpoint."""
    import torch.distributed.checkpoint as dcp

    state = {"state_dict": {f"model.{k}": v for k, v in base_state_dict(model).items()}}  # views of the weights
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": reading in one process is the point
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=not (dist.is_available() and dist.is_initialized()))
