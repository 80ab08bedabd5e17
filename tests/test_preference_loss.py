"""The preference losses of glm46.rl.preference_loss against TRL's: the Bradley-Terry loss, accuracy and margin of
RewardTrainer.compute_loss (with its margin and centring), and DPO's sigmoid and IPO losses and their gradients of
DPOTrainer._compute_loss on a tiny Glm4MoeForCausalLM (the log-probs ours from the same model's hidden states)."""

import pytest
import torch
from datasets import Dataset
from transformers import Glm4MoeForCausalLM, LlamaConfig, LlamaForSequenceClassification
from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer

from glm46.modules.loss import IGNORE_INDEX
from glm46.rl.core_algos import token_logprobs
from glm46.rl.preference_loss import bradley_terry_loss, dpo_loss, sequence_logprobs

from .helpers import randomise
from .test_grpo_loss import TOLERANCE, VOCAB, gradients, hf_model_dir, word_level_tokenizer

__all__ = ["hf_model_dir"]  # the fixture: a tiny random Glm4MoeForCausalLM on disk
PAIRS, WIDTH = 3, 9
PROMPT_LENGTHS = (4, 2, 5)  # the completion starts there; right padding after each side's length
LENGTHS = ((7, 9), (5, 4), (9, 8))  # (chosen, rejected) lengths


def pair_inputs(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Chosen rows then rejected rows [2P, WIDTH], right-padded, with TRL's completion_mask (1 on completion tokens)."""
    ids = torch.randint(3, VOCAB, (2 * PAIRS, WIDTH), generator=generator)
    lengths = torch.tensor([c for c, _ in LENGTHS] + [r for _, r in LENGTHS])
    prompts = torch.tensor(PROMPT_LENGTHS * 2)
    positions = torch.arange(WIDTH)
    attention = (positions < lengths[:, None]).long()
    completion = attention * (positions >= prompts[:, None]).long()
    ids[PAIRS:] = torch.where(positions < prompts[:PAIRS, None], ids[:PAIRS], ids[PAIRS:])  # a pair shares its prompt
    return {"input_ids": ids.masked_fill(attention == 0, 0), "attention_mask": attention, "completion_mask": completion}


def test_bradley_terry_loss_accuracy_and_margin_match_trl(tmp_path):
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            num_labels=1,
            pad_token_id=0,
        )
    )
    randomise(model, seed=0)  # rewards far apart: some pairs ranked right, some wrong
    args = RewardConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", center_rewards_coefficient=0.01, bf16=False
    )
    pairs = Dataset.from_dict({"chosen": ["t5 t9"], "rejected": ["t5 t11"]})
    trainer = RewardTrainer(model=model, args=args, train_dataset=pairs, processing_class=word_level_tokenizer())
    inputs = pair_inputs(torch.Generator().manual_seed(0))
    margin = torch.tensor([0.5, -0.2, 0.0])
    trl_loss = trainer.compute_loss(model, {**inputs, "margin": margin})
    trl_grads = gradients(model, trl_loss)
    chosen, rejected = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits.chunk(2)
    loss, stats = bradley_terry_loss(chosen.squeeze(-1), rejected.squeeze(-1), margin, center_coef=0.01)
    grads = gradients(model, loss)
    assert abs(loss.item() - trl_loss.item()) <= TOLERANCE
    logged = trainer._metrics["train" if trainer.model.training else "eval"]
    assert stats["accuracy"].item() == logged["accuracy"][-1]
    assert stats["margin"].item() == pytest.approx(logged["margin"][-1], abs=TOLERANCE)
    for name, expected in trl_grads.items():
        assert torch.allclose(grads[name], expected, atol=TOLERANCE), name
    assert 0 < logged["accuracy"][-1] < 1  # a mix of right and wrong rankings


def dpo_trainer(model_dir, tmp_path, loss_type: str, beta: float, sft_weight: float = 0.0) -> DPOTrainer:
    args = DPOConfig(
        output_dir=str(tmp_path / "trl"),
        bf16=False,
        use_cpu=True,
        report_to="none",
        beta=beta,
        loss_type=[loss_type, "sft"] if sft_weight else [loss_type],
        loss_weights=[1.0, sft_weight] if sft_weight else None,
        precompute_ref_log_probs=True,  # as glm46's DPO: the reference log-probs come with the batch
        per_device_train_batch_size=PAIRS,
    )
    pairs = Dataset.from_dict({"prompt": ["t5 t6"], "chosen": ["t9"], "rejected": ["t11"]})
    trainer = DPOTrainer(
        model=Glm4MoeForCausalLM.from_pretrained(model_dir),
        args=args,
        train_dataset=pairs,
        processing_class=word_level_tokenizer(),
    )
    trainer.model.eval()
    return trainer


@pytest.mark.parametrize(
    ("loss_type", "beta", "sft_weight"), [("sigmoid", 0.1, 0.0), ("ipo", 0.5, 0.0), ("sigmoid", 0.1, 0.7)]
)
def test_dpo_loss_and_gradients_match_trl(hf_model_dir, tmp_path, loss_type, beta, sft_weight):
    """DPO, IPO, and DPO with the chosen replies' NLL (RPO; TRL's loss_type [sigmoid, sft] with loss_weights)."""
    trainer = dpo_trainer(hf_model_dir, tmp_path, loss_type, beta, sft_weight)
    model, generator = trainer.model, torch.Generator().manual_seed(1)
    inputs = pair_inputs(generator)
    reference = {"ref_chosen_logps": -20 + torch.randn(PAIRS, generator=generator) * 3}
    reference["ref_rejected_logps"] = -20 + torch.randn(PAIRS, generator=generator) * 3
    trl_loss = trainer._compute_loss(model, {**inputs, **reference}, False)
    trl_grads = gradients(model, trl_loss)
    # ours: each token's log-prob from the hidden state before it, summed over the completion tokens
    ids, mask = inputs["input_ids"], inputs["completion_mask"]
    hidden = model(input_ids=ids, attention_mask=inputs["attention_mask"], output_hidden_states=True).hidden_states[-1]
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
    logps = sequence_logprobs(token_logprobs(hidden[:, :-1], model.lm_head.weight, targets, chunk_size=8), mask[:, 1:])
    chosen_tokens, rejected_tokens = mask.sum(dim=1).chunk(2)
    loss, stats = dpo_loss(
        *logps.chunk(2), reference["ref_chosen_logps"], reference["ref_rejected_logps"], beta, loss_type,
        chosen_tokens, rejected_tokens, sft_weight,
    )  # fmt: skip
    grads = gradients(model, loss)
    assert abs(loss.item() - trl_loss.item()) <= TOLERANCE * max(1.0, abs(trl_loss.item()))
    grad_norm = torch.stack([g.norm() for g in trl_grads.values()]).norm()
    assert grad_norm > 0
    assert max((grads[name] - g).norm() for name, g in trl_grads.items()) <= TOLERANCE * grad_norm
    logged = trainer._metrics["eval"]  # the model is in eval mode
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
        assert stats[name].item() == pytest.approx(logged[name][-1], abs=1e-5), name


def test_dpo_loss_refuses_what_it_cannot_compute():
    logps = torch.zeros(2)
    with pytest.raises(ValueError, match="loss_type='hinge'"):
        dpo_loss(logps, logps, logps, logps, 0.1, "hinge")
    with pytest.raises(ValueError, match="token count"):
        dpo_loss(logps, logps, logps, logps, 0.1, "ipo")
    with pytest.raises(ValueError, match="sft_weight=0.5 needs each reply's token count"):
        dpo_loss(logps, logps, logps, logps, 0.1, "sigmoid", sft_weight=0.5)
