"""RLHF: an RL stage's reward mixes the verifier's with a reward model's normalised score of each rollout row (read at
the row's last token, padding ignored), logs both parts, and refuses a reward model in another tokenizer, naming
both, at composition."""

import pytest
import torch

from glm46.checkpoint import save_hf
from glm46.config.checks import validate
from glm46.data.tokenizer import GLMTokenizer
from glm46.errors import ConfigError
from glm46.rl.reward_export import load_reward_model, save_reward_head
from glm46.rl.rlhf import MixedReward, RewardSettings, row_lengths

from .helpers import random_model, tiny_config
from .test_grpo import dataset, fit, module, prompts, rewards_logged

__all__ = ["dataset"]  # the fixture: test_grpo's prepared chat data (vocabulary 400)

VOCAB = 400


def reward_model_export(path, tokenizer: GLMTokenizer, mean: float = 0.5, std: float = 2.0):
    """A random tiny reward model's export in `tokenizer`."""
    model = random_model(tiny_config(vocab_size=VOCAB), seed=3)
    save_hf(model, path, tokenizer=tokenizer)
    head = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    save_reward_head(path, head, mean, std)
    return path


@pytest.fixture(scope="module")
def reward_model(dataset, tmp_path_factory):
    return reward_model_export(tmp_path_factory.mktemp("rm"), GLMTokenizer.from_file(dataset / "tokenizer.json"))


def test_the_reward_mixes_the_verifier_with_the_normalised_score_at_each_rows_end(dataset, reward_model):
    policy = module(dataset, max_new_tokens=6)
    data = prompts(dataset, batch_size=3)
    data.setup()
    batch = next(iter(data.train_dataloader()))
    prompt_lengths, completions, lengths = policy.worker.sample(batch, 2, 1.0, torch.Generator().manual_seed(0))
    input_ids, _, mask = policy.worker.layout(batch, prompt_lengths, completions, lengths)
    rows = row_lengths(mask)
    assert torch.equal(rows, prompt_lengths + lengths) and len(set(rows.tolist())) > 1
    settings = RewardSettings(model=str(reward_model), verifier_weight=1.0, model_weight=0.5)
    mixed = MixedReward(settings, dataset / "tokenizer.json", torch.device("cpu"))
    verified = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    total, parts = mixed(verified, input_ids, rows)
    rm = load_reward_model(reward_model)
    for i, n in enumerate(rows.tolist()):  # each row alone, unpadded: its last token's hidden state times the head
        hidden = rm.model.hidden_states(input_ids[i : i + 1, :n], torch.arange(n)[None])[0, -1]
        expected = verified[i] + 0.5 * ((hidden @ rm.head[0]) - 0.5) / 2.0
        assert total[i].item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-5)
    assert parts["verifier_reward"] == pytest.approx(0.5) and "rm_reward" in parts


@pytest.mark.slow
def test_rl_with_a_reward_model_logs_both_parts(dataset, reward_model, tmp_path):
    policy = module(dataset)
    policy.reward_mix = RewardSettings(model=str(reward_model), model_weight=0.5)
    policy.mixed_reward = MixedReward(policy.reward_mix, dataset / "tokenizer.json", torch.device("cpu"))
    fit(policy, dataset, tmp_path, max_steps=3)
    verifier, rm = rewards_logged(tmp_path, "rl/verifier_reward"), rewards_logged(tmp_path, "rl/rm_reward")
    total = rewards_logged(tmp_path)
    assert len(verifier) == len(rm) == len(total) >= 2
    for v, r, t in zip(verifier, rm, total):
        assert t == pytest.approx(v + 0.5 * r, abs=1e-5)


def test_a_reward_model_in_another_tokenizer_is_refused_naming_both(compose_config, dataset, tmp_path):
    from glm46.data.tokenizer import train_tokenizer

    other = GLMTokenizer(train_tokenizer(["some other text", "for another vocabulary"] * 50, vocab_size=300))
    stranger = reward_model_export(tmp_path / "rm", other)
    cfg = compose_config("experiment=toy_recipe", f"data.path={dataset}", f"phase.reward.model={stranger}")
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    message = str(error.value)
    assert f"phase.reward.model and data.path have different tokenizers ({stranger}/tokenizer.json and {dataset}" in (
        message
    )
    language_model = save_hf(random_model(tiny_config(vocab_size=VOCAB)), tmp_path / "lm")  # no reward head
    with pytest.raises(ConfigError, match="lm holds no reward model \\(reward_model.json is missing\\)"):
        validate(
            compose_config("experiment=toy_recipe", f"data.path={dataset}", f"phase.reward.model={language_model}")
        )
    with pytest.raises(ConfigError, match="phase.reward.verifier_weight=0 and no phase.reward.model"):
        validate(compose_config("experiment=toy_recipe", f"data.path={dataset}", "phase.reward.verifier_weight=0"))
