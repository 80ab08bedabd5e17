"""A training step of rows without packed documents reads nothing from the device on the host: on a GPU each such read
(`.item()`, `.tolist()`, `nonzero`, a boolean-mask index, `bincount`, which sizes its output by the largest value)
waits for every kernel queued before it, inside every MoE layer. The mode below sees each op a step dispatches and
records those that read a value to size or fill a host object; the CPU step takes the same ops as a CUDA bf16 step
(the grouped matmul on both; on a GPU the suite runs a step under torch.cuda.set_sync_debug_mode("error"))."""

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glm46.modules import GLM46ForCausalLM
from glm46.modules.model import total_loss

from .helpers import tiny_config

aten = torch.ops.aten
READS = {  # ops whose result's size or value comes from the device
    aten._local_scalar_dense.default,  # .item(), .tolist(), bool(), int(), float() of a tensor
    aten.nonzero.default,
    aten.bincount.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
}


class HostReads(TorchDispatchMode):
    """Records each op that reads a device value on the host, with the glm46 lines that called it."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        boolean_index = func is aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        )  # x[mask]: its size is the mask's count
        if func in READS or boolean_index:
            where = [
                f"{f.filename.split('glm46/')[-1]}:{f.lineno}"
                for f in traceback.extract_stack()
                if "glm46/" in f.filename
            ]
            self.reads.append(f"{func} at {' <- '.join(reversed(where)) or 'the test'}")
        return func(*args, **(kwargs or {}))


def test_the_mode_sees_each_kind_of_read():
    """The control: each read the step must not make is caught. (A CPU tensor's `.tolist()` reads its memory without
    dispatching an op, so only the GPU suite's sync check sees it.)"""
    x = torch.tensor([0, 2, 1, 2])
    with HostReads() as mode:
        x.sum().item()
        x.nonzero()
        torch.bincount(x)
        x[x > 0]
        x.new_zeros(3).scatter_add_(0, x, torch.ones_like(x))  # the fixed-size count the MoE takes: no read
    assert len(mode.reads) == 4, mode.reads


@pytest.mark.parametrize("mtp", [0, 1], ids=["plain", "mtp"])
def test_a_training_step_reads_nothing_on_the_host(mtp):
    torch.manual_seed(0)
    model = GLM46ForCausalLM(tiny_config(num_nextn_predict_layers=mtp))
    x = torch.randint(0, model.config.vocab_size, (2, 64))
    labels = x.roll(-1, dims=1)
    labels[:, -1] = -100  # unlabelled tokens too (the loss masks them without picking rows out)
    with HostReads() as mode:
        out = model(x, labels=labels)
        total_loss(out, 0.3, 1e-4).backward()
    assert mode.reads == []
