"""Decode throughput of an export: vLLM's CPU build (without and with MTP speculative decoding) against glm46's
own `GLM46ForCausalLM.generate` (KV cache, left-padded batch), same prompts, greedy, the same number of new
tokens (stop tokens ignored, so every row decodes `--max-tokens`); the tokens must be identical.

vLLM runs in the serving venv (bash scripts/serving_venv.sh), one engine per configuration; its start-up is
reported apart. Both sides are timed after one untimed warm-up generation of the same batch.

    python bench/serve_throughput.py --model outputs/train/<job>/hf --prompts 8 --max-tokens 64
"""

from __future__ import annotations

import argparse

import torch
from timing import timed

from glm46.data.chat import render_chat
from glm46.data.tokenizer import GLMTokenizer
from glm46.hf import find_weights, load_hf
from glm46.serve.offline import serving_python, vllm_generate

QUESTIONS = [
    "What is 7 times 8?",
    "Write a Python function that reverses a list.",
    "Name three prime numbers.",
    "What does the zip builtin do?",
    "Add 12 and 30.",
    "Explain a dictionary in one sentence.",
    "What is 9 minus 4?",
    "How do I open a file in Python?",
]


def prompts(tokenizer: GLMTokenizer, count: int) -> list[list[int]]:
    """`count` chat prompts of different lengths (a question, repeated 1, 2, ... times)."""
    texts = [" ".join([QUESTIONS[i % len(QUESTIONS)]] * (1 + i // 2)) for i in range(count)]
    return [tokenizer.encode(render_chat([{"role": "user", "content": t}], add_generation_prompt=True)) for t in texts]


def ours(model, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    """glm46's generate over the left-padded batch: the new tokens of each row."""
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    return model.generate(ids, max_tokens, attention_mask=mask)[:, width:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an export (HF directory) or a run directory")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--speculative-tokens", type=int, nargs="+", default=[1], help="MTP drafts per step")
    args = parser.parse_args()
    python = serving_python()
    if python is None:
        raise SystemExit("no serving venv: run `bash scripts/serving_venv.sh` first")
    weights = find_weights(args.model)
    batch = prompts(GLMTokenizer.from_file(weights / "tokenizer.json"), args.prompts)
    model = load_hf(weights).eval()
    new_tokens = args.prompts * args.max_tokens
    print(f"{weights}: {args.prompts} prompts of {min(map(len, batch))}-{max(map(len, batch))} tokens, "
          f"{args.max_tokens} new tokens each, greedy, {torch.get_num_threads()} torch threads")  # fmt: skip

    ours(model, batch, args.max_tokens)  # warm-up
    reference, wall, _ = timed(lambda: ours(model, batch, args.max_tokens))
    rates = {"glm46 generate (KV cache)": new_tokens / wall}
    for k in [0, *args.speculative_tokens]:
        name = f"vLLM CPU, MTP {k} draft{'s' * (k > 1)}/step" if k else "vLLM CPU"
        result = vllm_generate(python, weights, batch, args.max_tokens, k, 1024, warmup=True, ignore_eos=True)
        rates[name] = result["new_tokens"] / result["generate_s"]
        note = f"engine start {result['engine_start_s']:.0f} s; tokens identical: {result['completions'] == reference}"
        if k:
            steps = [step for request in result["spec_decode"] for step in zip(request["drafted"], request["accepted"])]
            note += f"; acceptance {sum(a for _, a in steps) / max(sum(d for d, _ in steps), 1):.3f}"
        print(f"{name:32s} {rates[name]:8.1f} tokens/s  ({note})")
    print(f"{'glm46 generate (KV cache)':32s} {rates['glm46 generate (KV cache)']:8.1f} tokens/s")
    base = rates["vLLM CPU"]
    for name, rate in rates.items():
        if name != "vLLM CPU":
            print(f"ratio: {name} / vLLM CPU = x{rate / base:.2f}")


if __name__ == "__main__":
    main()
