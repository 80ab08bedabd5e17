"""Where each rank runs: its host, node, local rank and device, logged by every rank and appended to
`<run dir>/ranks.jsonl` as the run starts (one line per rank and attempt; Slurm's restart count names the attempt).
Across nodes this is what says which hosts a job, or its restart after a lost node, ran on."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback

log = logging.getLogger(__name__)
RECORD = "ranks.jsonl"


class RankPlacement(Callback):
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        place = {
            "attempt": int(os.environ.get("SLURM_RESTART_COUNT", 0)),
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "host": socket.gethostname(),
            "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "device": str(trainer.strategy.root_device),
            "time": time.time(),
        }
        log.info(
            f"rank {place['rank']} of {place['world_size']} on host {place['host']} (node {place['node_rank']}, "
            f"local rank {place['local_rank']}, {place['device']})"
        )
        path = Path(trainer.default_root_dir) / RECORD
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:  # one short line per rank: appends of this size do not interleave
            f.write(json.dumps(place) + "\n")
