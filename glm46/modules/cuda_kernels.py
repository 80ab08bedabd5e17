"""The CUDA kernels glm46 can run in place of its portable paths, each on only once a GPU has verified it.

Each kernel replaces a path that is exact and tested on CPU, and bench/gpu_suite.py checks it against that path
on a GPU (values and gradients); the suite's table, with its date and card in the README's Benchmarks, is what
turns a kernel on here. Until then the portable path runs on CUDA too, and what depends on a kernel (context
parallelism's training on GPUs) is refused at composition.

- `varlen_attention`: rows of packed documents attend through one variable-length flash-attention call
  (torch.nn.attention.varlen) instead of one SDPA call per document (glm46.modules.attention).
- `context_flash`: context parallelism's blocks run the CUDA flash (bf16/fp16) or memory-efficient (fp32)
  attention ops that return the log-sum-exp, and their backward (glm46.parallel.context_parallel).
- `compiled_layers`: training compiles each decoder layer (torch.compile's inductor kernels in place of eager ops)
  unless the run says otherwise (`module.compile`; glm46.parallel.compile).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

# name -> on by default; set True only with a GPU suite run that verified it (its date and card beside it).
VERIFIED = {
    # 2026-11-27, one H200, torch 2.11: 8 x 4K tokens of 65 documents, values and q/k/v gradients within the per-
    # document loop's bf16 error of the fp32 loop; forward + backward 2.7x faster than the loop
    "varlen_attention": True,
    # 2026-11-27, one H200, torch 2.11: cp = 2 and 4 on rows of documents crossing the chunk edges, fp32 within 2.7e-6
    # of one device's attention, bf16 within the CPU blocks' error
    "context_flash": True,
    # each decoder layer under torch.compile (inductor's kernels) in training runs (glm46.parallel.compile, the
    # module's `compile` left at None): off until the suite's user-path row has run it on a GPU
    "compiled_layers": False,
}
_enabled = dict(VERIFIED)


def enabled(name: str) -> bool:
    """Whether CUDA tensors take kernel `name` (one of VERIFIED)."""
    return _enabled[name]


@contextmanager
def using(**kernels: bool) -> Iterator[None]:
    """Turn kernels on or off inside the block (the GPU suite compares each with its portable path):
    `with using(varlen_attention=True): ...`."""
    unknown = set(kernels) - set(VERIFIED)
    if unknown:
        raise KeyError(f"unknown CUDA kernel(s) {sorted(unknown)}; known: {sorted(VERIFIED)}")
    before = dict(_enabled)
    _enabled.update(kernels)
    try:
        yield
    finally:
        _enabled.clear()
        _enabled.update(before)
