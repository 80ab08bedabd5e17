"""PPO's formulas in glm46.rl.core_algos against verl's (a pinned copy: tests/reference/verl_core_algos.py) on
hand-made rows: GAE with a multi-turn row's tool-result tokens and padding outside the mask, the whitened advantages
and the returns; the clipped value loss and its clip fraction; the k1 and k3 KL estimators; the per-token clipped
policy loss (with and without the dual clip) against verl's formula, written out token by token; the adaptive KL
controller against its formula by hand."""

import pytest
import torch

from glm46.rl.core_algos import KLController, gae_advantages, kl_estimate, masked_whiten, policy_loss, value_loss

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


def verl_policy_loss(logprobs, old, advantages, mask, low, high, c):
    """verl's `compute_policy_loss_vanilla` (verl/trainer/ppo/core_algos.py) token by token, "token-mean": the
    ratio exp(clamp(logp - old, -20, 20)), l = max(-A r, -A clip(r, 1 - low, 1 + high)), for A < 0 at most -A c
    (dual clip), the mean over the mask; and its clip fraction, the share of tokens where the clipped term is the
    larger. c = None: no dual clip."""
    total, clipped, count = 0.0, 0, 0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            a, ratio = advantages[i, t], torch.exp((logprobs[i, t] - old[i, t]).clamp(-20, 20))
            unclipped, bounded = -a * ratio, -a * ratio.clamp(1 - low, 1 + high)
            loss = torch.maximum(unclipped, bounded)
            if c is not None and a < 0:
                loss = torch.minimum(loss, -a * c)
            total, clipped, count = total + loss, clipped + int(bounded > unclipped), count + 1
    return total / count, clipped / count


@pytest.mark.parametrize("c", [None, 3.0], ids=["no-dual-clip", "dual-clip-3"])
@pytest.mark.parametrize(("low", "high"), [(0.2, 0.2), (0.2, 0.28)])
def test_per_token_policy_loss_and_gradients_match_verl(low, high, c):
    """GAE's per-token advantages; ratios from 0.2 to 5, so that both clips and the dual clip act on some tokens."""
    generator = torch.Generator().manual_seed(4)
    old = -3 * torch.rand(MASK.shape, generator=generator)
    logprobs = (old + torch.empty(MASK.shape).uniform_(-1.6, 1.6, generator=generator)).requires_grad_()
    advantages = torch.randn(MASK.shape, generator=generator)
    assert ((logprobs - old).exp() * MASK > 3).any() and ((logprobs - old).exp() < 0.5).any()
    loss, stats = policy_loss(logprobs, old, advantages, MASK, low, high, eps_clip_c=c)
    expected, fraction = verl_policy_loss(logprobs, old, advantages, MASK, low, high, c)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    gradient, expected_gradient = (torch.autograd.grad(value, logprobs)[0] for value in (loss, expected))
    torch.testing.assert_close(gradient, expected_gradient, rtol=1e-6, atol=1e-7)
    assert stats["clip_fraction"].item() == pytest.approx(fraction, abs=1e-6) and 0 < fraction < 1


def test_the_dual_clip_bounds_only_negative_advantages_at_large_ratios():
    old, mask = torch.zeros(1, 4), torch.ones(1, 4)
    logprobs = torch.log(torch.tensor([[5.0, 5.0, 2.0, 0.5]]))
    advantages = torch.tensor([[-1.0, 1.0, -1.0, -1.0]])
    per_token = [policy_loss(logprobs[:, [t]], old[:, [t]], advantages[:, [t]], mask[:, [t]], eps_clip_c=3.0)[0]
                 for t in range(4)]  # fmt: skip
    assert [round(float(v), 6) for v in per_token] == [3.0, -1.2, 2.0, 0.8]  # dual clip, clip, none, clip
    with pytest.raises(ValueError, match="eps_clip_c .dual clip. must be > 1"):
        policy_loss(logprobs, old, advantages, mask, eps_clip_c=1.0)


def test_the_adaptive_kl_controller_follows_its_formula_and_a_fixed_one_stays():
    """value x (1 + clip(kl / target - 1, -0.2, 0.2) x n / horizon), by hand."""
    adaptive, fixed = KLController(0.1, target=0.02, horizon=1000), KLController(0.1)
    expected = 0.1
    for kl, n, error in [(0.04, 64, 0.2), (0.021, 64, 0.05), (0.01, 128, -0.2), (0.02, 64, 0.0)]:
        adaptive.update(kl, n)
        fixed.update(kl, n)
        expected *= 1 + error * n / 1000
        assert adaptive.value == pytest.approx(expected, rel=1e-12)
    assert adaptive.value != 0.1 and fixed.value == 0.1
    with pytest.raises(ValueError, match="target > 0 and horizon > 0"):
        KLController(0.1, target=0.02, horizon=0)
