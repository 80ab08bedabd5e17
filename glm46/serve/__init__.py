"""Serving exports with the engines people deploy: the engine command (task=serve) and vLLM offline."""
