"""Adapters in the peft library's format: adapter_config.json and adapter_model.safetensors with peft's key names,
for transformers' Glm4MoeForCausalLM (`PeftModel.from_pretrained(model, DIR)` loads them).

The names, as peft 0.21 writes them for that model (transformers v5 modules):
- attention projections are peft `target_modules` (lora.Linear; DoRA and dropout supported):
  `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`, `.lora_B.weight`, `.lora_magnitude_vector`;
- the dense MLP and the shared experts are `target_parameters` on their 2-D weights (`mlp.gate_proj.weight`,
  `shared_experts.gate_proj.weight`, ...): naming `gate_proj` in target_modules would make peft, converting names
  from transformers v4, target the routed experts instead;
- the routed experts are `target_parameters` on the fused tensors (`experts.gate_up_proj`, `experts.down_proj`),
  one wrapper inside the other: gate_up's keys read `mlp.experts.base_layer.lora_A.weight`, down's
  `mlp.experts.lora_A.weight`. Per expert e, peft's lora_A.weight [E r, in] holds A_e in rows e r .. e r + r - 1,
  and lora_B.weight [out, r E] holds B_e in columns k E + e (peft's ParamWrapper.get_delta_weight). A shared pair
  is written as every expert's.
- an embedding or lm_head trained whole is peft's `modules_to_save`: `base_model.model.lm_head.weight`;
- trainable token rows (glm46.peft.token_rows) are peft's `trainable_token_indices` on `embed_tokens` and `lm_head`:
  `base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta` [n, hidden], the rows' values.
peft's parameter targets support neither DoRA nor dropout: such adapters are not written in this format; the merged
export (<run dir>/hf/) always is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from .adapters import Adapter, fill_from_whole, gathered
from .inject import adapted_weights
from .settings import AdapterSettings
from .token_rows import TokenRows

PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_MLP_WEIGHTS = ("gate_proj", "up_proj", "down_proj")
_TOKEN_LAYERS = {"model.embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}


def unsupported(settings: AdapterSettings) -> str | None:
    """Why peft's format cannot hold these adapters, or None."""
    targets = settings.target_names()
    parameter_targets = targets & {"dense_mlp", "shared_experts", "experts"}
    if parameter_targets and settings.dora:
        return f"peft supports DoRA on modules only, not on the parameters of {sorted(parameter_targets)}"
    if parameter_targets and settings.dropout > 0:
        return f"peft supports no dropout on the parameters of {sorted(parameter_targets)}"
    return None


def _trained_whole(settings: AdapterSettings) -> list[str]:
    """The weights trained whole (peft's `modules_to_save`, saved under their own names)."""
    return [weight for weight, layer in _TOKEN_LAYERS.items() if layer in settings.target_names()]


def _kind(name: str) -> str:
    """Our adapted weight's name -> attention | mlp | experts | tokens."""
    if name in _TOKEN_LAYERS:
        return "tokens"
    if ".self_attn." in name:
        return "attention"
    return "experts" if ".experts." in name else "mlp"


def _keys(name: str) -> dict[str, str]:
    """Our adapted weight's name -> peft's key of each adapter tensor (lora_A, lora_B, lora_magnitude_vector)."""
    kind = _kind(name)
    if kind == "tokens":
        layer = PREFIX + name.removesuffix(".weight")
        return {"trainable_tokens_delta": f"{layer}.token_adapter.trainable_tokens_delta"}
    if kind == "experts":
        module, weight = name.rsplit(".", 1)
        base = PREFIX + module + (".base_layer" if weight == "gate_up_proj" else "")
    else:
        base = PREFIX + name.removesuffix(".weight")
    return {
        "lora_A": f"{base}.lora_A.weight",
        "lora_B": f"{base}.lora_B.weight",
        "lora_magnitude_vector": f"{base}.lora_magnitude_vector",
    }


def _to_peft(adapter: Adapter, kind: str, num_experts: int) -> dict[str, torch.Tensor]:
    tensors = {name: gathered(p).detach().float().cpu() for name, p in adapter.named_parameters(recurse=False)}
    if kind != "experts":
        return tensors
    lora_A, lora_B = tensors["lora_A"], tensors["lora_B"]
    if lora_A.ndim == 2:  # one pair for the layer: every expert's
        lora_A, lora_B = lora_A.expand(num_experts, *lora_A.shape), lora_B.expand(num_experts, *lora_B.shape)
    experts, rank, in_features = lora_A.shape
    return {
        "lora_A": lora_A.reshape(experts * rank, in_features).contiguous(),
        "lora_B": lora_B.permute(1, 2, 0).reshape(lora_B.shape[1], rank * experts).contiguous(),
    }


def _from_peft(tensors: dict[str, torch.Tensor], adapter: Adapter, kind: str, name: str) -> dict[str, torch.Tensor]:
    if kind != "experts":
        return tensors
    rank = adapter.rank
    lora_A = tensors["lora_A"].reshape(-1, rank, tensors["lora_A"].shape[-1])
    lora_B = tensors["lora_B"].reshape(tensors["lora_B"].shape[0], rank, -1).permute(2, 0, 1)
    if adapter.lora_A.ndim == 2:  # a shared pair: the file's experts must agree
        if not (
            torch.equal(lora_A, lora_A[:1].expand_as(lora_A)) and torch.equal(lora_B, lora_B[:1].expand_as(lora_B))
        ):
            raise ValueError(f"{name}: the adapter holds a pair per expert; this run shares one (peft.experts=shared)")
        lora_A, lora_B = lora_A[0], lora_B[0]
    return {"lora_A": lora_A, "lora_B": lora_B}


def adapter_config(model: torch.nn.Module, settings: AdapterSettings, base_model: str | None) -> dict:
    """peft's LoraConfig of these adapters, as a dict."""
    modules, parameters, token_rows = set(), [], {}
    for name, adapter, _ in adapted_weights(model):
        kind = _kind(name)
        if kind == "tokens":
            token_rows[_TOKEN_LAYERS[name]] = list(adapter.indices)
        elif kind == "attention":
            modules.add(name.removesuffix(".weight").rsplit(".", 1)[1])
        else:
            owner = "shared_experts" if ".shared_experts." in name else "experts" if kind == "experts" else "mlp"
            leaf = name.rsplit(".", 2 if kind == "mlp" else 1)[1:]
            target = ".".join([owner, *leaf])
            if target not in parameters:
                parameters.append(target)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.r,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "use_dora": settings.dora,
        "bias": "none",
        "target_modules": sorted(modules) or None,
        "target_parameters": parameters or None,
        "trainable_token_indices": token_rows or None,
        "modules_to_save": [_TOKEN_LAYERS[weight] for weight in _trained_whole(settings)] or None,
        "inference_mode": True,
    }


def save_adapter(
    model: torch.nn.Module, settings: AdapterSettings, path: str | Path, base_model: str | None = None
) -> Path:
    """Write the adapters in peft's format (every rank calls it: sharded adapters are gathered; rank 0 writes)."""
    reason = unsupported(settings)
    if reason is not None:
        raise ValueError(f"the adapters cannot be written in peft's format: {reason}")
    tensors = {}
    for name, adapter, weight in adapted_weights(model):
        kind, keys = _kind(name), _keys(name)
        for tensor_name, tensor in _to_peft(adapter, kind, weight.shape[0]).items():
            tensors[keys[tensor_name]] = tensor
    for name in _trained_whole(settings):
        tensors[PREFIX + name] = gathered(model.get_parameter(name)).detach().float().cpu()
    path = Path(path)
    if not dist.is_initialized() or dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, path / WEIGHTS_FILE, metadata={"format": "pt"})
        config = adapter_config(model, settings, base_model)
        (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return path


@torch.no_grad()
def load_adapter(model: torch.nn.Module, settings: AdapterSettings, path: str | Path) -> None:
    """Fill the model's adapters from a peft-format directory written for the same targets, rank and method."""
    path = Path(path)
    config = json.loads((path / CONFIG_FILE).read_text())
    if (config.get("r"), bool(config.get("use_dora"))) != (settings.r, settings.dora):
        raise ValueError(
            f"{path / CONFIG_FILE}: r={config.get('r')}, use_dora={config.get('use_dora')}; this run has "
            f"peft.r={settings.r}, peft.method={settings.method}"
        )
    stored = load_file(path / WEIGHTS_FILE)
    used = set()
    for name, adapter, _ in adapted_weights(model):
        kind, keys = _kind(name), _keys(name)
        if isinstance(adapter, TokenRows):
            theirs = (config.get("trainable_token_indices") or {}).get(_TOKEN_LAYERS[name])
            if theirs != adapter.indices:
                raise ValueError(
                    f"{path / CONFIG_FILE}: trainable_token_indices for {_TOKEN_LAYERS[name]} are {theirs}; this run "
                    f"trains the rows {adapter.indices} (peft.trainable_tokens)"
                )
        wanted = {t: keys[t] for t, _ in adapter.named_parameters(recurse=False)}
        missing = [key for key in wanted.values() if key not in stored]
        if missing:
            raise ValueError(f"{path / WEIGHTS_FILE} has no {missing[0]} (for {name}): it adapts other targets")
        tensors = _from_peft({t: stored[key] for t, key in wanted.items()}, adapter, kind, name)
        for tensor_name, tensor in tensors.items():
            fill_from_whole(getattr(adapter, tensor_name), tensor)
        used |= set(wanted.values())
    if (config.get("modules_to_save") or []) != [_TOKEN_LAYERS[name] for name in _trained_whole(settings)]:
        raise ValueError(
            f"{path / CONFIG_FILE}: modules_to_save={config.get('modules_to_save')}; this run trains "
            f"{[_TOKEN_LAYERS[name] for name in _trained_whole(settings)]} whole (peft.targets)"
        )
    for name in _trained_whole(settings):
        fill_from_whole(model.get_parameter(name), stored[PREFIX + name])
        used.add(PREFIX + name)
    unused = sorted(set(stored) - used)
    if unused:
        raise ValueError(f"{path / WEIGHTS_FILE}: {len(unused)} tensors this run does not adapt, e.g. {unused[0]}")
