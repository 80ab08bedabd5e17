"""What LoRA saves: the peak memory, gradient bytes and optimizer bytes of a few training steps with glm46's LoRA
(glm46.peft) against full fine-tuning of the same model, and against the peft library's LoRA on transformers'
Glm4MoeForCausalLM of the same weights (the peer), each in a process of its own (peak RSS is per process; on CUDA
torch's peak allocation). Same batches, AdamW, fp32. Then LoRA on a frozen base in block FP8 (peft.base_dtype=fp8)
against the same LoRA on a bf16 base, both under bf16 autocast: the base's bytes and the peak.

    python bench/peft_memory.py --hidden 512 --layers 6 --experts 16 --steps 4
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGETS = ["attention", "dense_mlp", "shared_experts", "experts"]
PEFT_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
PEFT_PARAMETERS = [  # the same targets in the peft library's terms (glm46.peft.peft_format)
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "shared_experts.gate_proj.weight",
    "shared_experts.up_proj.weight",
    "shared_experts.down_proj.weight",
    "experts.gate_up_proj",
    "experts.down_proj",
]


def config(args):
    from glm46.modules import GLM46Config

    return GLM46Config(
        vocab_size=8192,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        moe_intermediate_size=args.hidden // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=args.hidden // 8,
        first_k_dense_replace=1,
        n_routed_experts=args.experts,
        num_experts_per_tok=4,
        n_shared_experts=1,
        num_nextn_predict_layers=0,
    )


def child(args) -> dict:
    """One variant's steps; its measurements as a dict (printed as JSON for the parent)."""
    from glm46.hf import save_hf
    from glm46.modules import GLM46ForCausalLM
    from glm46.peft import AdapterSettings, add_adapters, reset_adapters

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch = torch.randint(0, 8192, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1)).to(device)
    inputs, labels = batch[:, :-1], batch[:, 1:]
    if args.child == "peft":  # the peer: transformers' model of the same weights under the peft library
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        folder = Path(args.folder)
        save_hf(GLM46ForCausalLM(config(args)), folder)
        base = AutoModelForCausalLM.from_pretrained(folder)
        lora = LoraConfig(
            r=args.r, lora_alpha=2 * args.r, target_modules=PEFT_MODULES, target_parameters=PEFT_PARAMETERS
        )
        model = get_peft_model(base, lora).to(device)

        def loss():
            return model(input_ids=inputs, labels=batch[:, :-1]).loss  # transformers shifts the labels itself
    else:
        model = GLM46ForCausalLM(config(args)).to(device)
        base_dtype = {"lora": "float32", "lora_bf16": "bfloat16", "lora_fp8": "fp8"}.get(args.child)
        if base_dtype is not None:
            add_adapters(model, AdapterSettings(r=args.r, alpha=2 * args.r, targets=TARGETS, base_dtype=base_dtype))
            reset_adapters(model, seed=0)
            model.to(device)
        autocast = torch.autocast(device, torch.bfloat16, enabled=base_dtype in ("bfloat16", "fp8"))

        def loss():
            with autocast:
                return model(inputs, labels=labels).loss

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    for _ in range(args.steps):
        loss().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the gradients allocated: their bytes are counted
    state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim())
    return {
        "variant": args.child,
        "trainable": sum(p.numel() for p in trainable),
        "parameters": sum(p.numel() for p in model.parameters()),
        "base_bytes": sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        - sum(p.numel() * p.element_size() for p in trainable),  # the frozen weights and the FP8 scales
        "gradient_bytes": sum(p.grad.numel() * p.grad.element_size() for p in trainable if p.grad is not None),
        "optimizer_bytes": state_bytes,
        "peak_bytes": torch.cuda.max_memory_allocated()
        if device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "device": device,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--child", choices=["full", "lora", "peft", "lora_bf16", "lora_fp8"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for variant in ("full", "lora", "peft", "lora_bf16", "lora_fp8"):
            command = [sys.executable, __file__, *sys.argv[1:], "--child", variant, "--folder", f"{folder}/{variant}"]
            out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
            results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2**20
    print(
        f"{'variant':<34} {'trainable':>12} {'share':>7} {'frozen MiB':>11} {'gradients MiB':>14} "
        f"{'optimizer MiB':>14} {'peak MiB':>9}"
    )
    names = {
        "full": "glm46, full fine-tuning",
        "lora": "glm46, LoRA",
        "peft": "peft library, LoRA (transformers)",
        "lora_bf16": "glm46, LoRA, bf16 base (autocast)",
        "lora_fp8": "glm46, LoRA, FP8 base (autocast)",
    }
    for variant, r in results.items():
        print(
            f"{names[variant]:<34} {r['trainable']:>12,} {r['trainable'] / r['parameters']:>7.2%} "
            f"{r['base_bytes'] / mib:>11.1f} {r['gradient_bytes'] / mib:>14.1f} "
            f"{r['optimizer_bytes'] / mib:>14.1f} {r['peak_bytes'] / mib:>9.0f}"
        )
    full, lora, peer = results["full"], results["lora"], results["peft"]
    print(f"LoRA / full fine-tuning: optimizer bytes {lora['optimizer_bytes'] / full['optimizer_bytes']:.3f}, "
          f"peak memory {lora['peak_bytes'] / full['peak_bytes']:.3f} ({lora['device']})")  # fmt: skip
    print(f"glm46 LoRA / peft's LoRA: trainable {lora['trainable'] / peer['trainable']:.3f}, "
          f"peak memory {lora['peak_bytes'] / peer['peak_bytes']:.3f}")  # fmt: skip
    bf16, fp8 = results["lora_bf16"], results["lora_fp8"]
    print(f"LoRA on an FP8 base / on a bf16 base: base bytes {fp8['base_bytes'] / bf16['base_bytes']:.3f}, "
          f"peak memory {fp8['peak_bytes'] / bf16['peak_bytes']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
