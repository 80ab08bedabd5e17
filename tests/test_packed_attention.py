"""Rows of packed documents: attention run per document equals SDPA with the dense document mask it replaced,
forward and backward, and a 32K-token packed row trains in memory that grows with T, not T^2."""

import time

import pytest
import torch
import torch.nn.functional as F

import glm46.modules.attention as attention
from glm46.modules import GLM46ForCausalLM, cuda_kernels
from glm46.modules.attention import Documents, packed_attention, per_document_attention
from glm46.modules.loss import IGNORE_INDEX

from .helpers import random_model, tiny_config

# Per row, its documents' lengths; every row of a packing sums to T = 12.
PACKINGS = {
    "documents of length 1": [[1, 1, 5, 1, 4], [3, 1, 1, 1, 1, 5]],
    "rows packed differently": [[5, 7], [2, 3, 4, 3]],
    "a row that is one document": [[12], [4, 4, 4]],
    "one row of single tokens": [[1] * 12, [6, 6]],
}


def positions_of(lengths: list[list[int]]) -> torch.Tensor:
    """[B, T] position ids restarting at 0 at each document."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


def dense_mask_attention(q, k, v, lengths, scale):
    """The replaced path: one SDPA call with a [B, 1, T, T] mask, causal within a document."""
    document = (positions_of(lengths) == 0).cumsum(dim=-1)  # [B, T]
    T = document.shape[1]
    mask = (document[:, :, None] == document[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True)


@pytest.mark.parametrize("lengths", PACKINGS.values(), ids=PACKINGS.keys())
def test_per_document_attention_equals_the_dense_mask_forward_and_backward(lengths):
    """GQA (4 query heads on 2 kv heads), fp32: outputs and q/k/v gradients agree."""
    generator = torch.Generator().manual_seed(0)
    B, T = len(lengths), 12
    shapes = [(B, 4, T, 32), (B, 2, T, 32), (B, 2, T, 32)]
    inputs = [torch.randn(s, generator=generator, requires_grad=True) for s in shapes]
    upstream = torch.randn(B, 4, T, 32, generator=generator)
    results = []
    for fn in (per_document_attention, dense_mask_attention):
        out = fn(*inputs, lengths, 32**-0.5)
        grads = torch.autograd.grad(out, inputs, upstream)
        results.append((out, *grads))
    for ours, reference in zip(*results):
        torch.testing.assert_close(ours, reference)


@pytest.mark.parametrize("lengths", PACKINGS.values(), ids=PACKINGS.keys())
def test_model_on_packed_rows_equals_the_dense_mask_model(lengths, monkeypatch):
    """The whole model with MTP (every decoder layer and the MTP layer attend per document): losses and every
    parameter's gradient equal those of the model with the dense-mask attention swapped in."""
    config = tiny_config(num_nextn_predict_layers=1)
    positions = positions_of(lengths)
    x = torch.randint(0, config.vocab_size, positions.shape, generator=torch.Generator().manual_seed(1))
    labels = x.roll(-1, dims=1).masked_fill(positions.roll(-1, dims=1) == 0, IGNORE_INDEX)

    def losses_and_grads():
        model = random_model(config)
        out = model(x, labels=labels, position_ids=positions)
        (out.loss + out.mtp_loss).backward()
        return [out.loss, out.mtp_loss, *(p.grad for p in model.parameters())]

    ours = losses_and_grads()
    monkeypatch.setattr(
        attention, "packed_attention", lambda q, k, v, docs, scale: dense_mask_attention(q, k, v, docs.lengths, scale)
    )
    reference = losses_and_grads()
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b)


def test_documents_start_at_position_zero_and_at_each_row_start():
    positions = torch.tensor([[3, 4, 5, 0, 1], [0, 1, 2, 3, 4], [0, 0, 1, 0, 1]])
    documents = Documents.from_positions(positions)
    assert documents.lengths == [[3, 2], [5], [1, 2, 2]]
    assert documents.ids.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0], [0, 1, 1, 2, 2]]
    assert documents.cu_seqlens.tolist() == [0, 3, 5, 10, 11, 13, 15]  # offsets in the flattened [B * T] tokens
    assert documents.cu_seqlens.dtype == torch.int32 and documents.max_length == 5
    assert Documents.from_positions(torch.arange(5).expand(2, 5) + 7) is None  # one document per row: plain causal


def test_cpu_rows_take_the_per_document_path_with_every_cuda_kernel_on():
    """The CUDA kernels are selected by device: on CPU packed_attention stays the exact loop (torch's varlen_attn
    would raise on CPU tensors), whatever cuda_kernels says."""
    lengths = PACKINGS["documents of length 1"]
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 12, 16, generator=generator, dtype=torch.bfloat16) for h in (4, 2, 2))
    documents = Documents.from_positions(positions_of(lengths))
    with cuda_kernels.using(varlen_attention=True, context_flash=True):
        out = packed_attention(q, k, v, documents, 0.25)
    torch.testing.assert_close(out, per_document_attention(q, k, v, lengths, 0.25), rtol=0, atol=0)
    with pytest.raises(KeyError, match="unknown CUDA kernel"):
        cuda_kernels.using(flash=True).__enter__()


def peak_rss_growth_mib(step) -> tuple[float, float]:
    """Peak resident memory above the current while step() runs (Linux: VmHWM, reset through clear_refs), and
    the seconds it took."""

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return int(f.read().split(f"{field}:")[1].split()[0])  # kB

    base = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak RSS := current RSS
    start = time.perf_counter()
    step()
    return (status("VmHWM") - base) / 1024, time.perf_counter() - start


def test_a_32k_packed_row_trains_without_a_t_squared_mask():
    """Forward and backward of a 1-layer model on one row of 32,768 tokens in 8 documents. A dense mask alone
    would take 1 GiB (bool) plus 4 GiB for the float bias SDPA turns it into; the model's own fp32 activations
    here are ~300 MiB (8 MiB per [T, 64] tensor), and the per-document attention adds O(T) to them."""
    T = 32768
    config = tiny_config(
        num_hidden_layers=1, num_attention_heads=2, num_nextn_predict_layers=0, max_position_embeddings=T
    )
    torch.manual_seed(0)
    model = GLM46ForCausalLM(config)
    x = torch.randint(0, config.vocab_size, (1, T))
    positions = positions_of([[T // 8] * 8])
    labels = x.roll(-1, dims=1).masked_fill(positions.roll(-1, dims=1) == 0, IGNORE_INDEX)
    model(x[:, :512], labels=labels[:, :512], position_ids=positions_of([[64] * 8])).loss.backward()  # warm-up

    growth, seconds = peak_rss_growth_mib(lambda: model(x, labels=labels, position_ids=positions).loss.backward())
    print(f"32K packed row, forward + backward: peak RSS +{growth:.0f} MiB in {seconds:.1f} s")
    assert growth < 512, f"{growth:.0f} MiB: a T^2 mask or score matrix is back"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_context_parallel_attention_equals_packed_attention_for_every_rank(dtype, cp):
    """Each cp rank's queries (load-balanced chunks r and 2cp-1-r) against the whole row's keys, cut at documents that
    cross the chunk edges: the outputs are the whole row's, and the ranks' gradients sum to its gradients."""
    from glm46.parallel.context_parallel import ContextAttention, attention_pieces

    generator = torch.Generator().manual_seed(0)
    B, H, KV, T, d = 2, 4, 2, 16, 8
    q, k, v = (torch.randn(B, h, T, d, dtype=dtype, generator=generator).requires_grad_() for h in (H, KV, KV))
    lengths = [[5, 11], [16]]
    whole = per_document_attention(q, k, v, lengths, 0.3)
    grad = torch.randn(whole.shape, dtype=dtype, generator=generator)
    expected = torch.autograd.grad(whole, (q, k, v), grad)
    summed = [torch.zeros_like(t) for t in (q, k, v)]
    chunk = T // (2 * cp)
    for rank in range(cp):
        ranges = [(i * chunk, (i + 1) * chunk) for i in (rank, 2 * cp - 1 - rank)]
        mine = torch.cat([torch.arange(start, end) for start, end in ranges])
        local = q.detach()[:, :, mine].requires_grad_()
        out = ContextAttention.apply(local, k, v, [attention_pieces(ranges, row) for row in lengths], 0.3)
        torch.testing.assert_close(out, whole[:, :, mine])
        dq, dk, dv = torch.autograd.grad(out, (local, k, v), grad[:, :, mine])
        summed[0][:, :, mine] += dq
        summed[1] += dk
        summed[2] += dv
    for got, want in zip(summed, expected):
        torch.testing.assert_close(got, want)


def test_attention_pieces_cut_the_local_chunks_at_document_boundaries():
    """Rank 0 of 2 over 16 tokens holds 0-3 and 12-15; documents of 5 and 11 tokens: queries 0-3 start the first
    document, 12-15 are the second's tokens 7-10 and see its keys from 5."""
    from glm46.parallel.context_parallel import attention_pieces

    assert attention_pieces([(0, 4), (12, 16)], [5, 11]) == [(0, 4, 0, 0), (4, 8, 5, 12)]
    assert attention_pieces([(4, 8), (8, 12)], [5, 11]) == [(0, 1, 0, 4), (1, 4, 5, 5), (4, 8, 5, 8)]
