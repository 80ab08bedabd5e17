"""PPO's formulas in glm46.rl.core_algos against verl's (a pinned copy: tests/reference/verl_core_algos.py) on
hand-made rows: GAE with a multi-turn row's tool-result tokens and padding outside the mask, the whitened advantages
and the returns; the clipped value loss and its clip fraction; the k1 and k3 KL estimators."""

import pytest
import torch

from glm46.rl.core_algos import gae_advantages, kl_estimate, masked_whiten, value_loss

from .reference import verl_core_algos as verl

MASK = torch.tensor(
    [
        [1, 1, 1, 1, 1, 1, 1, 1],  # a whole reply
        [1, 1, 0, 0, 0, 1, 1, 0],  # a tool call, its result (not the model's), the answer, padding
        [1, 1, 1, 0, 0, 0, 0, 0],  # a short reply and padding
    ],
    dtype=torch.float32,
)


def rows(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(MASK.shape, generator=generator)
    rewards = -0.05 * torch.rand(MASK.shape, generator=generator) * MASK  # a KL penalty on every token
    last = (MASK * torch.arange(1, MASK.shape[1] + 1)).argmax(dim=1)
    rewards[torch.arange(len(MASK)), last] += torch.tensor([1.0, 0.0, 0.7])  # the outcome at each reply's end
    return {"values": values, "rewards": rewards}


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.99, 1.0), (0.9, 0.8)])
def test_gae_advantages_and_returns_match_verl(gamma, lam):
    data = rows(0)
    expected_advantages, expected_returns = verl.compute_gae_advantage_return(
        data["rewards"], data["values"], MASK, gamma, lam
    )
    advantages, returns = gae_advantages(data["rewards"], data["values"], MASK, gamma, lam)
    torch.testing.assert_close(returns, expected_returns, rtol=0, atol=1e-6)
    torch.testing.assert_close(masked_whiten(advantages, MASK), expected_advantages, rtol=0, atol=1e-6)
    # the tool result does not cut the chain: the answer's advantage reaches back to the call's tokens
    assert advantages[1, 1] != pytest.approx(data["rewards"][1, 1] - data["values"][1, 1])


def test_whitening_with_the_whole_batchs_moments_equals_whitening_the_whole_batch():
    """What several ranks do: each whitens its rows with the mean and variance of all ranks' rows."""
    advantages = torch.randn(MASK.shape, generator=torch.Generator().manual_seed(1))
    whole = masked_whiten(advantages, MASK)
    count = MASK.sum()
    mean = (advantages * MASK).sum() / count
    var = (((advantages - mean) ** 2) * MASK).sum() / (count - 1)
    for part in (slice(0, 2), slice(2, 3)):
        torch.testing.assert_close(
            masked_whiten(advantages[part], MASK[part], mean, var), whole[part], atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("clip", [0.2, 0.5])
def test_value_loss_and_clip_fraction_match_verl(clip):
    generator = torch.Generator().manual_seed(2)
    old = torch.randn(MASK.shape, generator=generator)
    values = (old + 0.6 * torch.randn(MASK.shape, generator=generator)).requires_grad_()
    returns = torch.randn(MASK.shape, generator=generator)
    expected, expected_fraction = verl.compute_value_loss(values, returns, old, MASK, clip)
    expected_grad = torch.autograd.grad(expected, values)[0]
    loss, fraction = value_loss(values, old, returns, MASK, clip)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.autograd.grad(loss, values)[0], expected_grad, rtol=1e-6, atol=1e-7)
    assert fraction.item() == pytest.approx(expected_fraction.item(), abs=1e-6) and 0 < fraction < 1


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_estimators_match_verl(estimator):
    generator = torch.Generator().manual_seed(3)
    logprobs, ref = -5 * torch.rand(4, 6, generator=generator), -5 * torch.rand(4, 6, generator=generator)
    logprobs[0, 0], ref[0, 0] = -60.0, -1.0  # far apart: verl's clamps
    torch.testing.assert_close(kl_estimate(logprobs, ref, estimator), verl.kl_penalty_forward(logprobs, ref, estimator))
    with pytest.raises(ValueError, match="unknown KL estimator 'k2'"):
        kl_estimate(logprobs, ref, "k2")
