"""Untrusted programs (model-written code and its tests) in a sandbox of their own: glm46.sandbox.runner."""

from .runner import FAILED, KINDS, OUTPUT_LIMIT, PASSED, SANDBOX_ERROR, TIMEOUT, Limits, Outcome, Sandbox

__all__ = ["FAILED", "KINDS", "OUTPUT_LIMIT", "PASSED", "SANDBOX_ERROR", "TIMEOUT", "Limits", "Outcome", "Sandbox"]
