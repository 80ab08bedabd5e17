"""Size and quality of each export format of one model: the export as trained (its own dtype, read by glm46),
bf16, block FP8 (task=export export.format=fp8, read back dequantized by glm46), and GGUF f16 / q8_0 / q4_k_m
(task=export export.format=gguf, run by llama.cpp in the venv of scripts/llama_cpp_venv.sh). Quality is the
perplexity on held-out documents of the prepared dataset (the first --documents held-out documents of each of
--domains, cut to --tokens tokens), as a ratio to the export as trained; size: the bytes of each export's weights.

    python bench/export_quality.py --model outputs/train/<job> --dataset ~/.cache/glm46/embedded
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch
from torch.nn.functional import cross_entropy

from glm46.checkpoint.fp8 import export_fp8
from glm46.checkpoint.gguf_export import GGUF_TYPES, export_gguf
from glm46.data.shards import read_index
from glm46.eval.lm_eval_tasks import held_out
from glm46.hf import find_weights, load_hf
from glm46.serve.llama_cpp import BUILD_SCRIPT, llama_cpp_evaluate, llama_cpp_python


def held_out_ids(
    dataset: Path, domains: list[str], documents: int, tokens: int, val_fraction: float
) -> list[list[int]]:
    tokens_dir = dataset / "tokens"
    ids = []
    for domain in domains or read_index(tokens_dir)["domains"]:
        _, docs = held_out(tokens_dir, domain, val_fraction)
        ids += [doc[:tokens].tolist() for doc in docs[:documents] if len(doc) > 1]
    return ids


def our_perplexity(weights: Path, scored: list[list[int]], dtype: torch.dtype | None = None) -> float:
    model = load_hf(weights).eval()
    model = model.to(dtype) if dtype else model
    nll, count = 0.0, 0
    with torch.no_grad():
        for ids in scored:
            logits = model(torch.tensor([ids[:-1]])).logits[0].float()
            nll += float(cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
            count += len(ids) - 1
    return math.exp(nll / count)


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix in (".safetensors", ".gguf"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a run directory or an HF directory")
    parser.add_argument("--dataset", required=True, help="the prepared dataset the model's held-out documents are in")
    parser.add_argument("--domains", default="math,reasoning,sft", help="comma-separated; empty: every domain")
    parser.add_argument("--documents", type=int, default=16, help="held-out documents per domain")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per document")
    parser.add_argument("--val-fraction", type=float, default=0.02, help="the DataModules' held-out share")
    args = parser.parse_args()
    python = llama_cpp_python()
    if python is None:
        raise SystemExit(f"no llama.cpp venv: run bash {BUILD_SCRIPT}")
    source = find_weights(args.model)
    domains = [d for d in args.domains.split(",") if d]
    scored = held_out_ids(Path(args.dataset), domains, args.documents, args.tokens, args.val_fraction)
    rows = {"as trained": (weight_bytes(source), our_perplexity(source, scored))}
    rows["bf16"] = (None, our_perplexity(source, scored, torch.bfloat16))
    with tempfile.TemporaryDirectory(prefix="glm46-export-quality-") as folder:
        fp8 = export_fp8(source, Path(folder) / "fp8")
        rows["FP8 (block 128)"] = (weight_bytes(fp8), our_perplexity(fp8, scored))
        for gguf_type in GGUF_TYPES:
            path = export_gguf(source, Path(folder) / gguf_type, gguf_type)
            result = llama_cpp_evaluate(python, path, scored=scored)
            rows[f"GGUF {gguf_type}"] = (path.stat().st_size, math.exp(sum(result["nll"]) / sum(result["counts"])))
    reference = rows["as trained"][1]
    print(f"{len(scored)} held-out documents of {domains or 'every domain'}, {sum(len(s) - 1 for s in scored)} tokens")
    print(f"{'format':18s} {'size on disk':>14s} {'perplexity':>11s} {'/ as trained':>13s}")
    for name, (size, perplexity) in rows.items():
        shown = f"{size / 2**20:.2f} MiB" if size else "-"
        print(f"{name:18s} {shown:>14s} {perplexity:11.4f} {perplexity / reference:13.4f}")


if __name__ == "__main__":
    main()
