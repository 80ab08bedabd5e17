"""Lightning's CSVLogger, except that a resumed run appends to the run directory's metrics.csv
instead of deleting it, so the loss curve of a run survives its restarts."""

from __future__ import annotations

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from glm46.lightning_private import AppendingExperimentWriter, csv_experiment


class AppendingCSVLogger(CSVLogger):
    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        return csv_experiment(self, AppendingExperimentWriter)
