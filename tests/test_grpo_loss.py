"""The GRPO loss of glm46.rl: parity with TRL's GRPOTrainer._compute_loss on a tiny Glm4MoeForCausalLM (loss,
per-token log-probs, gradients of every parameter), and the properties of each piece."""

import math

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from glm46.modules.loss import IGNORE_INDEX
from glm46.rl import group_advantages, policy_loss, token_logprobs

from .helpers import randomise

TOLERANCE = 1e-6
VOCAB = 128
TEMPERATURE = 0.9
PROMPT_LENGTHS = (5, 3, 4, 2)  # left-padded to 5
COMPLETION_LENGTHS = (6, 4, 6, 2)  # masked tails up to 6
TRL_LOSS = {"seq_mean": "grpo", "token_mean": "dapo"}


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    """A tiny random Glm4MoeForCausalLM on disk: TRL builds its reference model (beta > 0) from the model's path."""
    config = Glm4MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("glm4_moe")
    randomise(Glm4MoeForCausalLM(config), seed=0).save_pretrained(path)
    return path


def word_level_tokenizer() -> PreTrainedTokenizerFast:
    """One word per id: TRL wants a processing_class with pad and eos tokens; the test never tokenizes text."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", eos_token="t1", unk_token="t2")


def trl_trainer(model_dir, tmp_path, loss_type: str, beta: float) -> GRPOTrainer:
    """TRL's trainer around the model of model_dir, fp32 on CPU, clipping at [0.8, 1.28] like DAPO, in eval mode."""
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        bf16=False,  # bf16 autocast would round the log-probs by up to 0.02
        use_cpu=True,
        report_to="none",
        loss_type=loss_type,
        beta=beta,
        epsilon=0.2,
        epsilon_high=0.28,
        temperature=TEMPERATURE,
        num_generations=2,
        per_device_train_batch_size=len(PROMPT_LENGTHS),
        max_completion_length=max(COMPLETION_LENGTHS),
        router_aux_loss_coef=0.0,  # glm46 balances experts outside the policy loss
        use_bias_correction_kl=False,  # TRL 1.16's default weighs the KL by the ratio (DeepSeek-V3.2); plain k3 here
    )
    trainer = GRPOTrainer(
        model=Glm4MoeForCausalLM.from_pretrained(model_dir),
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["t5 t6", "t7 t8 t9"]}),
        processing_class=word_level_tokenizer(),
    )
    # TRL 1.16 divides "grpo" by current_gradient_accumulation_steps and rescales "dapo"'s num_items_in_batch by
    # gradient_accumulation_steps / steps_per_generation in train mode only, and the former exists only inside
    # Trainer's training loop. In eval mode both are 1: the loss of this one batch, "dapo" over
    # num_items_in_batch / num_processes, which is our token_mean with num_tokens passed the same way.
    trainer.model.eval()
    return trainer


def padded(lengths: tuple[int, ...], width: int, left: bool, generator: torch.Generator):
    """Random ids [B, width] and their mask [B, width] with each row's `lengths` tokens, padding left or right."""
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=generator)
    positions = torch.arange(width).flip(0) if left else torch.arange(width)
    mask = (positions < torch.tensor(lengths).unsqueeze(1)).long()
    return ids.masked_fill(mask == 0, 0), mask


def grpo_inputs(trainer: GRPOTrainer, beta: float) -> dict[str, torch.Tensor]:
    """A batch as `_compute_loss` reads it; old (and reference) log-probs are TRL's plus noise, so the ratio is
    clipped on both sides (and the KL is not 0)."""
    generator = torch.Generator().manual_seed(2)
    prompt_ids, prompt_mask = padded(PROMPT_LENGTHS, max(PROMPT_LENGTHS), True, generator)
    completion_ids, completion_mask = padded(COMPLETION_LENGTHS, max(COMPLETION_LENGTHS), False, generator)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([prompt_mask, completion_mask], dim=1),
            completion_ids.shape[1],
        )
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.7, -1.2]),
        "old_per_token_logps": logps + 0.3 * torch.randn(logps.shape, generator=generator),
        "num_items_in_batch": completion_mask.sum(),
    }
    if beta > 0:
        inputs["ref_per_token_logps"] = logps + 0.2 * torch.randn(logps.shape, generator=generator)
    return inputs


def gradients(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """d loss / d parameter for every parameter (0 where none flows), leaving the model's grads cleared."""
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {name: torch.zeros_like(p) if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def our_loss(model: torch.nn.Module, inputs: dict, aggregation: str, beta: float, num_processes: int):
    """Our log-probs of the completion tokens, from the same model's final normed hidden states and lm_head weight,
    and our policy loss on them."""
    prompt_width = inputs["prompt_ids"].shape[1]
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    hidden = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states[-1]
    targets = inputs["completion_ids"].masked_fill(inputs["completion_mask"] == 0, IGNORE_INDEX)  # [B, C]
    # The hidden state at position t predicts token t + 1; chunk_size 16 < 4 x 6 tokens: the checkpointed path.
    logps, entropy = token_logprobs(
        hidden[:, prompt_width - 1 : -1], model.lm_head.weight, targets, TEMPERATURE, chunk_size=16, return_entropy=True
    )
    num_tokens = inputs["num_items_in_batch"] / num_processes if aggregation == "token_mean" else None
    loss, stats = policy_loss(
        logps,
        inputs["old_per_token_logps"],
        inputs["advantages"],
        inputs["completion_mask"],
        eps_low=0.2,
        eps_high=0.28,
        aggregation=aggregation,
        num_tokens=num_tokens,
        kl_coef=beta,
        ref_logprobs=inputs.get("ref_per_token_logps"),
    )
    return loss, stats, logps, entropy


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated")  # GRPOConfig's own default sets it
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean"])
def test_loss_logprobs_and_gradients_match_trl(hf_model_dir, tmp_path, aggregation, beta):
    trainer = trl_trainer(hf_model_dir, tmp_path, TRL_LOSS[aggregation], beta)
    model = trainer.model
    inputs = grpo_inputs(trainer, beta)
    trl_loss = trainer._compute_loss(model, inputs)
    trl_grads = gradients(model, trl_loss)
    metrics = {name: values[-1] for name, values in trainer._metrics["eval"].items()}
    with torch.no_grad():
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        trl_logps, trl_entropy, _ = trainer._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, inputs["completion_ids"].shape[1], compute_entropy=True
        )

    loss, stats, logps, entropy = our_loss(model, inputs, aggregation, beta, trainer.accelerator.num_processes)
    grads = gradients(model, loss)

    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0  # both sides clip
    assert abs(loss.item() - trl_loss.item()) <= TOLERANCE  # absolute; |loss| is 0.04 (seq_mean) to 0.35
    assert (logps - trl_logps).abs().max() <= TOLERANCE  # absolute; log-probs ~ -5, 0 on the masked tails
    assert (entropy - trl_entropy).abs().max() <= TOLERANCE * trl_entropy.max()  # relative; entropies ~ 5
    grad_norm = torch.stack([g.norm() for g in trl_grads.values()]).norm()
    assert max((grads[name] - g).norm() for name, g in trl_grads.items()) <= TOLERANCE * grad_norm
    assert stats["clip_fraction"].item() == pytest.approx(metrics["clip_ratio/region_mean"], abs=TOLERANCE)
    assert stats["clip_fraction"] > 0
    if beta > 0:
        assert stats["kl"].item() == pytest.approx(metrics["kl"], abs=TOLERANCE) and stats["kl"] > 0


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 3.0])
    centred = [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0, -0.75, -0.75, -0.75, 2.25]
    stds = [math.sqrt(1 / 3)] * 4 + [0.0] * 4 + [1.5] * 4  # Bessel: sum of squares / (4 - 1)
    expected = torch.tensor([c / (s + 1e-6) for c, s in zip(centred, stds)])
    torch.testing.assert_close(group_advantages(rewards, 4), expected)  # the all-equal group: 0, not NaN
    torch.testing.assert_close(group_advantages(rewards, 4, scale_rewards=False), torch.tensor(centred))
    expected_trl_eps = torch.tensor([c / (s + 1e-4) for c, s in zip(centred, stds)])
    torch.testing.assert_close(group_advantages(rewards, 4, eps=1e-4), expected_trl_eps)


def test_group_of_one_has_zero_advantage():
    assert torch.equal(group_advantages(torch.tensor([3.0, -1.0, 0.5]), 1), torch.zeros(3))


def reference_logprobs(hidden, weight, targets, temperature):
    """The unchunked log_softmax gather, 0 where the target is IGNORE_INDEX, and the entropy."""
    logprobs = (hidden @ weight.T / temperature).log_softmax(dim=-1)  # [B, T, V]
    ignored = targets == IGNORE_INDEX
    target = logprobs.gather(-1, targets.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1).masked_fill(ignored, 0)
    entropy = -(logprobs.exp() * logprobs).sum(-1).masked_fill(ignored, 0)
    return target, entropy


@pytest.mark.parametrize("chunk_size", [5, 4096])  # 5 < 2 x 12 tokens: checkpointed chunks, the last one short
def test_token_logprobs_equal_the_unchunked_log_softmax(chunk_size):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 12, 8, generator=generator, requires_grad=True)
    weight = torch.randn(64, 8, generator=generator, requires_grad=True)
    targets = torch.randint(0, 64, (2, 12), generator=generator)
    targets[0, :3] = IGNORE_INDEX
    targets[1, -4:] = IGNORE_INDEX
    upstream = torch.randn(2, 12, generator=generator)

    logps, entropy = token_logprobs(hidden, weight, targets, 0.7, chunk_size, return_entropy=True)
    grads = torch.autograd.grad((logps * upstream).sum(), (hidden, weight))
    expected, expected_entropy = reference_logprobs(hidden, weight, targets, 0.7)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (hidden, weight))

    assert (logps - expected).abs().max() <= TOLERANCE
    assert torch.all(logps[targets == IGNORE_INDEX] == 0) and torch.all(logps[targets != IGNORE_INDEX] < 0)
    assert (entropy - expected_entropy.detach()).abs().max() <= TOLERANCE and not entropy.requires_grad
    for grad, expected_grad in zip(grads, expected_grads):  # relative to the largest entry, ~10
        assert (grad - expected_grad).abs().max() <= TOLERANCE * expected_grad.abs().max()
    assert torch.equal(token_logprobs(hidden, weight, targets, 0.7, chunk_size), logps)


def test_token_logprobs_saves_no_logits_for_backward():
    """Checkpointed chunks: the forward saves its inputs only, never [tokens, vocab] logits, which the backward
    recomputes one chunk at a time."""
    hidden = torch.randn(2, 24, 8, requires_grad=True)
    weight = torch.randn(64, 8, requires_grad=True)
    saved_shapes = []

    def record(tensor):
        saved_shapes.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
        logps = token_logprobs(hidden, weight, torch.randint(0, 64, (2, 24)), chunk_size=8)
    logps.sum().backward()
    assert saved_shapes and all(shape[-1] != 64 for shape in saved_shapes) and hidden.grad is not None


def padded_batch():
    """logprobs [3, 4] with grad, advantages [3], mask [3, 4] of 4, 2 and 3 tokens."""
    logprobs = -torch.rand(3, 4, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    return logprobs.requires_grad_(), torch.tensor([1.0, -2.0, 3.0]), mask


def test_ratio_one_gives_minus_the_mean_advantage_for_each_aggregation():
    logprobs, advantages, mask = padded_batch()
    old = logprobs.detach().masked_fill(mask == 0, float("-inf"))  # padding may hold anything
    token_mean, stats = policy_loss(logprobs, old, advantages, mask, aggregation="token_mean")
    seq_mean, _ = policy_loss(logprobs, old, advantages, mask, aggregation="seq_mean")
    global_count, _ = policy_loss(logprobs, old, advantages, mask, aggregation="token_mean", num_tokens=18)

    assert token_mean.item() == pytest.approx(-(1 * 4 - 2 * 2 + 3 * 3) / 9)  # each token weighs the same
    assert seq_mean.item() == pytest.approx(-(1 - 2 + 3) / 3)  # each sequence weighs the same
    assert global_count.item() == pytest.approx(-(1 * 4 - 2 * 2 + 3 * 3) / 18)
    assert stats["ratio_mean"].item() == 1 and stats["clip_fraction"].item() == 0 and "kl" not in stats
    (grad,) = torch.autograd.grad(token_mean, logprobs)
    assert torch.isfinite(grad).all() and torch.all(grad[mask == 0] == 0)


@pytest.mark.parametrize("ratio", [0.7, 0.9, 1.1, 1.25, 1.35])
@pytest.mark.parametrize("advantage", [1.5, -1.5])
def test_clip_higher_changes_only_ratios_above_1_plus_eps_low_with_positive_advantage(ratio, advantage):
    logprobs, old = torch.tensor([[math.log(ratio)]]), torch.zeros(1, 1)
    args = (logprobs, old, torch.tensor([advantage]), torch.ones(1, 1))
    symmetric, _ = policy_loss(*args, eps_low=0.2)
    higher, stats = policy_loss(*args, eps_low=0.2, eps_high=0.28)

    changed = ratio > 1.2 and advantage > 0
    assert (higher.item() != pytest.approx(symmetric.item())) == changed
    if changed:  # the clip moved from 1.2 to min(ratio, 1.28)
        assert higher.item() == pytest.approx(-min(ratio, 1.28) * advantage)
    clip_active = (ratio > 1.28 and advantage > 0) or (ratio < 0.8 and advantage < 0)
    assert stats["clip_fraction"].item() == clip_active


def test_kl_term_is_k3_times_kl_coef():
    logprobs, advantages, mask = padded_batch()
    ref = logprobs.detach() + math.log(2)  # exp(ref - logp) = 2 on every token
    loss, stats = policy_loss(logprobs, logprobs.detach(), 0 * advantages, mask, kl_coef=0.1, ref_logprobs=ref)
    k3 = 2 - math.log(2) - 1
    assert loss.item() == pytest.approx(0.1 * k3) and stats["kl"].item() == pytest.approx(k3)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(aggregation="sum"), "unknown aggregation 'sum'; allowed: token_mean, seq_mean"),
        (dict(aggregation="seq_mean", num_tokens=10), "num_tokens is the divisor of aggregation='token_mean' only"),
        (dict(old_logprobs=torch.zeros(3, 5)), r"old_logprobs \(3, 5\) differs from logprobs \(3, 4\)"),
        (dict(mask=torch.ones(3, 5)), r"mask \(3, 5\) differs"),
        (
            dict(advantages=torch.zeros(3, 1)),
            r"advantages must be \[B\] = \(3,\), or \[B, T\] = \(3, \d+\) .* got \(3, 1\)",
        ),
        (dict(kl_coef=0.1), "kl_coef > 0 needs ref_logprobs"),
        (dict(kl_coef=0.1, ref_logprobs=torch.zeros(2, 4)), r"ref_logprobs \(2, 4\) differs"),
        (dict(eps_low=1.0), "need 0 <= eps_low < 1"),
        (dict(eps_high=-0.1), "eps_high >= 0"),
    ],
)
def test_policy_loss_rejects_bad_arguments(overrides, message):
    logprobs, advantages, mask = padded_batch()
    args = dict(logprobs=logprobs, old_logprobs=logprobs.detach(), advantages=advantages, mask=mask) | overrides
    with pytest.raises(ValueError, match=message):
        policy_loss(**args)


def test_group_advantages_and_token_logprobs_reject_bad_arguments():
    with pytest.raises(ValueError, match="group_size must be >= 1 and divide the 6 rewards, got 4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        group_advantages(torch.zeros(2, 3), 3)
    with pytest.raises(ValueError, match="need temperature > 0 and chunk_size >= 1, got 0 and 4096"):
        token_logprobs(torch.zeros(1, 2, 8), torch.zeros(4, 8), torch.zeros(1, 2, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match=r"hidden \(1, 2, 8\) and targets \(1, 3\) differ"):
        token_logprobs(torch.zeros(1, 2, 8), torch.zeros(4, 8), torch.zeros(1, 3, dtype=torch.long))
