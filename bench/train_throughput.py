"""Training throughput: glm46 (Muon) against transformers' Glm4MoeForCausalLM (AdamW), one process, interleaved.

    python bench/train_throughput.py                 # bf16 autocast and fp32, on the default device
    python bench/train_throughput.py --dtype fp32 --steps 20

One step is forward + backward + optimizer step on a batch of 4 x 256 tokens (--batch) of the benchmark
config. Prints tokens/s of each, their ratio, the fraction of the device's measured matmul rate
that the step achieves (model FLOPs as in perf/mfu), and Muon's share of our step time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

from glm46.estimate import training_flops_per_token
from glm46.lit.callbacks.throughput import measured_matmul_flops
from glm46.modules import GLM46Config, GLM46ForCausalLM
from glm46.optim import Muon, muon_param_groups

BENCH = dict(
    vocab_size=8192, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
    first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=2, head_dim=32, n_routed_experts=16,
    num_experts_per_tok=4, n_shared_experts=1, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
)
SEQ = 256


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    """One model, its optimizer and a timed training step."""

    def __init__(self, name, model, optimizer, loss_fn, device, autocast_dtype):
        self.name, self.model, self.optimizer, self.loss_fn = name, model.to(device), optimizer, loss_fn
        self.device, self.autocast_dtype = device, autocast_dtype
        self.step_times, self.optimizer_times = [], []

    def step(self, x: torch.Tensor) -> None:
        autocast = torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype else nullcontext()
        synchronize(self.device)
        start = time.perf_counter()
        with autocast:
            loss = self.loss_fn(self.model, x)
        loss.backward()
        synchronize(self.device)
        before_optimizer = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        synchronize(self.device)
        end = time.perf_counter()
        self.step_times.append(end - start)
        self.optimizer_times.append(end - before_optimizer)


def ours(config: GLM46Config, device, autocast_dtype, ns_dtype) -> Runner:
    torch.manual_seed(0)
    model = GLM46ForCausalLM(config)
    optimizer = Muon(muon_param_groups(model), lr=1e-3, ns_dtype=ns_dtype)

    def loss_fn(m, x):
        out = m(x, labels=x.roll(-1, dims=1))
        return out.loss + (0.3 * out.mtp_loss if out.mtp_loss is not None else 0) + 1e-4 * out.balance_loss

    name = f"glm46 (Muon, NS {str(ns_dtype).removeprefix('torch.')}, MTP {config.num_nextn_predict_layers})"
    return Runner(name, model, optimizer, loss_fn, device, autocast_dtype)


def transformers_peer(device, autocast_dtype) -> Runner:
    torch.manual_seed(0)
    config = Glm4MoeConfig(**{k: v for k, v in BENCH.items() if k != "head_dim"}, head_dim=BENCH["head_dim"],
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})
    model = Glm4MoeForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return Runner(f"transformers Glm4Moe (AdamW, experts={model.config._experts_implementation})", model,
                  optimizer, lambda m, x: m(x, labels=x).loss, device, autocast_dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", choices=["bf16", "fp32", "both"], default="both")
    parser.add_argument("--batch", type=int, default=4, help="sequences of 256 tokens per step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    tokens = args.batch * SEQ
    device = torch.device(args.device)
    dtypes = {"bf16": [torch.bfloat16], "fp32": [None], "both": [torch.bfloat16, None]}[args.dtype]
    print(f"device {device}, {torch.get_num_threads()} threads; batch {args.batch} x {SEQ} tokens; config {BENCH}")

    for autocast_dtype in dtypes:
        label = "bf16 autocast" if autocast_dtype else "fp32"
        matmul_dtype = autocast_dtype or torch.float32
        peak = measured_matmul_flops(device, matmul_dtype)
        runners = [
            ours(GLM46Config(**BENCH, num_nextn_predict_layers=0), device, autocast_dtype, torch.bfloat16),
            ours(GLM46Config(**BENCH, num_nextn_predict_layers=0), device, autocast_dtype, torch.float32),
            ours(GLM46Config(**BENCH, num_nextn_predict_layers=1), device, autocast_dtype, torch.float32),
            transformers_peer(device, autocast_dtype),
        ]
        x = torch.randint(0, BENCH["vocab_size"], (args.batch, SEQ), device=device)
        for i in range(args.warmup + args.steps):
            for runner in runners:  # interleaved, so drift in machine load hits every runner alike
                runner.step(x)
                if i < args.warmup:
                    runner.step_times.clear()
                    runner.optimizer_times.clear()

        print(f"\n== {label}: measured {str(matmul_dtype).removeprefix('torch.')} matmul rate "
              f"{peak / 1e9:.1f} GFLOP/s ==")
        peer = runners[-1]
        peer_rate = tokens / statistics.median(peer.step_times)
        peer_model_rate = tokens / statistics.median([s - o for s, o in zip(peer.step_times, peer.optimizer_times)])
        for runner in runners:
            seconds = statistics.median(runner.step_times)
            rate = tokens / seconds
            model_rate = tokens / statistics.median([s - o for s, o in zip(runner.step_times, runner.optimizer_times)])
            config = getattr(runner.model, "config", None)
            if not isinstance(config, GLM46Config):  # the transformers peer has no MTP layer
                config = GLM46Config(**BENCH, num_nextn_predict_layers=0)
            fraction = rate * training_flops_per_token(config, SEQ) / peak
            optimizer_share = statistics.median(runner.optimizer_times) / seconds
            print(f"{runner.name:58s} {rate:8.0f} tokens/s  x{rate / peer_rate:5.2f} vs transformers "
                  f"(forward+backward alone x{model_rate / peer_model_rate:5.2f})  {fraction:6.1%} of matmul rate  "
                  f"optimizer {optimizer_share:5.1%} of step")


if __name__ == "__main__":
    main()
