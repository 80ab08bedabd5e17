"""Lightning's ModelCheckpoint, plus a last.ckpt at the end of training.

Lightning (2.6) writes last.ckpt only together with a periodic checkpoint, so a run whose final step is
not a multiple of `every_n_train_steps` ended with a stale last.ckpt, and `ckpt_path=last` repeated the
steps after it. (Files are written atomically by glm46.checkpoint.atomic.AtomicCheckpointIO.)
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint as _LightningModelCheckpoint

from glm46.lightning_private import last_saved_step, save_last_checkpoint


class ModelCheckpoint(_LightningModelCheckpoint):
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Preemption saves last.ckpt itself when it stops a run: no second write of the same step.
        saved = {last_saved_step(self)} | {getattr(c, "interrupted_at", None) for c in trainer.callbacks}
        if self.save_last and trainer.global_step not in saved:
            save_last_checkpoint(self, trainer)
