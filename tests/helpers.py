"""Small models and configs shared by the tests."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from glm46.data.shards import load_shard
from glm46.data.tokenizer import GLMTokenizer
from glm46.modules import GLM46Config, GLM46ForCausalLM

from . import forked

ROOT = Path(__file__).resolve().parents[1]

TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)


def launcher_env() -> dict[str, str]:
    """The environment for a multi-process run started from a test: none of torch.distributed's rendezvous variables
    a launcher above may have set (the run's own launcher sets them), one thread per process."""
    rendezvous = ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# A short run on the standard library's bytes (experiment=tiny_bytes) in micro-batches of 2 x 32 tokens, every step
# logged, a checkpoint every 2 steps, no validation, progress bar or throughput: the resume tests' base.
SHORT_RUN = [
    "experiment=tiny_bytes",
    "data.max_bytes=100000",
    "data.seq_len=32",
    "data.batch_size=2",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=1000",
    "trainer.limit_val_batches=0",
    "callbacks.progress_bar=null",
    "callbacks.model_checkpoint.every_n_train_steps=2",
    "callbacks.throughput=null",
]


def run_py(*overrides: str, killed: bool = False, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python run.py <overrides>` from the repository root; it must exit 0, or die of SIGKILL when `killed`
    (tests.helpers.KillAtBatch, `kill_at`)."""
    result = forked.run(
        [sys.executable, "run.py", *overrides], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    expected = -signal.SIGKILL if killed else 0
    assert result.returncode == expected, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def kill_at(batch: int) -> list[str]:
    """The overrides that SIGKILL a run as its micro-batch `batch` starts. A resume (`ckpt_path=last`) restores the
    run directory's overrides, these too: it names UNKILLED to leave them out."""
    return ["+callbacks.kill._target_=tests.helpers.KillAtBatch", f"+callbacks.kill.batch={batch}"]


UNKILLED = ["~callbacks.kill"]  # a resume without kill_at's callback (glm46.config.restore)


def tiny_config(**overrides) -> GLM46Config:
    return GLM46Config(**{**TINY, **overrides})


def randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random N(0, 0.1) weights, norm gains in (0.5, 1.5), non-zero biases and correction biases:
    nothing that initialisation leaves at 0 or 1 can hide a mismatch. Ours or transformers' model."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0, 0.1)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.05)
    return model.eval()


def random_model(config: GLM46Config, seed: int = 0) -> GLM46ForCausalLM:
    return randomise(GLM46ForCausalLM(config), seed)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


class RecordBatches(L.Callback):
    """Every training batch's `key` tensor, in order."""

    def __init__(self, key: str):
        self.key, self.batches = key, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(batch[self.key].clone())


class SlowSteps(L.Callback):
    """Make each training step last at least `seconds` of wall time, however loaded the machine: a run whose length
    is known in advance (the requeue test needs one longer than two allocations, and no longer)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.started = time.monotonic()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.started = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(max(0.0, self.seconds - (time.monotonic() - self.started)))


class SignalAtStep(L.Callback):
    """Send this process `signal` once, in the middle of the step after `step` optimizer steps."""

    def __init__(self, step: int, signal: str = "SIGTERM"):
        self.step, self.signal, self.sent = step, signal, False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), getattr(signal, self.signal))


class KillAtBatch(L.Callback):
    """SIGKILL this process as micro-batch `batch` starts: no handler runs, nothing is flushed or saved."""

    def __init__(self, batch: int):
        self.batch = batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.batch:
            os.kill(os.getpid(), signal.SIGKILL)


class FailForSeed(L.Callback):
    """Raises as training starts in the run whose `seed` is `failing`: one member of a sweep made to fail
    (`+callbacks.fail._target_=tests.helpers.FailForSeed +callbacks.fail.seed=${seed} +callbacks.fail.failing=1`)."""

    def __init__(self, seed: int, failing: int):
        self.fails = seed == failing

    def on_train_start(self, trainer, pl_module):
        if self.fails:
            raise RuntimeError("planted failure for this seed")


class SignalDuringSave(L.Callback):
    """Send this process `signal` while a checkpoint is being assembled (a second signal during the save)."""

    def __init__(self, signal: str = "SIGTERM"):
        self.signal = signal

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        os.kill(os.getpid(), getattr(signal, self.signal))


class LinearModule(L.LightningModule):
    """The smallest LightningModule that trains: one Linear layer, SGD (checkpoint and hook tests)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def require_venv(python: Path | None, what: str, build_script: str, require_variable: str) -> Path:
    """An engine venv's python (vLLM's, llama.cpp's); without it the test skips, unless $require_variable is 1
    (CI, which builds the venvs), where it fails."""
    if python is None:
        reason = f"no {what} venv: run `bash {build_script}` (CI does) to test it"
        if os.environ.get(require_variable) == "1":
            pytest.fail(f"{require_variable}=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    return python


def train_tiny(dataset: Path, tokenizer: GLMTokenizer, steps: int = 200, domain: str = "sft") -> GLM46ForCausalLM:
    """The tiny model trained on the chat domain (next token and MTP), so that greedy decoding has clear argmaxes
    and the MTP layer drafts tokens worth accepting. Always on 2 threads: a matmul's sums depend on the thread count,
    and the engines' tests compare against this one model (the bounds of tests/test_gguf.py were measured on it)."""
    tokens, _ = load_shard(dataset / "tokens", domain)
    torch.manual_seed(0)
    # 1,024 positions: a chat request that lists tools (GLM's tools block) is longer than the tiny default
    model = GLM46ForCausalLM(tiny_config(vocab_size=tokenizer.vocab_size, max_position_embeddings=1024))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    starts = np.random.default_rng(0).integers(0, len(tokens) - 129, size=(steps, 8))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for batch in starts:
            x = torch.from_numpy(np.stack([tokens[s : s + 129] for s in batch]).astype(np.int64))
            out = model(x[:, :-1], labels=x[:, 1:])
            optimizer.zero_grad()
            (out.loss + 0.3 * out.mtp_loss).backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()
