"""GRPO's rollout engine: vLLM's offline `LLM` held open in the serving environment, answering a trainer's requests.

vLLM pins its own torch and transformers, so it lives in a venv of its own (scripts/serving_venv.sh) and this file
runs there as a script, importing nothing of glm46 (glm46.rl.engine starts it and is its only client):

    GLM46_ROLLOUT_AUTHKEY=<hex> <serving venv>/bin/python -P vllm_rollout.py <port>

It listens on 127.0.0.1:<port> (multiprocessing.connection, authenticated by the key) for one trainer, which sends,
as pickled dicts:
- {"model": HF dir, "dtype", "tensor_parallel_size", "gpu_memory_utilization", "quantization", "seed"} first:
  the engine starts and answers {"engine_start_s", "vllm_version"};
- {"op": "generate", "prompts": [[ids], ...], "seeds": [int, ...], "temperature", "max_tokens", "stop_token_ids"}:
  one completion per prompt, sampled with its own seed, answered with {"completions": [[ids]], "logprobs":
  [[float]] (each sampled token's log-prob after the temperature, vLLM's "processed_logprobs"), "generate_s"};
- {"op": "reload", "path": HF dir}: the weights reloaded in place from that directory's safetensors (vLLM's
  `reload_weights`, the path its CPU build has: no NCCL weight transfer there), answered with {"reload_s"};
- {"op": "close"}: answered with {}, then the engine exits.
An exception inside a request is answered with {"error": traceback} and the engine keeps serving.

vLLM's engine core is a separate process started with `spawn`, which re-imports this file: the engine must start
under `if __name__ == "__main__":`.
"""

import os
import sys
import time
import traceback
from multiprocessing.connection import Listener


def start(settings: dict):
    from vllm import LLM, __version__

    started = time.perf_counter()
    llm = LLM(
        model=settings["model"],
        dtype=settings["dtype"],
        enforce_eager=True,
        tensor_parallel_size=settings["tensor_parallel_size"],
        gpu_memory_utilization=settings["gpu_memory_utilization"],
        quantization=settings["quantization"],
        seed=settings["seed"],
        logprobs_mode="processed_logprobs",  # after the temperature: what the trainer's log-probs divide by
        enable_prefix_caching=False,  # a cached prefix would outlive a weight reload
    )
    return llm, {"engine_start_s": time.perf_counter() - started, "vllm_version": __version__}


def generate(llm, request: dict) -> dict:
    from vllm import SamplingParams

    params = [
        SamplingParams(
            temperature=request["temperature"],
            max_tokens=request["max_tokens"],
            stop_token_ids=request["stop_token_ids"],
            seed=seed,
            logprobs=0,  # the sampled token's own log-prob
            detokenize=False,
        )
        for seed in request["seeds"]
    ]
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in request["prompts"]], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    completions = [list(output.outputs[0].token_ids) for output in outputs]
    logprobs = [
        [step[token].logprob for token, step in zip(output.outputs[0].token_ids, output.outputs[0].logprobs)]
        for output in outputs
    ]
    return {"completions": completions, "logprobs": logprobs, "generate_s": seconds}


def prepack_cpu_experts(worker) -> int:
    """Repack the routed experts into the CPU kernel's grouped-gemm layout; the number of MoE layers repacked.

    vLLM 0.32's `reload_weights` loads the experts in the checkpoint's layout but skips the CPU kernel's prepack on a
    weight update (UnquantizedFusedMoEMethod._setup_kernel calls `fused_experts.process_weights_after_loading` on
    the first load only): the reloaded experts would compute garbage. Found by comparing every parameter before
    and after a reload of the same directory (only w13/w2 differed, and equalled the raw checkpoint)."""
    layers = 0
    for module in worker.model_runner.model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and hasattr(module, "w13_weight"):
            kernel.fused_experts.process_weights_after_loading(module)
            layers += 1
    return layers


def reload(llm, request: dict) -> dict:
    from vllm.platforms import current_platform

    started = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": request["path"]})
    if current_platform.is_cpu():
        llm.collective_rpc(prepack_cpu_experts)
    return {"reload_s": time.perf_counter() - started}


def serve(port: int) -> None:
    authkey = bytes.fromhex(os.environ["GLM46_ROLLOUT_AUTHKEY"])
    with Listener(("127.0.0.1", port), authkey=authkey) as listener, listener.accept() as connection:
        llm, ready = start(connection.recv())
        connection.send(ready)
        while True:
            request = connection.recv()
            if request["op"] == "close":
                connection.send({})
                return
            try:
                connection.send({"generate": generate, "reload": reload}[request["op"]](llm, request))
            except Exception:
                connection.send({"error": traceback.format_exc()})


if __name__ == "__main__":
    serve(int(sys.argv[1]))
