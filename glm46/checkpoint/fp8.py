"""Block-wise FP8 weights as the Hub's FP8 checkpoints store them (GLM-4.6-FP8, DeepSeek-V3).

Such a checkpoint says so in config.json: `quantization_config: {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}`. Each quantized weight W [out, in] is stored as
`<name>` in float8_e4m3fn beside `<name>_scale_inv` [ceil(out / 128), ceil(in / 128)] in float32, and
W = fp8 x scale_inv block by block (the name notwithstanding, the stored scale multiplies: DeepSeek-V3's
`inference/kernel.py` `weight_dequant`, transformers' FineGrainedFP8 integration). Embeddings, lm_head, norms, the
router and biases stay in bf16. Reading dequantizes slice by slice, so a rank reads only the blocks of its shard.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from glm46.logs import Progress
from glm46.modules.block_fp8 import SCALE_SUFFIX, quantize, scale_shape
from glm46.modules.block_fp8 import dequantize as dequantize_blocks

from .hub_config import CheckpointError
from .hub_files import INDEX_FILE, shard_files
from .safetensors_writer import StreamingSafetensors

log = logging.getLogger(__name__)

# Kept in bf16 (besides every 1-D tensor: norms, biases, the router's correction bias): the embedding, the lm_head
# and its MTP copy, and the router, whose small logits decide the routing (vLLM builds GLM's gate unquantized).
UNQUANTIZED = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight", ".mlp.gate.weight")


def block_size(hf_config: dict, where: str = "config.json") -> int | None:
    """The square block of a block-wise FP8 checkpoint, None when it is not quantized; anything else is refused."""
    quantization = hf_config.get("quantization_config")
    if quantization is None:
        return None
    method, block = quantization.get("quant_method"), quantization.get("weight_block_size")
    fmt = quantization.get("fmt", "e4m3")
    if method == "fp8" and fmt == "e4m3" and block and len(block) == 2 and block[0] == block[1]:
        return int(block[0])
    raise CheckpointError(
        f"{where}: quantization_config {quantization} is not read here: glm46 reads unquantized checkpoints and "
        f"block-wise FP8 ones (quant_method 'fp8', fmt 'e4m3', a square weight_block_size, weights with "
        f"'{SCALE_SUFFIX}' scales: GLM-4.6-FP8, DeepSeek-V3); dequantize it first (or use the unquantized release)"
    )


def folder_block_size(folder: Path | None) -> int | None:
    """The block of the block-FP8 checkpoint in the HF folder `folder`, None for an unquantized one or none."""
    config = None if folder is None else folder / "config.json"
    return block_size(json.loads(config.read_text()), str(config)) if config and config.is_file() else None


def dequantize(values: torch.Tensor, scales: torch.Tensor, rows: slice, cols: slice, block: int) -> torch.Tensor:
    """The float32 weights of the part [rows, cols] of a quantized matrix: values are its FP8 entries there, scales
    the rows of `<name>_scale_inv` from block rows.start // block and its columns from block cols.start // block."""
    top, left = rows.start // block * block, cols.start // block * block
    box = (slice(rows.start - top, rows.stop - top), slice(cols.start - left, cols.stop - left))
    return dequantize_blocks(values, scales, block, box=box)


def scale_region(rows: slice, cols: slice, block: int) -> tuple[slice, slice]:
    """The blocks of `<name>_scale_inv` that cover the part [rows, cols] of the matrix."""
    return (
        slice(rows.start // block, math.ceil(rows.stop / block)),
        slice(cols.start // block, math.ceil(cols.stop / block)),
    )


def quantized(key: str, shape: tuple[int, ...]) -> bool:
    """Whether the FP8 export stores this Hub tensor in FP8."""
    return len(shape) == 2 and key.endswith(".weight") and not key.endswith(UNQUANTIZED)


def unquantized_dtype(key: str) -> torch.dtype:
    """A Hub tensor's dtype in a bf16 export and in the FP8 export's unquantized part: the router's correction bias
    stays fp32, as the Hub's checkpoints keep it."""
    return torch.float32 if key.endswith("e_score_correction_bias") else torch.bfloat16


def export_fp8(source: Path, output: Path, block: int = 128) -> Path:
    """Write the HF directory `source` as a block-wise FP8 checkpoint in `output`, one tensor at a time: each
    quantized matrix as e4m3 values and `<name>_scale_inv`, the rest in bf16 (the router's correction bias in fp32, as
    the Hub's checkpoints keep it); the files keep the source's split, the configs and tokenizer are copied."""
    config = json.loads((source / "config.json").read_text())
    if config.get("quantization_config"):
        raise CheckpointError(f"{source}: already quantized ({config['quantization_config']}); export its source")
    output.mkdir(parents=True, exist_ok=True)
    weight_map, total, files = {}, 0, shard_files(source)
    progress = Progress(log, f"FP8 export of {source}", len(files), "files")
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            entries = []
            for key in handle.keys():
                shape = tuple(handle.get_slice(key).get_shape())
                if quantized(key, shape):
                    scales = scale_shape(shape, block)
                    entries += [(key, shape, torch.float8_e4m3fn), (key + SCALE_SUFFIX, scales, torch.float32)]
                else:
                    entries.append((key, shape, unquantized_dtype(key)))
            writer = StreamingSafetensors(output / file.name, entries)
            for key, _, dtype in entries:
                if key.endswith(SCALE_SUFFIX):
                    continue
                tensor = handle.get_tensor(key)
                if dtype == torch.float8_e4m3fn:
                    values, scales = quantize(tensor, block)
                    writer.write(key, values)
                    writer.write(key + SCALE_SUFFIX, scales)
                else:
                    writer.write(key, tensor.to(dtype))
            writer.close()
        weight_map |= dict.fromkeys((key for key, _, _ in entries), file.name)
        total += sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in entries)
        progress.advance()
    if (source / INDEX_FILE).exists():
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (output / INDEX_FILE).write_text(json.dumps(index, indent=2))
    config |= {
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [block, block],
        },
    }
    (output / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (source / extra).exists():
            shutil.copy(source / extra, output / extra)
    log.info("%s: FP8 export of %s (%d tensors, %.2f GiB)", output, source, len(weight_map), total / 2**30)
    return output
