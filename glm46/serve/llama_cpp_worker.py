"""llama.cpp on a GGUF file, through llama-cpp-python, in the llama.cpp venv (scripts/llama_cpp_venv.sh).

It compiles llama.cpp, so it lives in a venv of its own, and this file runs there as a script, importing nothing of
glm46 (glm46.serve.llama_cpp starts it):

    <llama.cpp venv>/bin/python -P llama_cpp_worker.py request.json result.json

request.json, {"op": "quantize"}: {"source": f16 GGUF, "output": path, "ftype": "q4_k_m"} -> llama.cpp's quantizer
(`llama_model_quantize`, as `llama-quantize` runs it); result {"seconds"}.
request.json, {"op": "evaluate"}: {"model": GGUF, "texts": [str] to tokenize (special tokens parsed), "prompts":
[[ids]] to continue greedily by "max_new_tokens" (stopping after a token of "stop_ids"), "scored": [[ids]] whose
tokens after the first are scored, "conversations": [[messages]] to render with the file's chat template}
-> result {"tokens": [[ids]], "completions": [[ids]], "nll": [sum of -log p per scored sequence], "counts": [tokens
scored], "argmax": [[the most likely next token at each scored position]], "chats": [prompt], "metadata": {the GGUF's
keys llama.cpp read, besides the vocabulary}, "llama_cpp_version"}.
"""

import ctypes
import json
import sys
import time


def quantize(request: dict) -> dict:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{request['ftype'].upper()}")
    params.nthread = request.get("threads", 0)
    start = time.perf_counter()
    status = llama_cpp.llama_model_quantize(
        request["source"].encode(), request["output"].encode(), ctypes.byref(params)
    )
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({request['source']}) returned {status}")
    return {"seconds": time.perf_counter() - start}


def evaluate(request: dict) -> dict:
    import numpy as np
    from llama_cpp import Llama, __version__

    longest = max(
        [len(p) + request["max_new_tokens"] for p in request["prompts"]] + [len(s) for s in request["scored"]]
    )
    llm = Llama(
        model_path=request["model"], n_ctx=max(longest, 64), n_batch=512, logits_all=True, verbose=False, seed=0,
        n_threads=request.get("threads") or None,
    )  # fmt: skip
    tokens = [llm.tokenize(text.encode(), add_bos=False, special=True) for text in request["texts"]]
    stops = set(request["stop_ids"])
    completions = []
    for prompt in request["prompts"]:
        llm.reset()
        llm.eval(prompt)
        new = []
        while len(new) < request["max_new_tokens"]:
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            new.append(token)
            if token in stops:
                break
            llm.eval([token])
        completions.append(new)
    nll, counts, argmax = [], [], []
    for ids in request["scored"]:
        llm.reset()
        llm.eval(ids)
        logits = llm.scores[: len(ids) - 1].astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        nll.append(float(-log_probs[np.arange(len(ids) - 1), ids[1:]].sum()))
        counts.append(len(ids) - 1)
        argmax.append(logits.argmax(axis=1).tolist())
    metadata = {key: value for key, value in llm.metadata.items() if not key.startswith("tokenizer.ggml.")}
    chats = [chat_prompt(llm, messages) for messages in request["conversations"]]
    return {
        "tokens": tokens, "completions": completions, "nll": nll, "counts": counts, "argmax": argmax, "chats": chats,
        "metadata": metadata, "llama_cpp_version": __version__,
    }  # fmt: skip


def chat_prompt(llm, messages: list[dict]) -> str:
    """The prompt the GGUF's own chat template renders for `messages` (llama-cpp-python's Jinja2 formatter, as its
    chat completions use it), up to the assistant's turn."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata["tokenizer.chat_template"]
    formatter = Jinja2ChatFormatter(template, eos_token="<|endoftext|>", bos_token="[gMASK]")
    return formatter(messages=messages).prompt


def main(request_file: str, result_file: str) -> None:
    request = json.loads(open(request_file).read())
    result = {"quantize": quantize, "evaluate": evaluate}[request["op"]](request)
    open(result_file, "w").write(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
