"""A reward model's HF directory: the backbone as glm46.checkpoint.save_hf writes it, and beside it

    reward_head.safetensors   {"score.weight": [1, hidden]}, fp32
    reward_model.json         {"head": "reward_head.safetensors", "read_at": "last reply token",
                               "reward_mean": m, "reward_std": s}   (of the held-out pairs' rewards)

so that the directory still loads as a Glm4MoeForCausalLM (transformers, vLLM) and `load_reward_model` reads the
scorer back: the score of a conversation is `score.weight @ final_norm(hidden)` at the token that closes its reply.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from glm46.checkpoint import find_weights
from glm46.checkpoint.hf_read import load_hf
from glm46.modules import GLM46ForCausalLM
from glm46.parallel.state import is_writer

HEAD_FILE, INFO_FILE = "reward_head.safetensors", "reward_model.json"


def save_reward_head(path: Path, weight: torch.Tensor, mean: float, std: float) -> None:
    """Write the head and the reward statistics into the HF directory `path` (global rank 0)."""
    if not is_writer():
        return
    save_file({"score.weight": weight.detach().float().cpu().contiguous()}, str(path / HEAD_FILE))
    info = {"head": HEAD_FILE, "read_at": "last reply token", "reward_mean": mean, "reward_std": std}
    (path / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")


@dataclass
class RewardModel:
    """A loaded reward model: `score(ids, lengths)` -> the raw rewards [B] of right-padded conversations."""

    model: GLM46ForCausalLM
    head: torch.Tensor  # [1, hidden]
    mean: float
    std: float
    path: Path

    @torch.no_grad()
    def score(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        hidden = self.model.hidden_states(ids, positions)
        last = hidden[torch.arange(len(ids), device=ids.device), lengths - 1]
        return (last.float() @ self.head.float().T).squeeze(-1)

    def normalized(self, rewards: torch.Tensor) -> torch.Tensor:
        """Rewards in units of the held-out rewards' std, centred on their mean."""
        return (rewards - self.mean) / max(self.std, 1e-6)


def load_reward_model(path: str | Path, device: str | torch.device = "cpu") -> RewardModel:
    """The reward model of an export or a run directory (its hf/); FileNotFoundError naming the file when the
    directory holds a causal LM but no reward head."""
    folder = find_weights(path)
    if not (folder / INFO_FILE).is_file():
        raise FileNotFoundError(
            f"{folder} holds no reward model: {INFO_FILE} is missing (train one with module=reward_model)"
        )
    info = json.loads((folder / INFO_FILE).read_text())
    head = reward_head(folder).to(device)
    model = load_hf(folder, device=device).eval()
    return RewardModel(model, head, float(info["reward_mean"]), float(info["reward_std"]), folder)


def reward_head(path: str | Path) -> torch.Tensor | None:
    """The head [1, hidden] of the reward model at `path` (an export or a run directory), None for any other
    weights."""
    try:
        folder = find_weights(path)
    except FileNotFoundError:
        return None
    if not (folder / INFO_FILE).is_file():
        return None
    return load_file(str(folder / json.loads((folder / INFO_FILE).read_text())["head"]))["score.weight"]
