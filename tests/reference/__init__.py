"""Pinned copies of other projects' formulas that glm46's are tested against (each names its source and license)."""
