"""The GLM-4.5/4.6 model in plain PyTorch, numerically equal to transformers' Glm4MoeForCausalLM."""

from .config import GLM46Config
from .generation import KVCache
from .model import CausalLMOutput, GLM46ForCausalLM, GLM46Model

__all__ = ["CausalLMOutput", "GLM46Config", "GLM46ForCausalLM", "GLM46Model", "KVCache"]
