"""`from glm46.hf import load_hf, save_hf`: the public names of HF import and export; the code is glm46.checkpoint."""

from glm46.checkpoint import CheckpointError, find_weights, load_hf, save_hf

__all__ = ["CheckpointError", "find_weights", "load_hf", "save_hf"]
