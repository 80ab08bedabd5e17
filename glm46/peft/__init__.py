"""Parameter-efficient fine-tuning: LoRA and DoRA adapters on the attention, MLPs and routed experts of a frozen
GLM46ForCausalLM, their merge into the base, and their files in the peft library's format."""

from .adapters import ExpertAdapter, LinearAdapter
from .inject import (
    adapted_weights,
    adapter_parameters,
    adapters_disabled,
    add_adapters,
    is_adapter_name,
    reset_adapters,
)
from .settings import AdapterSettings

__all__ = [
    "AdapterSettings",
    "ExpertAdapter",
    "LinearAdapter",
    "adapted_weights",
    "adapter_parameters",
    "adapters_disabled",
    "add_adapters",
    "is_adapter_name",
    "reset_adapters",
]
