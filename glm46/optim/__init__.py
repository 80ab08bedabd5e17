"""Optimizers and schedules: Muon (with AdamW groups, the GLM-4.5 recipe) and token-driven schedules."""

from .muon import Muon
from .param_groups import muon_param_groups
from .schedules import LinearRamp, Piecewise, WarmupCosine, WarmupStableDecay

__all__ = ["LinearRamp", "Muon", "Piecewise", "WarmupCosine", "WarmupStableDecay", "muon_param_groups"]
