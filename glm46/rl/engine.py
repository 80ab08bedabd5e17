"""Rollouts through an inference engine: the settings of `phase.rollout`, and the client of a vLLM rollout engine.

As slime (SGLang engines), TRL (`use_vllm`, server or colocate mode) and verl do, GRPO can sample its group
completions in an inference engine instead of the training model's own `generate`: the engine decodes far faster at
scale, and the trainer pushes its new weights to it after each update. The engine is vLLM, started from the serving
venv (scripts/serving_venv.sh; the CPU build here, the GPU build in production) by glm46/serve/vllm_rollout.py, and
reached over a local authenticated socket. Its CPU build has no NCCL weight transfer, so the weights go through a
directory: the trainer writes its HF export there (glm46.checkpoint.hf_write, slice by slice when sharded) and the
engine reloads them in place (vLLM's `reload_weights`).

The engine samples from slightly different numbers than the trainer computes (other kernels, another process), so
the rollout is a little off-policy. The engine returns each sampled token's log-prob and the loss weighs each token by
the truncated importance ratio min(pi_trainer / pi_engine, cap) (TIS: Yao et al., "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training", 2025; slime's `--use-tis --tis-clip`, TRL's
`vllm_importance_sampling_cap`); the gap between the two log-probs is logged every step.

An engine that cannot start, dies, or does not answer within its timeout raises RolloutEngineError naming its log
file: the run then ends with that error and a checkpoint (GRPOLitModule), never a hang.
"""

from __future__ import annotations

import atexit
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from pathlib import Path

import torch.distributed as dist

from glm46.errors import ConfigError

ENGINES = ("local", "vllm")
SCRIPT = Path(__file__).resolve().parents[1] / "serve" / "vllm_rollout.py"


@dataclass
class RolloutSettings:
    """Where GRPO's completions are sampled (`phase.rollout`; conf/phase/rollout/*.yaml)."""

    engine: str = "local"  # local: the training model's generate; vllm: a vLLM engine
    tensor_parallel_size: int = 1  # the engine's: GPUs that split each layer (must divide the attention heads)
    colocate: bool = True  # the engine on the training GPUs (slime's --colocate), else on GPUs of its own
    gpu_memory_utilization: float = 0.5  # the share of each GPU the engine takes (weights + KV cache), vLLM's flag
    quantization: str | None = None  # fp8: vLLM quantizes the pushed weights at each load (GLM-4.5's FP8 rollouts)
    tis_cap: float | None = 2.0  # truncated importance sampling's cap C (slime and TRL: 2.0); null: no correction
    dtype: str = "auto"  # the engine's weights and compute (auto: the trainer's parameter dtype)
    python: str | None = None  # the serving venv's interpreter; null: $GLM46_SERVING_PYTHON or the default venv
    kv_cache_gib: int = 1  # vLLM's CPU build: VLLM_CPU_KVCACHE_SPACE
    start_timeout_s: float = 900.0  # engine start (weights loaded, warmed up)
    request_timeout_s: float = 1800.0  # one rollout batch or weight reload

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ConfigError(f"phase.rollout.engine={self.engine!r}: expected {' or '.join(ENGINES)}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"phase.rollout.tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"phase.rollout.gpu_memory_utilization={self.gpu_memory_utilization}: expected (0, 1]")
        if self.quantization not in (None, "fp8"):
            raise ConfigError(f"phase.rollout.quantization={self.quantization!r}: expected null or fp8")
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ConfigError(
                f"phase.rollout.tis_cap={self.tis_cap}: the cap of the importance ratio must be >= 1 (null: none)"
            )
        if min(self.start_timeout_s, self.request_timeout_s) <= 0:
            raise ConfigError("phase.rollout.start_timeout_s and request_timeout_s must be > 0")


class RolloutEngineError(RuntimeError):
    """The rollout engine failed to start, died, answered an error or did not answer in time."""


def world_size() -> int:
    """The processes of the default group (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def to_first_rank(value) -> list | None:
    """Every rank's `value`, in rank order, on global rank 0 (None on the others)."""
    if world_size() == 1:
        return [value]
    values = [None] * world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, values, dst=0)
    return values


def from_first_rank(work: Callable[[], list]):
    """work() on global rank 0 returns one item per rank; each rank gets its own. A RolloutEngineError there is
    raised on every rank (so that they all write the checkpoint and stop)."""
    world = world_size()
    items = None
    if world == 1 or dist.get_rank() == 0:
        try:
            items = work()
        except RolloutEngineError as error:
            items = [error] * world
    if world > 1:
        mine = [None]
        dist.scatter_object_list(mine, items, src=0)
        item = mine[0]
    else:
        item = items[0]
    if isinstance(item, RolloutEngineError):
        raise RolloutEngineError(str(item))
    return item


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMRolloutEngine:
    """A vLLM engine in its own process (the serving venv's python), serving one trainer; `close` ends it."""

    def __init__(
        self,
        settings: RolloutSettings,
        model: Path,
        log_file: Path,
        dtype: str,
        seed: int = 0,
    ):
        """Start vLLM on the HF directory `model` in `dtype` (settings.dtype unless it is auto), logging to log_file;
        its context is the model's max_position_embeddings."""
        from glm46.serve.offline import serving_python
        from glm46.serve.venv import VLLM_IPC_VARIABLE, ipc_folder

        python = settings.python or serving_python()
        if python is None:
            raise RolloutEngineError(
                "phase.rollout.engine=vllm needs vLLM's environment: build it with `bash scripts/serving_venv.sh` "
                "(or set phase.rollout.python / $GLM46_SERVING_PYTHON)"
            )
        self.settings, self.log_file = settings, Path(log_file)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        port, authkey, self.ipc = free_port(), secrets.token_bytes(16), ipc_folder()
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # vLLM's own packages only
        env |= {
            VLLM_IPC_VARIABLE: self.ipc.name,
            "GLM46_ROLLOUT_AUTHKEY": authkey.hex(),
            "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # a function of vllm_rollout.py runs in vLLM's workers
        }
        with open(self.log_file, "ab") as log:
            try:
                # A session of its own: vLLM's engine core and workers join its process group, so a failure or
                # close kills them all (killing only the script orphaned them, holding GBs of memory).
                self.process = subprocess.Popen(
                    [str(python), "-P", str(SCRIPT), str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            except OSError as error:
                raise RolloutEngineError(f"the vLLM rollout engine cannot start {python}: {error}") from None
        self.connection = self._connect(port, authkey, settings.start_timeout_s)
        self.connection.send(
            {
                "model": str(Path(model).absolute()),
                "dtype": dtype if settings.dtype == "auto" else settings.dtype,
                "tensor_parallel_size": settings.tensor_parallel_size,
                "gpu_memory_utilization": settings.gpu_memory_utilization,
                "quantization": settings.quantization,
                "seed": seed,
            }
        )
        self.ready = self._receive(settings.start_timeout_s, "its start")
        atexit.register(self.close)

    def _connect(self, port: int, authkey: bytes, timeout_s: float) -> Connection:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive("its start")
            try:
                return Client(("127.0.0.1", port), authkey=authkey)
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    self._fail(f"did not listen within {timeout_s:.0f} s")
                time.sleep(0.2)

    def _log_tail(self, lines: int = 30) -> str:
        text = self.log_file.read_text(errors="replace").splitlines() if self.log_file.is_file() else []
        return "\n".join(text[-lines:])

    def kill(self) -> None:
        """SIGKILL the engine's whole process group (the script, vLLM's engine core and workers)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # every process of the group has exited
        self.process.wait()
        self.ipc.cleanup()

    def _fail(self, what: str):
        self.kill()
        raise RolloutEngineError(f"the vLLM rollout engine {what}; its log: {self.log_file}\n{self._log_tail()}")

    def _check_alive(self, during: str) -> None:
        if (code := self.process.poll()) is not None:
            self.kill()  # what the script started may outlive it
            raise RolloutEngineError(
                f"the vLLM rollout engine exited with code {code} during {during}; its log: {self.log_file}\n"
                f"{self._log_tail()}"
            )

    def _receive(self, timeout_s: float, during: str) -> dict:
        """The engine's answer, waiting at most timeout_s and watching that it is alive."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.connection.poll(0.5):
                    answer = self.connection.recv()
                    break
            except (EOFError, OSError):
                try:
                    self.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                self._check_alive(during)
                self._fail(f"closed its connection during {during}")
            self._check_alive(during)
            if time.monotonic() > deadline:
                self._fail(f"did not answer within {timeout_s:.0f} s during {during}")
        if "error" in answer:
            raise RolloutEngineError(f"the vLLM rollout engine failed during {during}:\n{answer['error']}")
        return answer

    def _request(self, request: dict, during: str) -> dict:
        self._check_alive(during)
        try:
            self.connection.send(request)
        except OSError:
            self._check_alive(during)
            self._fail(f"closed its connection during {during}")
        return self._receive(self.settings.request_timeout_s, during)

    def generate(
        self, prompts: list[list[int]], seeds: list[int], temperature: float, max_tokens: int, stop_ids: list[int]
    ) -> dict:
        """One completion per prompt, each sampled with its own seed: {"completions", "logprobs", "generate_s"}."""
        request = {"prompts": prompts, "seeds": seeds, "temperature": temperature, "max_tokens": max_tokens}
        return self._request(request | {"op": "generate", "stop_token_ids": stop_ids}, "a rollout")

    def load_weights(self, model: Path) -> float:
        """Reload the weights of the HF directory `model` in place; the seconds it took."""
        return self._request({"op": "reload", "path": str(Path(model).absolute())}, "a weight reload")["reload_s"]

    def close(self) -> None:
        atexit.unregister(self.close)
        if self.process.poll() is None:
            try:
                self.connection.send({"op": "close"})
                self.connection.poll(30) and self.connection.recv()
                self.process.wait(timeout=60)
            except (OSError, EOFError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self.connection.close()
