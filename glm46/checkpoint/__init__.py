"""Checkpoints in and out: the Hub format (config mapping, key mapping, sharded read and write, a streaming
safetensors writer), starting from earlier weights (`init_from`), Lightning checkpoints that a kill cannot break,
and resuming under another layout.

| file | what |
|---|---|
| hub_keys.py | our state-dict names <-> the Hub's (`to_hf` / `from_hf`), pure functions |
| hub_config.py | config.json, generation_config.json, tokenizer files |
| hf_read.py / hf_write.py | `load_hf` / `save_hf`, slice by slice on sharded models |
| safetensors_writer.py | a .safetensors file written tensor by tensor |
| weights.py | `load_weights`: a model's weights from an HF directory or a checkpoint (`init_from`) |
| atomic.py | checkpoint files and folders written under a temporary name; `ckpt_path=last` |
| safe_load.py | every checkpoint unpickled with only the types glm46's own checkpoints hold |
| reshard.py | resuming under another layout or world size |
| engine_limits.py | what vLLM or SGLang refuses in an export, said before it is launched |
"""

from .hf_read import load_hf
from .hf_write import save_hf
from .hub_config import CheckpointError
from .hub_files import find_weights

__all__ = ["CheckpointError", "find_weights", "load_hf", "save_hf"]
