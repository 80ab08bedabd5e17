"""Which parameters Muon trains: the GLM-4.5 rule in one function."""

from __future__ import annotations

from torch import nn


def muon_param_groups(model: nn.Module) -> list[dict]:
    """GLM-4.5: "Muon for all parameters except word embedding, bias, and weights for RMSNorm".

    Muon: every matrix (attention projections, dense and shared MLPs, routers, MTP eh_proj) and the
    stacked routed experts, orthogonalised per expert, with the fused gate/up weight as two matrices.
    AdamW: the embedding and the lm_head (output layer, excluded as in Megatron's Muon), RMSNorm
    weights and biases. The correction bias is a buffer, moved by the balancer, not by an optimizer.
    """
    matrices, fused_gate_up, adamw = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or "embed_tokens" in name or "lm_head" in name:
            adamw.append(p)
        elif name.endswith("experts.gate_up_proj"):
            fused_gate_up.append(p)
        else:
            matrices.append(p)
    groups = [
        {"params": matrices, "use_muon": True},
        {"params": fused_gate_up, "use_muon": True, "row_chunks": 2},
        {"params": adamw, "use_muon": False},
    ]
    return [group for group in groups if group["params"]]
