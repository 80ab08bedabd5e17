"""GRPO's rollout step on an export: a vLLM engine (glm46.rl.engine, the serving venv's CPU build) against glm46's own
`generate` (KV cache, left-padded batch, one generator per completion), the same prompts and per-completion seeds, at
the RL temperature; stop tokens ignored so every completion decodes `--max-tokens`. Also the cost of pushing the
policy's weights to the engine after an update (HF directory written, then reloaded in place).

    python bench/rollout_throughput.py --model outputs/train/<job>/stages/sft/hf --prompts 8 --samples 8
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from timing import timed

from glm46.hf import find_weights, load_hf, save_hf
from glm46.rl.engine import RolloutSettings, VLLMRolloutEngine


def ours(model, prompts: list[list[int]], seeds: list[int], max_tokens: int, temperature: float) -> int:
    """generate over the left-padded batch, as GRPOLitModule.sample does; the new tokens."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    out = model.generate(ids, max_tokens, temperature, generator=generators, attention_mask=mask)
    return out[:, width:].numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an export (HF directory) or a run directory")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout batch")
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt (the group)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=3, help="timed rollout batches per side (after a warm-up)")
    args = parser.parse_args()
    weights = find_weights(args.model)
    model = load_hf(weights).eval()
    vocab = model.config.vocab_size
    torch.manual_seed(0)
    lengths = [40 + 3 * i for i in range(args.prompts)]  # the toy's arithmetic prompts are about 50 tokens
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in lengths for _ in range(args.samples)]
    seeds = list(range(len(prompts)))
    print(f"{weights}: {args.prompts} prompts x {args.samples} samples, {args.max_tokens} new tokens each at "
          f"T={args.temperature}, {torch.get_num_threads()} torch threads")  # fmt: skip

    def rollout() -> int:
        return ours(model, prompts, seeds, args.max_tokens, args.temperature)

    with torch.no_grad():
        rollout()  # warm-up
        runs = [timed(rollout) for _ in range(args.repeats)]
    local = sum(tokens for tokens, _, _ in runs) / sum(wall for _, wall, _ in runs)

    with tempfile.TemporaryDirectory(prefix="glm46-rollout-bench-") as folder:
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        settings = RolloutSettings(engine="vllm")
        engine, start_s, _ = timed(lambda: VLLMRolloutEngine(settings, weights, Path(folder) / "engine.log", dtype))
        try:
            request = (prompts, seeds, args.temperature, args.max_tokens, [])
            engine.generate(*request)  # warm-up
            answers = [timed(lambda: engine.generate(*request)) for _ in range(args.repeats)]
            pushes = []
            for k in range(args.repeats):
                directory, write_s, _ = timed(lambda k=k: save_hf(model, Path(folder) / f"policy-{k}"))
                pushes.append((write_s, engine.load_weights(directory)))
        finally:
            engine.close()
    tokens = sum(sum(map(len, answer["completions"])) for answer, _, _ in answers)
    engine_rate = tokens / sum(wall for _, wall, _ in answers)
    write_s, reload_s = (sum(column) / len(pushes) for column in zip(*pushes))
    print(f"{'glm46 generate':22s} {local:9.1f} tokens/s")
    print(f"{'vLLM engine (CPU)':22s} {engine_rate:9.1f} tokens/s  (engine start {start_s:.0f} s, once per run)")
    print(f"weight push per update: HF directory written in {write_s:.2f} s, reloaded in {reload_s:.2f} s")
    print(f"ratio vLLM / generate: {engine_rate / local:.2f}")


if __name__ == "__main__":
    main()
