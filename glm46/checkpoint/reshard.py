"""Resuming under another layout or world size (`ckpt_path=last` with another `parallelism` or `cluster.devices`).

A checkpoint comes in one of three formats, each named by what it is on disk:

- `file`: one `.ckpt` file (single process, DDP; a mesh layout with `save_distributed_checkpoint=false`);
- `dcp`: a folder of torch distributed-checkpoint shards (`.metadata`, `meta.pt`; the mesh layouts);
- `deepspeed`: DeepSpeed's folder of ZeRO partitions (`latest`).

The mesh layouts read `file` (Lightning broadcasts it into the shards) and `dcp` (DCP reshards to any mesh and
world size); one process and DDP read `file` and `dcp` (consolidated in memory:
glm46.checkpoint.atomic.AtomicCheckpointIO); DeepSpeed reads only its own folders, at the world size that wrote
them. Optimizer states in files are keyed by parameter name (GLM46LitModule.on_save_checkpoint), so every
engine maps Muon/AdamW state to the right parameter whatever order its param groups list them in.
Anything else is refused before training starts, naming both layouts and `init_from`.
"""

from __future__ import annotations

import re
from pathlib import Path

import lightning as L
from omegaconf import DictConfig

from glm46.checkpoint.safe_load import load
from glm46.errors import ConfigError
from glm46.parallel.data_parallel import data_parallel_size

META = "meta.pt"  # Lightning's file of everything but the weights and optimizer states in a DCP folder
ENGINE_READS = {"single": ("file", "dcp"), "ddp": ("file", "dcp"), "mesh": ("file", "dcp"), "deepspeed": ("deepspeed",)}
FORMAT_NAMES = {  # (one, several)
    "file": ("a one-file checkpoint", "one-file checkpoints"),
    "dcp": ("a distributed checkpoint (DCP) folder", "distributed checkpoint (DCP) folders"),
    "deepspeed": ("a DeepSpeed checkpoint folder", "DeepSpeed checkpoint folders"),
}


def checkpoint_format(path: Path) -> str:
    """`file`, `dcp` or `deepspeed` (see the module docstring)."""
    if not path.is_dir():
        return "file"
    return "dcp" if (path / ".metadata").is_file() else "deepspeed"


def deepspeed_world_size(path: Path) -> int:
    """Processes that wrote a DeepSpeed folder: one ZeRO partition file each."""
    return len(list(path.glob("*/zero_pp_rank_*_model_states.pt")))


def written_by(path: Path) -> dict | None:
    """The layout record (LayoutRecord) of a `file` or `dcp` checkpoint; None for DeepSpeed folders and
    checkpoints written before it existed."""
    source = checkpoint_format(path)
    if source == "deepspeed":
        return None
    metadata = load(path / META if source == "dcp" else path, map_location="cpu", mmap=True)
    return metadata.get("layout")


class LayoutRecord(L.Callback):
    """Stores in every checkpoint the layout that wrote it and the global batch it trained with (key `layout`),
    which the resume check (`check_resume`) names and compares."""

    def __init__(self, parallelism: str, global_batch_tokens: int):
        self.parallelism, self.global_batch_tokens = parallelism, global_batch_tokens

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint["layout"] = {
            "parallelism": self.parallelism,
            "world_size": trainer.world_size,
            "data_parallel": data_parallel_size(trainer),
            "global_batch_tokens": self.global_batch_tokens,
        }


def _processes(count: int) -> str:
    return f"{count} process" + ("es" if count != 1 else "")


def check_resume(path: str | Path, cfg: DictConfig) -> None:
    """Refuse, before training, a resume that no engine can carry out: a checkpoint format the composed layout
    cannot read, a DeepSpeed folder at another world size, or another global batch than the checkpoint's."""
    path = Path(path)
    source, record = checkpoint_format(path), written_by(path)
    world = cfg.cluster.num_nodes * cfg.cluster.devices
    target = f"parallelism={cfg.parallelism.name} on {_processes(world)}"
    if record:
        writer = f"parallelism={record['parallelism']} on {_processes(record['world_size'])}"
    elif source == "deepspeed":
        writer = f"DeepSpeed on {_processes(deepspeed_world_size(path))}"
    else:
        writer = "an earlier version"
    way_out = (
        f"To start from its weights instead (optimizer state, schedules and data position afresh), run in a new "
        f"run directory with init_from={path} (or the run's hf/ export) and without ckpt_path."
    )
    if source not in ENGINE_READS[cfg.parallelism.engine]:
        readable = " and ".join(FORMAT_NAMES[f][1] for f in ENGINE_READS[cfg.parallelism.engine])
        raise ConfigError(
            f"ckpt_path: {path} is {FORMAT_NAMES[source][0]} written by {writer}; {target} cannot resume from it "
            f"(it reads {readable}). Resume under the layout that wrote it. {way_out}"
        )
    if source == "deepspeed" and deepspeed_world_size(path) != world:
        raise ConfigError(
            f"ckpt_path: {path} holds DeepSpeed ZeRO partitions written by {writer}; {target} cannot re-partition "
            f"them: resume on {_processes(deepspeed_world_size(path))}. {way_out}"
        )
    if record and record["global_batch_tokens"] != cfg.global_batch_tokens:
        raise ConfigError(
            f"ckpt_path: {path} was trained with global_batch_tokens={record['global_batch_tokens']} "
            f"({writer}, {record['data_parallel']} data-parallel ranks), this run has "
            f"global_batch_tokens={cfg.global_batch_tokens} ({target}): keep the global batch by setting "
            f"data.batch_size or trainer.accumulate_grad_batches (or phase.global_batch_tokens) so that batch x "
            f"seq_len x accumulation x data-parallel ranks = {record['global_batch_tokens']}"
        )


def consolidate(path: Path) -> dict:
    """A DCP folder read whole into the dict a one-process checkpoint file holds: `state_dict`, `optimizer_states`
    (keyed by parameter name, param groups in the optimizer's order) and Lightning's metadata."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    checkpoint = _load_distributed_checkpoint(path)
    numbers = sorted(int(k.removeprefix("optimizer_")) for k in checkpoint if re.fullmatch(r"optimizer_\d+", k))
    checkpoint["optimizer_states"] = [checkpoint.pop(f"optimizer_{n}") for n in numbers]
    return checkpoint
