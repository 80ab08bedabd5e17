"""Greedy completions of token-id prompts through vLLM's offline `LLM` API, in the serving environment.

vLLM pins its own torch and transformers, so it lives in a venv of its own (scripts/serving_venv.sh) and this
file runs there as a script, importing nothing of glm46 (glm46.serve.offline starts it):

    <serving venv>/bin/python -P vllm_offline.py request.json result.json

request.json: {"model": HF dir, "prompts": [[ids], ...], "max_tokens": N, "speculative_tokens": 0 (no MTP) or
k (MTP drafts k tokens per step), "max_model_len": L, "ignore_eos": decode max_tokens whatever the stop
tokens (benchmarks), "warmup": whether to generate once, untimed, before the timed generation}.
result.json: {"completions": [[ids], ...], "engine_start_s", "generate_s", "new_tokens", "spec_decode": per
prompt {"drafted": [...], "accepted": [...]}, the draft tokens proposed and accepted at each verify step (null
without MTP), "vllm_version"}.

vLLM's engine core is a separate process started with `spawn`, which re-imports this file: the engine must
start under `if __name__ == "__main__":` or initialisation fails ("Engine core initialization failed").
"""

import json
import sys
import time


def main(request_file: str, result_file: str) -> None:
    from vllm import LLM, SamplingParams, __version__

    request = json.loads(open(request_file).read())
    k = request["speculative_tokens"]
    start = time.perf_counter()
    llm = LLM(
        model=request["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=request["max_model_len"],
        seed=0,
        disable_log_stats=False,
        per_request_spec_decode_metrics="detailed" if k else "none",  # drafted/accepted tokens per verify step
        speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None,
    )
    engine_start_s = time.perf_counter() - start
    params = SamplingParams(
        temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=request["ignore_eos"], detokenize=False
    )
    prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
    if request["warmup"]:
        llm.generate(prompts, params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - start
    completions = [list(output.outputs[0].token_ids) for output in outputs]
    steps = [output.outputs[0].spec_decode_metrics for output in outputs]
    result = {
        "completions": completions,
        "engine_start_s": engine_start_s,
        "generate_s": generate_s,
        "new_tokens": sum(map(len, completions)),
        "spec_decode": [{"drafted": m.per_step_drafted, "accepted": m.per_step_accepted} for m in steps] if k else None,
        "vllm_version": __version__,
    }
    open(result_file, "w").write(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
