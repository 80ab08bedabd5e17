"""GGUF files for llama.cpp (architecture `glm4moe`), written from an HF export with the `gguf` package's writer.

llama.cpp's own converter (`convert_hf_to_gguf.py`, class Glm4MoeModel) defines the layout this follows: tensor names
from `gguf.get_tensor_name_map(MODEL_ARCH.GLM4_MOE, ...)`, each layer's routed experts stacked into one
[n_expert, out, in] tensor per projection (`blk.N.ffn_{gate,up,down}_exps`), the router's correction bias as
`blk.N.exp_probs_b.bias`, the MTP layer as block `num_hidden_layers` with its `nextn.*` tensors (llama.cpp loads it and
skips it unless asked for MTP), norms, biases and the router in F32; the byte-level BPE vocabulary with its merges
(`tokenizer.ggml.model` gpt2, pre-tokenizer `glm4`: the GLM-4 regex this project's tokenizer splits with), GLM's
special tokens and the chat template. f16 and q8_0 are written here (q8_0: the `gguf` package's quantizer, blocks of
32 weights with one f16 scale; a matrix whose rows are not a multiple of 32 falls back to F16 as in llama.cpp's
converter); q4_k_m is llama.cpp's own mixed 4/6-bit recipe, which only llama.cpp's quantizer implements, so it is
made from the f16 file by `llama_model_quantize` in the llama.cpp venv (glm46.serve.llama_cpp).

The source is read one Hub tensor at a time (a layer's experts: one projection's stack at a time), so the export
needs memory for the largest stack, not the model: 355B's is 160 x 1536 x 5120 (1.3 GB in q8_0, 4.7 GB in float32
while it is quantized one expert at a time).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from glm46.logs import Progress

from .hub_config import CheckpointError
from .hub_files import shard_files

log = logging.getLogger(__name__)

ARCH = gguf.MODEL_ARCH.GLM4_MOE
GGUF_TYPES = ("f16", "q8_0", "q4_k_m")
FILE_TYPES = {
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M,
}
WEIGHT_TYPES = {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0}
# Kept in F32 whatever the type, as llama.cpp's converter and quantizer keep them: the router and every 1-D tensor.
F32_TENSORS = (gguf.MODEL_TENSOR.FFN_GATE_INP,)
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
# GLM's special tokens as llama.cpp's converter sets them (_set_vocab_glm): [gMASK] starts a prompt, <|user|> ends an
# assistant's turn (eot), <|observation|> a tool call (eom).
SPECIAL_TOKENS = {"bos": "[gMASK]", "eos": "<|endoftext|>", "eot": "<|user|>", "eom": "<|observation|>"}
SPECIAL_TOKENS |= {"unk": "<|endoftext|>", "pad": "<|endoftext|>"}


@dataclass
class GGUFTensor:
    """One tensor of the GGUF file: its name, the Hub tensors it is made of (one, or a layer's experts in order),
    its shape in numpy order ([n_expert, out, in] for a stack) and its ggml type."""

    name: str
    sources: list[str]
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        return math.prod(gguf.quant_shape_to_byte_shape(self.shape, self.qtype))


def gguf_file_name(gguf_type: str) -> str:
    return f"model-{gguf_type}.gguf"


def tensor_name(key: str, names: gguf.TensorNameMap) -> tuple[gguf.MODEL_TENSOR, str]:
    """A Hub key's GGUF tensor (kind, name); a key llama.cpp has no name for is an error naming it."""
    key = key.replace("e_score_correction_bias", "e_score_correction.bias")  # -> blk.N.exp_probs_b.bias
    if key == "model.embed_tokens.weight":
        return gguf.MODEL_TENSOR.TOKEN_EMBD, "token_embd.weight"
    found = names.get_type_and_name(key, try_suffixes=(".weight", ".bias"))
    if found is None:
        raise CheckpointError(f"{key}: no GGUF name for it in llama.cpp's glm4moe tensor map")
    return found


def tensor_type(kind: gguf.MODEL_TENSOR, shape: tuple[int, ...], weights: gguf.GGMLQuantizationType):
    """F32 for norms, biases and the router; `weights` for the matrices, F16 where rows do not fill q8_0's blocks."""
    if len(shape) == 1 or kind in F32_TENSORS:
        return gguf.GGMLQuantizationType.F32
    block, _ = gguf.GGML_QUANT_SIZES[weights]
    return weights if shape[-1] % block == 0 else gguf.GGMLQuantizationType.F16


def block_order(key: str) -> tuple:
    """The embedding, then the blocks in order (safetensors lists `layers.10` before `layers.2`), then the head:
    llama.cpp's Q4_K_M gives more bits to the attn_v tensors by their position in the file."""
    layer = re.match(r"model\.layers\.(\d+)\.", key)
    return (1, int(layer.group(1)), key) if layer else (0 if "embed_tokens" in key else 2, 0, key)


def plan_tensors(shapes: dict[str, tuple[int, ...]], hf_config: dict, weights: gguf.GGMLQuantizationType):
    """The GGUF tensors of a Hub checkpoint whose tensors have `shapes`, block by block (a layer's expert stacks
    where its first expert is)."""
    blocks = hf_config["num_hidden_layers"] + hf_config.get("num_nextn_predict_layers", 0)
    names = gguf.get_tensor_name_map(ARCH, blocks)
    n_experts = hf_config["n_routed_experts"]
    tensors, stacked = [], set()
    for key in sorted(shapes, key=block_order):
        shape = shapes[key]
        if expert := EXPERT.fullmatch(key):
            layer, _, projection = expert.groups()
            stack = f"model.layers.{layer}.mlp.experts.{projection}.weight"
            if stack in stacked:
                continue
            stacked.add(stack)
            sources = [f"model.layers.{layer}.mlp.experts.{e}.{projection}.weight" for e in range(n_experts)]
            missing = [source for source in sources if source not in shapes]
            if missing:
                raise CheckpointError(f"layer {layer}'s {projection} lacks {len(missing)} experts, e.g. {missing[0]}")
            key, shape = stack, (n_experts, *shape)
        else:
            sources = [key]
        kind, name = tensor_name(key, names)
        tensors.append(GGUFTensor(name, sources, tuple(shape), tensor_type(kind, tuple(shape), weights)))
    return tensors


# llama.cpp's fallback for a row that is not whole 256-weight K blocks (tensor_type_fallback), then F16.
K_FALLBACK = {
    gguf.GGMLQuantizationType.Q4_K: gguf.GGMLQuantizationType.Q5_0,
    gguf.GGMLQuantizationType.Q5_K: gguf.GGMLQuantizationType.Q5_1,
    gguf.GGMLQuantizationType.Q6_K: gguf.GGMLQuantizationType.Q8_0,
}


def q4_k_m_types(tensors: list[GGUFTensor], blocks: int, n_experts: int) -> list[gguf.GGMLQuantizationType]:
    """The types llama.cpp's quantizer gives each tensor of an f16 file for Q4_K_M (src/llama-quant.cpp,
    llama_tensor_get_type): Q6_K for the output and, in the layers `use_more_bits` picks (the first and last eighth,
    every third between), for attn_v and every ffn_down; with exactly 8 experts Q8_0 for attn_k and attn_v and Q5_K
    for attn_output; Q4_K for the other matrices; F32 kept; a row that is not whole blocks falls back (K_FALLBACK).
    Used to size the 355B's q4_k_m file without writing it; tested equal to the quantizer's choices."""

    def use_more_bits(i: int, n: int) -> bool:
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    attn_v = [t.name for t in tensors if t.name.endswith(".attn_v.weight")]
    types = []
    for tensor in tensors:
        name, qtype = tensor.name, gguf.GGMLQuantizationType.Q4_K
        if tensor.qtype == gguf.GGMLQuantizationType.F32:
            types.append(tensor.qtype)
            continue
        if n_experts == 8 and name.endswith((".attn_k.weight", ".attn_v.weight")):
            qtype = gguf.GGMLQuantizationType.Q8_0
        elif n_experts == 8 and name.endswith(".attn_output.weight"):
            qtype = gguf.GGMLQuantizationType.Q5_K
        elif (
            name == "output.weight"
            or name in attn_v
            and use_more_bits(attn_v.index(name), len(attn_v))
            or re.search(r"\.ffn_down(_exps|_shexp)?\.weight$", name)
            and use_more_bits(int(name.split(".")[1]), blocks)
        ):
            qtype = gguf.GGMLQuantizationType.Q6_K
        if tensor.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = K_FALLBACK.get(qtype, qtype)
        if tensor.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = gguf.GGMLQuantizationType.F16
        types.append(qtype)
    return types


def hub_shapes(source: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, Path]]:
    """Every Hub tensor's shape and file, from the safetensors headers (no tensor is read)."""
    shapes, files = {}, {}
    for file in shard_files(source):
        with safe_open(file, framework="pt", device="cpu") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
                files[key] = file
    return shapes, files


def add_hyperparameters(writer: gguf.GGUFWriter, hf_config: dict, gguf_type: str, name: str) -> None:
    """The model's glm4moe keys, as llama.cpp's converter writes them for GLM-4.5/4.6."""
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    nextn = hf_config.get("num_nextn_predict_layers", 0)
    writer.add_name(name)
    writer.add_file_type(FILE_TYPES[gguf_type])
    if gguf_type != "f16":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(hf_config["num_hidden_layers"] + nextn)
    writer.add_context_length(hf_config["max_position_embeddings"])
    writer.add_embedding_length(hf_config["hidden_size"])
    writer.add_feed_forward_length(hf_config["intermediate_size"])
    writer.add_head_count(hf_config["num_attention_heads"])
    writer.add_head_count_kv(hf_config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(hf_config["rope_theta"])
    writer.add_rope_dimension_count(int(head_dim * hf_config.get("partial_rotary_factor", 0.5)))
    writer.add_layer_norm_rms_eps(hf_config["rms_norm_eps"])
    writer.add_vocab_size(hf_config["vocab_size"])
    writer.add_expert_count(hf_config["n_routed_experts"])
    writer.add_expert_used_count(hf_config["num_experts_per_tok"])
    writer.add_expert_group_count(hf_config.get("n_group", 1))
    writer.add_expert_group_used_count(hf_config.get("topk_group", 1))
    writer.add_expert_feed_forward_length(hf_config["moe_intermediate_size"])
    writer.add_expert_shared_count(hf_config["n_shared_experts"])
    writer.add_leading_dense_block_count(hf_config["first_k_dense_replace"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(hf_config["routed_scaling_factor"])
    writer.add_expert_weights_norm(hf_config["norm_topk_prob"])
    if nextn:
        writer.add_nextn_predict_layers(nextn)


def add_tokenizer(writer: gguf.GGUFWriter, source: Path, vocab_size: int) -> None:
    """The byte-level BPE (tokens, types, merges), GLM's special tokens and the chat template."""
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    special = {token.content for token in tokenizer.get_added_tokens_decoder().values() if token.special}
    by_id = {i: token for token, i in vocab.items()}
    if len(vocab) > vocab_size:
        raise CheckpointError(f"{source}/tokenizer.json: {len(vocab)} tokens > the model's vocab_size {vocab_size}")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    kinds = [
        gguf.TokenType.UNUSED if i not in by_id else
        gguf.TokenType.CONTROL if by_id[i] in special else gguf.TokenType.NORMAL
        for i in range(vocab_size)
    ]  # fmt: skip
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("glm4")
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    merges = json.loads((source / "tokenizer.json").read_text())["model"]["merges"]
    writer.add_token_merges([merge if isinstance(merge, str) else " ".join(merge) for merge in merges])
    for role, token in SPECIAL_TOKENS.items():
        if token in vocab:
            getattr(writer, f"add_{role}_token_id")(vocab[token])
    writer.add_add_bos_token(False)  # the chat template starts with [gMASK]<sop> itself
    config = source / "tokenizer_config.json"
    if config.exists() and (template := json.loads(config.read_text()).get("chat_template")):
        writer.add_chat_template(template)


def tensor_data(tensor: GGUFTensor, handles: dict[Path, object], files: dict[str, Path]) -> Iterator[np.ndarray]:
    """The tensor's bytes in its ggml type, one Hub tensor (one expert) at a time."""
    for key in tensor.sources:
        values = handles[files[key]].get_tensor(key).to(torch.float32).numpy()
        if tensor.qtype == gguf.GGMLQuantizationType.F32:
            yield values
        elif tensor.qtype == gguf.GGMLQuantizationType.F16:
            yield values.astype(np.float16)
        else:
            yield gguf.quants.quantize(values, tensor.qtype)


def write_gguf(source: Path, path: Path, gguf_type: str) -> Path:
    """Write the HF directory `source` as one GGUF file of type f16 or q8_0 at `path`, one Hub tensor at a time."""
    hf_config = json.loads((source / "config.json").read_text())
    if hf_config.get("quantization_config"):
        raise CheckpointError(f"{source}: already quantized ({hf_config['quantization_config']}); export its source")
    if not (source / "tokenizer.json").exists():
        raise CheckpointError(f"{source}: no tokenizer.json, and a GGUF file carries its tokenizer")
    shapes, files = hub_shapes(source)
    tensors = plan_tensors(shapes, hf_config, WEIGHT_TYPES[gguf_type])
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[ARCH])
    add_hyperparameters(writer, hf_config, gguf_type, name=source.parent.name if source.name == "hf" else source.name)
    add_tokenizer(writer, source, hf_config["vocab_size"])
    for tensor in tensors:
        dtype = np.float32 if tensor.qtype == gguf.GGMLQuantizationType.F32 else np.float16
        writer.add_tensor_info(tensor.name, tensor.shape, np.dtype(dtype), tensor.nbytes, raw_dtype=tensor.qtype)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    with ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(file, "pt", device="cpu")) for file in set(files.values())}
        progress = Progress(log, f"GGUF {gguf_type} export of {source}", len(tensors), "tensors")
        for tensor in tensors:
            parts = list(tensor_data(tensor, handles, files))
            writer.write_tensor_data(np.concatenate(parts) if len(parts) > 1 else parts[0])
            progress.advance()
    writer.close()
    log.info(
        "%s: GGUF %s of %s (%d tensors, %.2f MiB)", path, gguf_type, source, len(tensors), path.stat().st_size / 2**20
    )
    return path


def export_gguf(source: Path, output: Path, gguf_type: str) -> Path:
    """`source` as `output/model-<gguf_type>.gguf`; q4_k_m through llama.cpp's quantizer from an f16 file written
    first (removed after). Each file is written under a `.partial` name and renamed when whole."""
    from glm46.serve.llama_cpp import BUILD_SCRIPT, llama_cpp_python, llama_cpp_quantize

    output.mkdir(parents=True, exist_ok=True)
    path = output / gguf_file_name(gguf_type)
    partial = path.with_name(path.name + ".partial")
    if gguf_type in WEIGHT_TYPES:
        write_gguf(source, partial, gguf_type)
    else:
        python = llama_cpp_python()
        if python is None:
            raise CheckpointError(f"export.gguf_type={gguf_type} needs llama.cpp's quantizer: run {BUILD_SCRIPT}")
        f16 = write_gguf(source, output / (gguf_file_name("f16") + ".partial"), "f16")
        llama_cpp_quantize(python, f16, partial, gguf_type)
        f16.unlink()
    partial.rename(path)
    return path
