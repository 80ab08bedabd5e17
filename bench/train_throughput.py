"""Training throughput: glm46 (Muon) against transformers' Glm4MoeForCausalLM (AdamW), one process.

    python bench/train_throughput.py                 # bf16 autocast and fp32, on the default device
    python bench/train_throughput.py --dtype fp32 --steps 20
    python bench/train_throughput.py --preset glm46_1b --dtype bf16 --batch 4   # one GPU: MFU of a ~1B-active model

One step is forward + backward + optimizer step on a batch of --batch sequences of the preset's config
and length. Prints tokens/s of each, their ratio, the fraction of the device's matmul rate that the
step achieves (model FLOPs as in perf/mfu: against the datasheet peak on a GPU Lightning knows, and
against a measured square matmul), and the optimizer's share of the step time. The `small` preset
interleaves the runners so drift in machine load hits every runner alike; `glm46_1b` runs them one
after another, so only one model and its optimizer state occupy the device at a time.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from contextlib import nullcontext

import torch
from lightning.fabric.utilities.throughput import get_available_flops
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

from glm46.estimate import count_parameters, training_flops_per_token
from glm46.lit.callbacks.throughput import measured_matmul_flops
from glm46.modules import GLM46Config, GLM46ForCausalLM
from glm46.optim import Muon, muon_param_groups

COMMON = {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "use_qk_norm": True, "attention_bias": True}
PRESETS = {  # name -> (config fields, sequence length)
    "small": (
        dict(
            vocab_size=8192,
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_hidden_layers=4,
            first_k_dense_replace=1,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            n_routed_experts=16,
            num_experts_per_tok=4,
            **COMMON,
        ),
        256,
    ),
    # GLM-4.6's shape (GQA with 128-wide heads, 2x-wide attention, top-8 routing + a shared expert, one
    # dense layer first, the 151k vocabulary) scaled to ~1.0B active parameters (3.5B total with its MTP layer).
    "glm46_1b": (
        dict(
            vocab_size=151552,
            hidden_size=2048,
            intermediate_size=5632,
            moe_intermediate_size=768,
            num_hidden_layers=16,
            first_k_dense_replace=1,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            n_routed_experts=32,
            num_experts_per_tok=8,
            **COMMON,
        ),
        4096,
    ),
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    """One model, its optimizer and a timed training step."""

    def __init__(self, name, model, optimizer, loss_fn, device, autocast_dtype, config: GLM46Config):
        self.name, self.model, self.optimizer, self.loss_fn = name, model.to(device), optimizer, loss_fn
        self.device, self.autocast_dtype, self.config = device, autocast_dtype, config
        self.step_times, self.optimizer_times = [], []

    def step(self, x: torch.Tensor, accumulate: int = 1) -> None:
        """`accumulate` forward/backward passes over x, then one optimizer step."""
        autocast = torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype else nullcontext()
        synchronize(self.device)
        start = time.perf_counter()
        for _ in range(accumulate):
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

    def release(self) -> None:
        """Free the model and optimizer state (sequential runs keep one runner on the device at a time)."""
        self.model = self.optimizer = None
        gc.collect()  # an out-of-memory traceback's frames may still hold activations
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def ours(config: GLM46Config, device, autocast_dtype, ns_dtype) -> Runner:
    torch.manual_seed(0)
    model = GLM46ForCausalLM(config)
    optimizer = Muon(muon_param_groups(model), lr=1e-3, ns_dtype=ns_dtype)

    def loss_fn(m, x):
        out = m(x, labels=x.roll(-1, dims=1))
        return out.loss + (0.3 * out.mtp_loss if out.mtp_loss is not None else 0) + 1e-4 * out.balance_loss

    name = f"glm46 (Muon, NS {str(ns_dtype).removeprefix('torch.')}, MTP {config.num_nextn_predict_layers})"
    return Runner(name, model, optimizer, loss_fn, device, autocast_dtype, config)


def transformers_peer(fields: dict, device, autocast_dtype) -> Runner:
    torch.manual_seed(0)
    config = Glm4MoeConfig(
        **fields, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}
    )
    model = Glm4MoeForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return Runner(
        f"transformers Glm4Moe (AdamW, experts={model.config._experts_implementation})",
        model,
        optimizer,
        lambda m, x: m(x, labels=x).loss,
        device,
        autocast_dtype,
        GLM46Config(**fields, num_nextn_predict_layers=0),
    )  # no MTP layer: FLOPs counted without one


def runner_factories(fields: dict, device, autocast_dtype, preset: str, peer: bool) -> list:
    """Ours (bf16 and fp32 Newton-Schulz, with and without MTP on the small preset), then the peer."""

    def ours_with(mtp: int, ns_dtype: torch.dtype):
        return lambda: ours(GLM46Config(**fields, num_nextn_predict_layers=mtp), device, autocast_dtype, ns_dtype)

    variants = (
        [(0, torch.bfloat16)] if preset == "glm46_1b" else [(0, torch.bfloat16), (0, torch.float32), (1, torch.float32)]
    )
    peers = [lambda: transformers_peer(fields, device, autocast_dtype)] if peer else []
    return [ours_with(*v) for v in variants] + peers


def timed(runners: list[Runner], x: torch.Tensor, warmup: int, steps: int, accumulate: int) -> None:
    for i in range(warmup + steps):
        for runner in runners:
            runner.step(x, accumulate)
            if i < warmup:
                runner.step_times.clear()
                runner.optimizer_times.clear()


def run_all(factories: list, x: torch.Tensor, args) -> list[Runner | str]:
    """Interleaved for small models; one after another (freeing each) when they are large. A runner
    that does not fit on the device is reported, not fatal."""
    if not args.sequential:
        runners = [make() for make in factories]
        timed(runners, x, args.warmup, args.steps, args.accumulate)
        return runners
    results = []
    for make in factories:
        runner = make()
        if args.compile:
            runner.model.compile()
        try:
            timed([runner], x, args.warmup, args.steps, args.accumulate)
            if x.is_cuda:
                print(f"{runner.name}: peak device memory {torch.cuda.max_memory_allocated(x.device) / 2**30:.1f} GiB")
                torch.cuda.reset_peak_memory_stats(x.device)
            results.append(runner)
        except torch.OutOfMemoryError as error:
            results.append(f"out of memory ({str(error).splitlines()[0][:80]})")
        runner.release()
    return results


def report(results: list, tokens: int, seq: int, peaks: dict[str, float]) -> None:
    last = results[-1]
    peer = last if isinstance(last, Runner) and last.name.startswith("transformers") else None

    def rates(runner: Runner) -> tuple[float, float]:
        model_seconds = [s - o for s, o in zip(runner.step_times, runner.optimizer_times)]
        return tokens / statistics.median(runner.step_times), tokens / statistics.median(model_seconds)

    for result in results:
        if not isinstance(result, Runner):
            print(f"{'(runner)':58s} {result}")
            continue
        rate, model_rate = rates(result)
        versus = ""
        if peer is not None:
            peer_rate, peer_model_rate = rates(peer)
            alone = model_rate / peer_model_rate
            versus = f"x{rate / peer_rate:5.2f} vs transformers (forward+backward alone x{alone:5.2f})"
        flops = rate * training_flops_per_token(result.config, seq)
        fractions = "  ".join(f"{flops / peak:6.1%} of {name}" for name, peak in peaks.items())
        optimizer_share = statistics.median(result.optimizer_times) / statistics.median(result.step_times)
        print(
            f"{result.name:58s} {rate:8.0f} tokens/s  {versus}  {fractions}  optimizer {optimizer_share:5.1%} of step"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", choices=["bf16", "fp32", "both"], default="both")
    parser.add_argument("--batch", type=int, default=4, help="sequences of the preset's length per step")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-peer", action="store_true", help="ours alone (the peer may not fit the device)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each model (sequential runs)")
    args = parser.parse_args()
    fields, seq = PRESETS[args.preset]
    args.sequential = args.preset != "small"
    tokens = args.accumulate * args.batch * seq
    device = torch.device(args.device)
    dtypes = {"bf16": [torch.bfloat16], "fp32": [None], "both": [torch.bfloat16, None]}[args.dtype]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(
        f"device {device} ({where}), torch {torch.__version__}; {args.accumulate} x batch {args.batch} x {seq} "
        f"tokens per step; preset {args.preset}: {fields}"
    )
    print({k: f"{v:,}" for k, v in count_parameters(GLM46Config(**fields, num_nextn_predict_layers=1)).items()})

    for autocast_dtype in dtypes:
        label = "bf16 autocast" if autocast_dtype else "fp32"
        matmul_dtype = autocast_dtype or torch.float32
        peaks = {
            "measured matmul": measured_matmul_flops(device, matmul_dtype, size=8192 if device.type == "cuda" else 2048)
        }
        datasheet = get_available_flops(device, matmul_dtype)
        if datasheet:
            peaks = {"datasheet peak": datasheet, **peaks}
        torch.manual_seed(0)
        x = torch.randint(0, fields["vocab_size"], (args.batch, seq), device=device)
        results = run_all(runner_factories(fields, device, autocast_dtype, args.preset, not args.no_peer), x, args)
        print(
            f"\n== {label}: " + ", ".join(f"{name} {peak / 1e12:.1f} TFLOP/s" for name, peak in peaks.items()) + " =="
        )
        report(results, tokens, seq, peaks)


if __name__ == "__main__":
    main()
