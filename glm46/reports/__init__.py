"""Offline reports on finished runs: the sweep summary (`python -m glm46.compare`), the config diff
(`python -m glm46.diff`) and the plots of a run and of the curriculum."""
