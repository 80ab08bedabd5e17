"""The GPU suite: what only a GPU shows, in one command of under 10 minutes on one H100, as one table and a JSON file.

    python bench/gpu_suite.py                      # on a GPU machine; scripts/device_wheels.sh has the wheels to carry
    python bench/gpu_suite.py --cpu                # every part that runs on a CPU, small (CI runs it)
    python bench/gpu_suite.py --only packed context --json results.json

The parts, cheapest first, each a row or more of the table (pass, FAIL, info or skip):
  environment   torch, CUDA and the card; the wheels the GPU image lacks are exactly scripts/device_wheels.sh's
  parity        glm46 against transformers' Glm4MoeForCausalLM (the same weights): logits in fp32, and in bf16 each
                model's error against the fp32 logits
  packed        packed documents' attention, 8 rows of 4K tokens of many documents: the variable-length CUDA kernel
                against the per-document loop (values, gradients, speed-up); glm46.modules.cuda_kernels
  context       context parallelism's CUDA block kernels against one device's attention, cp = 2 and 4 ranks
                simulated on one device (outputs per rank, gradients summed over the ranks), bf16 and fp32
  compile       the model under torch.compile (each block, grouped experts inside) against eager: logits, gradients
  throughput    glm46_1b, bf16, compiled, with AdamW and with Muon, against torchtitan in GLM's shape
                (bench/torchtitan_glm.py) in the same run: tokens/s, MFU and the ratio; Muon's Newton-Schulz share
  syncs         a bf16 training step under CUDA's sync debug mode: no op may wait for the device on the host
  memory        one eager step's peak device memory against task=plan's estimate for the same shape and optimizer,
                and with each layer recomputed in backward (activation checkpointing): its memory and step time
  user_path     `python run.py` (Lightning, every callback, compiled layers) on the throughput rows' model and batch:
                its tokens/s against the suite's glm46 Muon row, the target within 5%

A part that fails reports its error in its row and the next part runs; the JSON is rewritten after every part, so
a run stopped by its time limit keeps what it measured. `--budget` seconds: parts not started by then are skipped.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from train_throughput import COMMON, compile_blocks, transformers_twin  # noqa: E402

from glm46.modules import GLM46Config, GLM46ForCausalLM, cuda_kernels  # noqa: E402
from glm46.modules.attention import Documents, packed_attention, per_document_attention  # noqa: E402


@dataclass
class Row:
    part: str
    check: str
    value: str
    verdict: str  # pass, FAIL, info, skip
    detail: str = ""


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """max |ours - reference| / max |reference|, in fp32."""
    reference = reference.float()
    return ((ours.float() - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


def verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn, device: torch.device, repeats: int) -> float:
    """Median wall seconds of fn() after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


# --- environment ---------------------------------------------------------------------------------------------


def wheel_list() -> list[str]:
    """The name==version specs of scripts/device_wheels.sh."""
    text = (ROOT / "scripts" / "device_wheels.sh").read_text()
    block = re.search(r"WHEELS=\((.*?)\n\)", text, re.S).group(1)
    lines = (line.split("#")[0] for line in block.splitlines())
    return [spec for line in lines for spec in line.split()]


def environment(args, device: torch.device) -> list[Row]:
    from importlib.metadata import PackageNotFoundError, version

    card = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    rows = [
        Row("environment", "device", card, "info", f"Python {platform.python_version()}, torch {torch.__version__}"),
    ]
    # Every wheel of the list installed where the suite runs, at the pinned version: on the GPU machine, what was
    # carried; here, the versions the project's install resolved (a drift here is reported, to update the list).
    missing, drifted = [], []
    for spec in wheel_list():
        name, pinned = spec.split("==")
        try:
            installed = version(name)
        except PackageNotFoundError:
            missing.append(name)
            continue
        if installed != pinned:
            drifted.append(f"{name} {installed} (list: {pinned})")
    exact = not missing and (not drifted or device.type == "cpu")
    rows.append(
        Row(
            "environment",
            "scripts/device_wheels.sh pins installed",
            f"{len(wheel_list()) - len(missing) - len(drifted)}/{len(wheel_list())}",
            verdict(exact),
            "; ".join(
                [f"missing: {', '.join(missing)}"] * bool(missing) + [f"drifted: {', '.join(drifted)}"] * bool(drifted)
            ),
        )
    )
    return rows


# --- parity --------------------------------------------------------------------------------------------------

PARITY_CONFIG = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    n_routed_experts=16,
    num_experts_per_tok=4,
    num_nextn_predict_layers=0,
    max_position_embeddings=4096,
    **COMMON,  # GLM-4.6's values where transformers' Glm4MoeConfig defaults differ
)


def parity(args, device: torch.device) -> list[Row]:
    torch.manual_seed(0)
    ours = GLM46ForCausalLM(GLM46Config(**PARITY_CONFIG)).eval()
    theirs = transformers_twin(PARITY_CONFIG, ours).eval()
    ours.to(device), theirs.to(device)
    x = torch.randint(0, PARITY_CONFIG["vocab_size"], (2, 512 if device.type == "cuda" else 64), device=device)
    with torch.no_grad():
        exact = theirs(x).logits
        fp32 = relative_error(ours(x).logits, exact)
        ours.bfloat16(), theirs.bfloat16()
        bf16_ours, bf16_theirs = relative_error(ours(x).logits, exact), relative_error(theirs(x).logits, exact)
    return [
        Row("parity", "glm46 vs transformers, fp32 logits (rel. error)", f"{fp32:.2e}", verdict(fp32 < 1e-5)),
        Row(
            "parity",
            "bf16 logits vs fp32 (rel. error): glm46 | transformers",
            f"{bf16_ours:.2e} | {bf16_theirs:.2e}",
            verdict(bf16_ours <= 1.5 * bf16_theirs + 1e-3),
            "glm46's bf16 error at most 1.5x transformers' (+1e-3)",
        ),
    ]


# --- packed documents ------------------------------------------------------------------------------------------


def packed_lengths(rows: int, length: int, generator: torch.Generator, shortest=32, longest=1024) -> list[list[int]]:
    """Rows of documents of random lengths in [shortest, longest], each row summing to `length`."""
    out = []
    for _ in range(rows):
        row, left = [], length
        while left:
            n = min(left, int(torch.randint(shortest, longest + 1, (1,), generator=generator)))
            row.append(n)
            left -= n
        out.append(row)
    return out


def positions_of(lengths: list[list[int]], device) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]).to(device)


def attention_inputs(shape, kv_heads, dtype, device, seed=0):
    """q [B, H, T, d], k, v [B, KV, T, d] and an upstream gradient, fp32 masters cast to dtype (leaves)."""
    generator = torch.Generator().manual_seed(seed)
    B, H, T, d = shape
    masters = [torch.randn(B, h, T, d, generator=generator) for h in (H, kv_heads, kv_heads)]
    upstream = torch.randn(B, H, T, d, generator=generator)
    return [m.to(device, dtype).requires_grad_() for m in masters], upstream.to(device, dtype)


def forward_backward(fn, inputs, upstream):
    out = fn(*inputs)
    return [out.detach(), *torch.autograd.grad(out, inputs, upstream)]


def packed(args, device: torch.device) -> list[Row]:
    gpu = device.type == "cuda"
    B, H, KV, T, d = (8, 32, 4, 4096, 128) if gpu else (2, 4, 2, 512, 32)
    lengths = packed_lengths(B, T, torch.Generator().manual_seed(0), longest=1024 if gpu else 128)
    documents = Documents.from_positions(positions_of(lengths, device))
    scale = d**-0.5
    count = sum(len(row) for row in lengths)
    label = f"{B} x {T} tokens, {count} documents, {H} heads on {KV} kv, d {d}"
    if not gpu:
        return [Row("packed", "varlen kernel vs per-document loop", "-", "skip", f"CUDA only ({label})")]

    def loop(q, k, v):
        return per_document_attention(q, k, v, lengths, scale)

    exact = forward_backward(loop, *attention_inputs((B, H, T, d), KV, torch.float32, device))
    inputs, upstream = attention_inputs((B, H, T, d), KV, torch.bfloat16, device)

    def varlen(q, k, v):
        with cuda_kernels.using(varlen_attention=True):
            return packed_attention(q, k, v, documents, scale)

    results = {name: forward_backward(fn, inputs, upstream) for name, fn in (("loop", loop), ("varlen", varlen))}
    names = ("output", "dq", "dk", "dv")
    errors = {name: [relative_error(t, e) for t, e in zip(got, exact)] for name, got in results.items()}
    worst = max(e_v / max(e_l, 1e-4) for e_v, e_l in zip(errors["varlen"], errors["loop"]))
    rows = [
        Row(
            "packed",
            "bf16 vs fp32 loop (rel. error), varlen | loop: " + ", ".join(names),
            ", ".join(f"{v:.1e}|{lp:.1e}" for v, lp in zip(errors["varlen"], errors["loop"])),
            verdict(worst <= 1.5),
            f"{label}; varlen's error at most 1.5x the bf16 loop's",
        )
    ]
    timings = {}
    for name, fn in (("loop", loop), ("varlen", varlen)):
        timings[name] = seconds_per_call(lambda fn=fn: forward_backward(fn, inputs, upstream), device, repeats=5)
    rows.append(
        Row(
            "packed",
            "forward + backward ms, loop -> varlen",
            f"{timings['loop'] * 1e3:.1f} -> {timings['varlen'] * 1e3:.1f} "
            f"(x{timings['loop'] / timings['varlen']:.1f})",
            "info",
            label,
        )
    )
    return rows


# --- context parallelism ---------------------------------------------------------------------------------------


def context_on_one_device(inputs, upstream, lengths, scale, cp: int):
    """Each of cp ranks' queries (load-balanced chunks r and 2cp-1-r) against the whole row's keys, as the cp group
    runs them, on one device: the output in sequence order and the gradients summed over the ranks (in fp32, as the
    cp group's all-reduce of the key gradients sums them)."""
    from glm46.parallel.context_parallel import ContextAttention, attention_pieces

    q, k, v = inputs
    T = q.shape[2]
    chunk = T // (2 * cp)
    out = torch.empty_like(q)
    grads = [torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v)]  # key gradients: the fp32 all-reduce
    for rank in range(cp):
        ranges = [(i * chunk, (i + 1) * chunk) for i in (rank, 2 * cp - 1 - rank)]
        mine = torch.cat([torch.arange(start, end) for start, end in ranges]).to(q.device)
        local = q.detach()[:, :, mine].requires_grad_()
        part = ContextAttention.apply(local, k, v, [attention_pieces(ranges, row) for row in lengths], scale)
        dq, dk, dv = torch.autograd.grad(part, (local, k, v), upstream[:, :, mine])
        out[:, :, mine] = part.detach()
        grads[0][:, :, mine] += dq
        grads[1] += dk
        grads[2] += dv
    return [out, *(g.to(q.dtype) for g in grads)]


def context(args, device: torch.device) -> list[Row]:
    """fp32: the CUDA blocks within 1e-5 of one device's fp32 attention. bf16: their error against it at most 1.5x
    that of the CPU blocks on the same inputs (each rank's key gradients are rounded to bf16 before the cp group sums
    them, on either device, so the error grows with cp; the CUDA kernels must add nothing to it)."""
    gpu = device.type == "cuda"
    B, H, KV, T, d = (2, 16, 2, 4096, 128) if gpu else (2, 4, 2, 256, 32)
    lengths = [[T // 4 + 5, T - T // 4 - 5], [T]]  # a document crossing chunk edges, and one whole row
    scale = d**-0.5
    rows = []
    exact = forward_backward(
        lambda q, k, v: per_document_attention(q, k, v, lengths, scale),
        *attention_inputs((B, H, T, d), KV, torch.float32, device),
    )
    shape = f"{B} x {T} tokens, {H} heads on {KV} kv, d {d}"
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        inputs, upstream = attention_inputs((B, H, T, d), KV, dtype, device)
        for cp in (2, 4):
            with cuda_kernels.using(context_flash=True):
                got = context_on_one_device(inputs, upstream, lengths, scale, cp)
            ours = [relative_error(t, e) for t, e in zip(got, exact)]
            if dtype == torch.float32:
                outcome, rule = verdict(max(ours) < 1e-5), "within 1e-5 of one device's fp32 attention"
            elif not gpu:  # these are the CPU blocks: nothing to hold them against on this device
                outcome, rule = "info", "the CPU blocks, the reference of the CUDA ones"
            else:
                cpu = context_on_one_device(
                    *attention_inputs((B, H, T, d), KV, dtype, torch.device("cpu")), lengths, scale, cp
                )
                base = [relative_error(t.to(device), e) for t, e in zip(cpu, exact)]
                outcome = verdict(max(o / max(b, 1e-4) for o, b in zip(ours, base)) <= 1.5)
                rule = "at most 1.5x the CPU blocks' error: " + ", ".join(f"{e:.1e}" for e in base)
            rows.append(
                Row(
                    "context",
                    f"cp={cp} {name} blocks vs fp32 one device (rel. error): out, dq, dk, dv",
                    ", ".join(f"{e:.1e}" for e in ours),
                    outcome,
                    f"{shape}; {rule}",
                )
            )
    return rows


# --- torch.compile ---------------------------------------------------------------------------------------------


def compile_parity(args, device: torch.device) -> list[Row]:
    if device.type != "cuda":
        return [Row("compile", "compiled vs eager", "-", "skip", "inductor's CPU build takes minutes on 2 cores")]
    # fp32, where compiled and eager agree to rounding; the bf16 compiled model is the throughput part's
    torch.manual_seed(0)
    eager = GLM46ForCausalLM(GLM46Config(**PARITY_CONFIG)).to(device)
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled)
    x = torch.randint(0, PARITY_CONFIG["vocab_size"], (4, 512), device=device)
    losses, grads = [], []
    for model in (eager, compiled):
        out = model(x, labels=x.roll(-1, dims=1))
        out.loss.backward()
        losses.append(out.loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    loss_error = abs(losses[1] - losses[0]) / abs(losses[0])
    grad_error = relative_error(grads[1], grads[0])
    return [
        Row(
            "compile",
            "compiled blocks vs eager, float32 (rel. error): loss, gradients",
            f"{loss_error:.1e}, {grad_error:.1e}",
            verdict(loss_error < 1e-4 and grad_error < 1e-3),
            "loss within 0.0001, gradients within 0.001",
        )
    ]


# --- throughput, Newton-Schulz and memory --------------------------------------------------------------------


class NewtonSchulzTimer:
    """Times glm46.optim.newton_schulz.orthogonalize_stacks (every Newton-Schulz call of Muon's step) with CUDA
    events, or the host clock on CPU."""

    def __init__(self, device: torch.device):
        import glm46.optim.newton_schulz as ns

        self.module, self.original, self.device, self.pairs, self.host = ns, ns.orthogonalize_stacks, device, [], 0.0

    def __enter__(self):
        def timed(*a, **k):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                result = self.original(*a, **k)
                end.record()
                self.pairs.append((start, end))
                return result
            begin = time.perf_counter()
            result = self.original(*a, **k)
            self.host += time.perf_counter() - begin
            return result

        self.module.orthogonalize_stacks = timed
        return self

    def __exit__(self, *exc):
        self.module.orthogonalize_stacks = self.original

    def seconds(self) -> float:
        synchronize(self.device)
        return self.host + sum(s.elapsed_time(e) for s, e in self.pairs) / 1e3

    def reset(self) -> None:
        self.pairs, self.host = [], 0.0


def datasheet_bf16(device: torch.device) -> float | None:
    """Dense bf16 FLOP/s of the cards Lightning's table lacks (NVIDIA's H200 datasheet: 989 TFLOP/s, the H100 SXM's)."""
    return 989.4e12 if "h200" in torch.cuda.get_device_name(device).lower() else None


def throughput(args, device: torch.device) -> list[Row]:
    import train_throughput as bench
    from lightning.fabric.utilities.throughput import get_available_flops

    from glm46.lit.callbacks.throughput import measured_matmul_flops
    from glm46.planning.counts import training_flops_per_token

    gpu = device.type == "cuda"
    preset = "glm46_1b" if gpu else "small"
    fields, seq = bench.PRESETS[preset]
    autocast = torch.bfloat16 if gpu else None
    batch, accumulate, warmup, steps = (2, 4, 2, 4) if gpu else (2, 1, 1, 2)
    x = torch.randint(0, fields["vocab_size"], (batch, seq), device=device)
    tokens = batch * accumulate * seq
    config = GLM46Config(**fields, num_nextn_predict_layers=0)
    flops = training_flops_per_token(config, seq)
    dtype = autocast or torch.float32
    peaks = {"measured": measured_matmul_flops(device, dtype, size=8192 if gpu else 1024)}
    datasheet = (get_available_flops(device, dtype) or datasheet_bf16(device)) if gpu else None
    if datasheet:
        peaks["datasheet"] = datasheet
    factories = {
        "glm46 AdamW": lambda: bench.ours(fields, device, autocast, "adamw"),
        "glm46 Muon": lambda: bench.ours(fields, device, autocast, "muon"),
        # bf16 weights with fp32 masters through FSDP2's policy on the one rank (run.py: parallelism=fsdp2), no autocast
        **({"glm46 AdamW FSDP2-bf16": lambda: bench.ours_fsdp2(fields, device)} if gpu else {}),
        # the decoder layers' dense linears in float8 (torchao), against the AdamW row: an option only where it pays
        **({"glm46 AdamW float8": lambda: bench.ours_float8(fields, device, autocast)} if gpu else {}),
        "torchtitan AdamW": lambda: bench.torchtitan_peer(fields, seq, device, autocast, "sdpa"),
        # transformers stands in only where torchtitan does not import
        "transformers AdamW": lambda: bench.transformers_peer(fields, device, autocast),
    }
    rates, rows, ns_share = {}, [], None
    shape = (
        f"{preset}, {'bf16 autocast' if gpu else 'fp32'}, compiled={gpu}, {accumulate} x {batch} x {seq} tokens/step"
    )
    for name, make in factories.items():
        runner = None
        if name == "transformers AdamW" and "torchtitan AdamW" in rates:
            continue
        try:
            runner = make()
            if gpu:
                bench.compile_blocks(runner.model)
            with NewtonSchulzTimer(device) as timer:
                bench.timed([runner], x, warmup, 0, accumulate)  # compiles
                timer.reset()
                bench.timed([runner], x, 0, steps, accumulate)
                ns_seconds = timer.seconds()
            rate = runner.rates(tokens)[0]
            rates[name] = rate
            mfu = "  ".join(f"{rate * flops / peak:.1%} of {which}" for which, peak in peaks.items())
            peak_memory = f"; peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if gpu else ""
            rows.append(
                Row("throughput", f"{name} tokens/s", f"{rate:,.0f}", "info", f"MFU {mfu}; {shape}{peak_memory}")
            )
            if name == "glm46 Muon":
                ns_share = ns_seconds / sum(runner.step_times)
        except ImportError as error:  # a peer that does not import here: the next peer stands in
            rows.append(Row("throughput", f"{name} tokens/s", "-", "skip", f"{type(error).__name__}: {error}"[:300]))
        except Exception as error:  # a runner that fails is reported, the others still run
            rows.append(Row("throughput", f"{name} tokens/s", "-", "FAIL", f"{type(error).__name__}: {error}"[:300]))
        finally:
            if runner is not None:
                runner.release()
            if gpu:
                torch.cuda.reset_peak_memory_stats(device)
    if ns_share is not None:
        rows.append(Row("throughput", "Muon: Newton-Schulz share of the step", f"{ns_share:.1%}", "info", shape))
    peer = next((name for name in ("torchtitan AdamW", "transformers AdamW") if name in rates), None)
    for name in ("glm46 AdamW", "glm46 Muon", "glm46 AdamW FSDP2-bf16"):
        if peer and name in rates:
            rows.append(Row("throughput", f"{name} / {peer}", f"x{rates[name] / rates[peer]:.2f}", "info", shape))
    if {"glm46 AdamW float8", "glm46 AdamW"} <= rates.keys():
        speedup = rates["glm46 AdamW float8"] / rates["glm46 AdamW"]
        rows.append(Row("throughput", "glm46 AdamW float8 / bf16", f"x{speedup:.2f}", "info", shape))
    rows.append(
        Row(
            "throughput",
            "matmul peak used for MFU",
            ", ".join(f"{k} {v / 1e12:.2f} TFLOP/s" for k, v in peaks.items()),
            "info",
        )
    )
    return rows


# --- host syncs ------------------------------------------------------------------------------------------------


def syncs(args, device: torch.device) -> list[Row]:
    """A bf16 training step (forward, backward, AdamW) under torch.cuda.set_sync_debug_mode("error"): any op that
    waits for the device on the host raises. The CPU's counterpart is tests/test_host_reads.py."""
    if device.type != "cuda":
        return [Row("syncs", "training step without host syncs", "-", "skip", "CUDA's sync debug mode")]
    torch.manual_seed(0)
    model = GLM46ForCausalLM(GLM46Config(**{**PARITY_CONFIG, "num_nextn_predict_layers": 1})).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, PARITY_CONFIG["vocab_size"], (4, 512), device=device)
    labels = x.roll(-1, dims=1)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, labels=labels)
        (out.loss + 0.3 * out.mtp_loss + 1e-4 * out.balance_loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the first step's one-time work (allocations, lazy initialisation) is not the step's
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        value, outcome, detail = "none", "pass", ""
    except RuntimeError:
        value, outcome, detail = "synced", "FAIL", traceback.format_exc(limit=-3)[-600:]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check = "bf16 step (forward with MTP, backward, fused AdamW) under sync debug mode 'error': host syncs"
    return [Row("syncs", check, value, outcome, detail or "4 x 512 tokens, the parity model")]


def memory(args, device: torch.device) -> list[Row]:
    import train_throughput as bench

    from glm46.optim.newton_schulz import BATCH_BYTES
    from glm46.parallel.checkpointing import apply_activation_checkpointing
    from glm46.parallel.layout import Layout
    from glm46.planning.plan import GIB, stage_memory

    if device.type != "cuda":
        return [Row("memory", "step peak vs task=plan", "-", "skip", "the CUDA allocator's peak is the measure")]
    fields, seq = bench.PRESETS["glm46_1b"]
    batch = 2
    config = GLM46Config(**fields, num_nextn_predict_layers=0)
    x = torch.randint(0, fields["vocab_size"], (batch, seq), device=device)
    rows = []
    # each optimizer without activation checkpointing, and AdamW with each layer recomputed from its input (full) or
    # with its matmuls' and attention's outputs kept (selective)
    for optimizer, recompute in (("adamw", None), ("muon", None), ("adamw", "full"), ("adamw", "selective")):
        runner = bench.ours(fields, device, torch.bfloat16, optimizer)
        if recompute:
            apply_activation_checkpointing(runner.model, recompute)
        torch.cuda.reset_peak_memory_stats(device)
        bench.timed([runner], x, 0, 2, 1)  # eager: the activations the plan counts
        peak, seconds = torch.cuda.max_memory_allocated(device), min(runner.step_times)
        runner.release()
        plan = stage_memory(
            config,
            Layout(1),
            batch * seq,
            optimizer,
            recompute,
            None,
            ns_batch_bytes=BATCH_BYTES,
            ns_dtype=torch.bfloat16,
        )
        ratio, checkpointed = peak / plan["total"], f", {recompute} checkpointing" if recompute else ""
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in plan.items() if k != "total" and v)
        rows.append(
            Row(
                "memory",
                f"glm46_1b {optimizer}{checkpointed}, {batch} x {seq} tokens, eager: peak / plan",
                f"{peak / GIB:.1f} / {plan['total'] / GIB:.1f} GiB (x{ratio:.2f}), step {seconds:.2f} s",
                verdict(0.7 <= ratio <= 1.1),
                f"plan (GiB): {parts}; pass: the peak within -30%/+10% of the plan",
            )
        )
    return rows


# --- the user's path -------------------------------------------------------------------------------------------

STEP_LINE = re.compile(r"step (\d+)/(\d+) .*perf/tokens_per_sec (\d+)")


def user_path(args, device: torch.device) -> list[Row]:
    """`python run.py` training the throughput rows' model and batch (Muon, bf16, compiled layers, no MTP) on the
    standard library's bytes, through Lightning and every callback of a run: its tokens/s per optimizer step against
    the suite's `glm46 Muon` row (read from this run's JSON), the target within 5%. The run is stopped once its last
    step is logged (no checkpoint, no export). On the CPU: the tiny model, a few steps, for the plumbing."""
    gpu = device.type == "cuda"
    steps = 8 if gpu else 4
    settings = [
        "experiment=tiny_bytes",
        *(["model=glm46_1b", "cluster.accelerator=gpu", "trainer.precision=bf16-mixed"] if gpu else []),
        *(
            [f"cluster.gpu.memory_gib={torch.cuda.get_device_properties(device).total_memory / 2**30:.0f}"]
            if gpu
            else []
        ),
        "model.num_nextn_predict_layers=0",
        f"module.compile={str(gpu).lower()}",
        f"data.seq_len={4096 if gpu else 256}",
        "data.batch_size=2",
        f"trainer.accumulate_grad_batches={4 if gpu else 1}",
        f"trainer.max_steps={steps}",
        "trainer.limit_val_batches=0",
        "callbacks.model_checkpoint=null",
        "callbacks.preemption=null",
        "callbacks.throughput.window_size=1",
        "callbacks.progress_bar.refresh_rate=1",
    ]
    command = f"python run.py {' '.join(settings)}"
    rates, tail = {}, []
    with tempfile.TemporaryDirectory() as run_dir:
        process = subprocess.Popen(
            [sys.executable, "run.py", *settings, f"hydra.run.dir={run_dir}"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            for line in process.stdout:
                tail = [*tail[-20:], line.rstrip()]
                match = STEP_LINE.search(line)
                if match:
                    rates[int(match[1])] = float(match[3])
                    if int(match[1]) == steps:
                        break
        finally:
            process.kill()
            process.wait()
    if len(rates) < steps:
        return [Row("user_path", command, "-", "FAIL", " | ".join(tail)[-600:])]
    after_compile = [rates[step] for step in range(3, steps + 1)]  # the first two steps compile
    rate = sorted(after_compile)[len(after_compile) // 2]
    rows = [Row("user_path", f"{command}: tokens/s (median of steps 3-{steps})", f"{rate:,.0f}", "info")]
    suite = [r for r in json.loads(args.json.read_text())["rows"] if r["check"] == "glm46 Muon tokens/s"]
    if gpu and suite and suite[0]["value"] != "-":
        ratio = rate / float(suite[0]["value"].replace(",", ""))
        rows.append(
            Row(
                "user_path",
                "run.py / the suite's glm46 Muon step",
                f"x{ratio:.3f}",
                verdict(ratio >= 0.95),
                "within 5%",
            )
        )
    return rows


PARTS = {
    "environment": environment,
    "parity": parity,
    "packed": packed,
    "context": context,
    "compile": compile_parity,
    "syncs": syncs,
    "memory": memory,
    "throughput": throughput,
    "user_path": user_path,
}


def table(rows: list[Row]) -> str:
    widths = [max(len(getattr(r, f)) for r in rows) for f in ("part", "check", "value", "verdict")]
    widths = [min(w, 70) for w in widths]
    lines = []
    for r in rows:
        cells = [getattr(r, f).ljust(w) for f, w in zip(("part", "check", "value", "verdict"), widths)]
        lines.append(" | ".join(cells) + (f" | {r.detail}" if r.detail else ""))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU: every part that can, small")
    parser.add_argument("--only", nargs="+", choices=sorted(PARTS), help="these parts only")
    parser.add_argument("--json", type=Path, default=Path("outputs/gpu_suite.json"), help="write the rows here")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds; parts not started by then are skipped")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or pass --cpu")
    device = torch.device("cpu" if args.cpu else "cuda")
    out = args.json
    out.parent.mkdir(parents=True, exist_ok=True)
    start, rows = time.perf_counter(), []
    for name, part in PARTS.items():
        if args.only and name not in args.only:
            continue
        elapsed = time.perf_counter() - start
        if elapsed > args.budget:
            rows.append(Row(name, "(part)", "-", "skip", f"budget of {args.budget:.0f} s spent"))
            continue
        print(f"[{elapsed:6.1f} s] {name} ...", flush=True)
        try:
            new = part(args, device)
        except Exception as error:
            traceback.print_exc()
            new = [Row(name, "(part)", "-", "FAIL", f"{type(error).__name__}: {error}"[:300])]
        for row in new:
            print(f"    {row.check}: {row.value} [{row.verdict}] {row.detail}", flush=True)
        rows += new
        summary = {"date": time.strftime("%Y-%m-%d"), "seconds": round(time.perf_counter() - start, 1)}
        out.write_text(json.dumps({**summary, "rows": [asdict(r) for r in rows]}, indent=1))
    print(f"\n== GPU suite, {time.perf_counter() - start:.0f} s ==\n{table(rows)}\nJSON: {out}")
    return 1 if any(r.verdict == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
