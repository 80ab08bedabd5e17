"""Training throughput: glm46 against torchtitan (or transformers) on the same MoE shape, in one process.

    python bench/train_throughput.py                                  # CPU: small preset, fp32, 4..32 x 256
    python bench/train_throughput.py --peer torchtitan transformers --batch 4 32
    python bench/train_throughput.py --peer                           # glm46 alone
    python bench/train_throughput.py --preset glm46_1b --dtype bf16 --compile --batch 2 --accumulate 8   # one GPU

One step is forward + backward + optimizer step on --batch sequences of the preset's length. The rows:
glm46 with AdamW (the peer's optimizer family), glm46 with Muon (Newton-Schulz in the matmul dtype, as
conf/optim/muon.yaml resolves it), and the peer with AdamW (torchtitan: its fused AdamW and its defaults,
`bench/torchtitan_glm.py` for its model; transformers: `Glm4MoeForCausalLM`). Every model starts from the
same weights. Prints tokens/s, the ratio to the peer (whole step, and forward + backward alone), the
fraction of the device's matmul rate (model FLOPs counted one way for all, glm46.planning.counts's torchtitan
convention, against the datasheet peak where Lightning knows the GPU and a measured square matmul) and
the optimizer's share of the step. Runners are interleaved step by step so drift in machine load hits
all alike; `glm46_1b` runs them one after another, so only one model occupies the device at a time.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from lightning.fabric.utilities.throughput import get_available_flops
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

from glm46.lit.callbacks.throughput import measured_matmul_flops
from glm46.modules import GLM46Config, GLM46ForCausalLM
from glm46.optim import Muon, muon_param_groups
from glm46.planning.counts import count_parameters, training_flops_per_token

sys.path.insert(0, str(Path(__file__).resolve().parent))

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
ADAMW = dict(lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # torchtitan's default_adamw


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

    def rates(self, tokens: int) -> tuple[float, float]:
        """Median tokens/s of the whole step and of its forward + backward alone."""
        model_seconds = [s - o for s, o in zip(self.step_times, self.optimizer_times)]
        return tokens / statistics.median(self.step_times), tokens / statistics.median(model_seconds)

    def release(self) -> None:
        """Free the model and optimizer state (sequential runs keep one runner on the device at a time)."""
        self.model = self.optimizer = None
        gc.collect()  # an out-of-memory traceback's frames may still hold activations
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def glm46_model(fields: dict, mtp: int) -> GLM46ForCausalLM:
    torch.manual_seed(0)
    return GLM46ForCausalLM(GLM46Config(**fields, num_nextn_predict_layers=mtp))


def glm46_loss(model, x):
    out = model(x, labels=x.roll(-1, dims=1))
    return out.loss + (0.3 * out.mtp_loss if out.mtp_loss is not None else 0) + 1e-4 * out.balance_loss


def ours(fields: dict, device, autocast_dtype, optimizer: str, mtp: int = 0) -> Runner:
    """glm46 with Muon (Newton-Schulz in the matmul dtype, as the configs resolve it) or torch's AdamW."""
    model = glm46_model(fields, mtp)
    if optimizer == "muon":
        ns_dtype = autocast_dtype or torch.float32
        opt, label = Muon(muon_param_groups(model), lr=1e-3, ns_dtype=ns_dtype), f"Muon, NS {ns_dtype}"
    else:
        opt, label = torch.optim.AdamW(model.parameters(), **ADAMW), "AdamW"
    name = f"glm46 ({label.replace('torch.', '')}{f', MTP {mtp}' if mtp else ''})"
    return Runner(name, model, opt, glm46_loss, device, autocast_dtype, model.config)


def ours_float8(fields: dict, device, autocast_dtype) -> Runner:
    """glm46 with AdamW, the dense linears of its decoder layers trained in float8 through torchao (torchtitan's
    float8 converter: dynamic tensorwise scales, e4m3 forward, e5m2 gradients); the embeddings, the lm_head, the
    router and the grouped experts as before. Measured by bench/gpu_suite.py before it becomes an option of run.py
    (issue: kept only where it pays); fp8 matmuls need dimensions that are multiples of 16."""
    from torchao.float8 import convert_to_float8_training

    from glm46.modules.model import decoder_layers

    runner = ours(fields, device, autocast_dtype, "adamw")
    inside = {id(m) for layer in decoder_layers(runner.model) for m in layer.modules()}

    def converted(module: torch.nn.Module, name: str) -> bool:
        return id(module) in inside and module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(runner.model, module_filter_fn=converted)  # the same Parameters: the optimizer's
    runner.name = "glm46 (AdamW, float8 linears)"
    return runner


def ours_fsdp2(fields: dict, device) -> Runner:
    """glm46 with AdamW laid out as run.py lays out `parallelism=fsdp2` on one rank under trainer.precision=bf16-mixed
    (glm46.parallel.parallelize): FSDP2's policy keeps bf16 weights for the step, fp32 masters for the optimizer and
    fp32 reductions, and nothing runs under autocast (torchtitan's mixed precision, on one GPU as on many)."""
    import torch.distributed as dist

    from glm46.parallel.layout import Layout
    from glm46.parallel.mesh import build_mesh
    from glm46.parallel.parallelize import parallelize

    if not dist.is_initialized():  # one rank: an in-process store, no ports
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    model = glm46_model(fields, 0).to(device)
    policy = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    parallelize(model, Layout(1), build_mesh(Layout(1), device.type), mixed_precision=policy)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    return Runner("glm46 (AdamW, FSDP2 bf16 weights)", model, optimizer, glm46_loss, device, None, model.config)


def torchtitan_peer(fields: dict, seq: int, device, autocast_dtype, attention: str) -> Runner:
    """torchtitan's decoder with GLM-4.6's shape and glm46's initial weights, its fused AdamW and defaults."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan_glm import glm46_state_dict, torchtitan_glm

    config = GLM46Config(**fields, num_nextn_predict_layers=0)
    model = torchtitan_glm(config, seq, attention, grouped_mm=device.type == "cuda")
    model.load_state_dict(glm46_state_dict(glm46_model(fields, 0)))
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)

    def loss_fn(m, x):
        # FlexAttention takes its block mask (causal: one document per row, so no tokenizer is read)
        logits = m(x) if attention == "sdpa" else m(x, m.get_attention_masks(x, tokenizer=None))
        return cross_entropy_loss(logits, x.roll(-1, dims=1)) / x.numel()

    name = f"torchtitan (AdamW fused, {attention})"
    return Runner(name, model, optimizer, loss_fn, device, autocast_dtype, config)


def transformers_twin(fields: dict, model: GLM46ForCausalLM) -> Glm4MoeForCausalLM:
    """transformers' Glm4MoeForCausalLM of the preset `fields` (GLM46Config's default RoPE) holding `model`'s weights
    (the same names)."""
    rope = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}
    twin = Glm4MoeForCausalLM(Glm4MoeConfig(**fields, rope_parameters=rope))
    twin.load_state_dict(model.state_dict())
    return twin


def transformers_peer(fields: dict, device, autocast_dtype) -> Runner:
    """transformers' Glm4MoeForCausalLM with glm46's initial weights and torch's AdamW."""
    model = transformers_twin(fields, glm46_model(fields, 0))
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    name = f"transformers Glm4Moe (AdamW, experts={model.config._experts_implementation})"
    config = GLM46Config(**fields, num_nextn_predict_layers=0)  # FLOPs counted without an MTP layer
    return Runner(name, model, optimizer, lambda m, x: m(x, labels=x).loss, device, autocast_dtype, config)


def runner_factories(fields: dict, seq: int, device, autocast_dtype, args) -> list:
    """glm46 with AdamW and with Muon, then the peers."""
    peers = {
        "torchtitan": lambda: torchtitan_peer(fields, seq, device, autocast_dtype, args.titan_attention),
        "transformers": lambda: transformers_peer(fields, device, autocast_dtype),
    }
    return [
        lambda: ours(fields, device, autocast_dtype, "adamw"),
        lambda: ours(fields, device, autocast_dtype, "muon", args.mtp),
        *(peers[name] for name in args.peer),
    ]


def compile_blocks(model: torch.nn.Module) -> None:
    """torch.compile every decoder block, as torchtitan's apply_compile does (the MoE's token counts are
    data-dependent, hence scalar outputs captured). Not fullgraph: glm46's fp32 experts run between graphs."""
    torch._dynamo.config.capture_scalar_outputs = True
    layers = model.model.layers if hasattr(model, "model") else model.layers  # glm46, transformers / torchtitan
    for block in layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers:
        block.compile()


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
        if args.compile:
            for runner in runners:
                compile_blocks(runner.model)
        timed(runners, x, args.warmup, args.steps, args.accumulate)
        return runners
    results = []
    for make in factories:
        runner = make()
        if args.compile:
            compile_blocks(runner.model)
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


def report(results: list, tokens: int, seq: int, peaks: dict[str, float], peers: list[str]) -> None:
    """A row per runner; glm46's rows with their ratio to each peer (whole step, and forward + backward)."""
    peer_runners = dict(zip(peers, results[len(results) - len(peers) :]))
    for result in results:
        if not isinstance(result, Runner):
            print(f"{'(runner)':44s} {result}")
            continue
        rate, model_rate = result.rates(tokens)
        versus = []
        for name, peer in peer_runners.items():
            if isinstance(peer, Runner) and result.name.startswith("glm46"):
                peer_rate, peer_model_rate = peer.rates(tokens)
                versus.append(f"x{rate / peer_rate:5.2f} vs {name} (fwd+bwd x{model_rate / peer_model_rate:5.2f})")
        flops = rate * training_flops_per_token(result.config, seq)
        fractions = "  ".join(f"{flops / peak:6.1%} of {name}" for name, peak in peaks.items())
        optimizer_share = statistics.median(result.optimizer_times) / statistics.median(result.step_times)
        optimizer = f"optimizer {optimizer_share:5.1%} of step"
        print(f"{result.name:44s} {rate:8.0f} tokens/s  {fractions}  {optimizer}  {'  '.join(versus)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--peer", nargs="*", choices=["torchtitan", "transformers"], default=["torchtitan"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--dtype", choices=["bf16", "fp32", "both"], default=None, help="default: bf16 on a GPU, fp32 on a CPU"
    )
    parser.add_argument(
        "--batch", type=int, nargs="+", default=None, help="sequences per step; default 4 8 16 32 (CPU), 4 (GPU)"
    )
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--mtp", type=int, default=0, help="MTP layers of glm46's Muon row")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true", help="torch.compile every decoder block (all runners)")
    parser.add_argument(
        "--titan-attention", choices=["sdpa", "flex"], default="sdpa", help="torchtitan's inner attention"
    )
    args = parser.parse_args()
    fields, seq = PRESETS[args.preset]
    args.sequential = args.preset != "small"
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    batches = args.batch or ([4] if gpu else [4, 8, 16, 32])
    dtypes = {"bf16": [torch.bfloat16], "fp32": [None], "both": [torch.bfloat16, None]}[
        args.dtype or ("bf16" if gpu else "fp32")
    ]
    where = torch.cuda.get_device_name(device) if gpu else f"{torch.get_num_threads()} threads"
    print(f"device {device} ({where}), torch {torch.__version__}; preset {args.preset}, {seq} tokens per sequence")
    print(fields)
    print({k: f"{v:,}" for k, v in count_parameters(GLM46Config(**fields, num_nextn_predict_layers=args.mtp)).items()})

    for autocast_dtype in dtypes:
        matmul_dtype = autocast_dtype or torch.float32
        peaks = {"measured matmul": measured_matmul_flops(device, matmul_dtype, size=8192 if gpu else 2048)}
        datasheet = get_available_flops(device, matmul_dtype)
        if datasheet:
            peaks = {"datasheet peak": datasheet, **peaks}
        for batch in batches:
            torch.manual_seed(0)
            x = torch.randint(0, fields["vocab_size"], (batch, seq), device=device)
            results = run_all(runner_factories(fields, seq, device, autocast_dtype, args), x, args)
            label = "bf16 autocast" if autocast_dtype else "fp32"
            rates = ", ".join(f"{name} {peak / 1e12:.2f} TFLOP/s" for name, peak in peaks.items())
            print(f"\n== {label}, {args.accumulate} x {batch} x {seq} tokens per step ({rates}) ==")
            report(results, args.accumulate * batch * seq, seq, peaks, args.peer)


if __name__ == "__main__":
    main()
