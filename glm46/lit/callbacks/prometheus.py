"""The run's metrics for Prometheus: rank 0 serves every scalar it logs (`train/loss` as `glm46_train_loss`, and
`perf/tokens_per_sec`, `perf/mfu`, `moe/maxvio`, ...), the step, the age of the newest checkpoint and the restarts
of this Slurm job, on `monitoring.prometheus_port` (0: off). A scrape reads the values of the last optimizer step;
monitoring/grafana/glm46.json is a dashboard of them."""

from __future__ import annotations

import os
import re
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from prometheus_client import CollectorRegistry, Gauge, Info, start_http_server

from glm46.errors import ConfigError

PREFIX = "glm46_"


def metric_name(key: str) -> str:
    """`train/loss` -> `glm46_train_loss` (Prometheus names are [a-zA-Z_:][a-zA-Z0-9_:]*)."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class PrometheusExporter(Callback):
    def __init__(self, port: int = 0, address: str = "0.0.0.0"):
        if not 0 <= port <= 65535:
            raise ConfigError(f"monitoring.prometheus_port={port}: a TCP port is 1-65535 (0: no exporter)")
        self.port, self.address = port, address
        self.registry = CollectorRegistry()
        self.gauges: dict[str, Gauge] = {}
        self.server = None
        self.last_checkpoint = time.time()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.port or not trainer.is_global_zero or self.server is not None:
            return
        try:
            self.server, _ = start_http_server(self.port, self.address, registry=self.registry)
        except OSError as error:
            raise ConfigError(
                f"monitoring.prometheus_port={self.port}: cannot serve the metrics on {self.address} ({error})"
            ) from None
        run = {"job_id": os.environ.get("SLURM_JOB_ID", ""), "run_dir": str(trainer.default_root_dir)}
        Info("glm46_run", "the run these metrics belong to", registry=self.registry).info(run)
        restarts = Gauge("glm46_restarts", "times Slurm restarted this job", registry=self.registry)
        restarts.set(int(os.environ.get("SLURM_RESTART_COUNT", "0")))
        age = Gauge("glm46_checkpoint_age_seconds", "seconds since the newest checkpoint", registry=self.registry)
        age.set_function(lambda: time.time() - self.last_checkpoint)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.server is None:
            return
        self._gauge("step", "optimizer steps taken").set(trainer.global_step)
        for key, value in trainer.callback_metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                self._gauge(key, f"the run's logged `{key}`").set(float(value))

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.last_checkpoint = time.time()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def _gauge(self, key: str, description: str) -> Gauge:
        if key not in self.gauges:
            self.gauges[key] = Gauge(metric_name(key), description, registry=self.registry)
        return self.gauges[key]
