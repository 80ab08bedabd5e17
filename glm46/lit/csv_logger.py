"""Lightning's CSVLogger, except that a resumed run appends to the run directory's metrics.csv
instead of deleting it, so the loss curve of a run survives its restarts."""

from __future__ import annotations

import csv

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


class _AppendingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):  # keep it, and its columns
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                self.metrics_keys = next(csv.reader(file), [])


class AppendingCSVLogger(CSVLogger):
    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment
