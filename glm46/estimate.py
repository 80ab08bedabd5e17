"""`from glm46.estimate import count_parameters`: the public name of parameter counting; the code is
glm46.planning.counts."""

from glm46.planning.counts import count_parameters

__all__ = ["count_parameters"]
