"""Schemas of the data side:

- `source` (`source=embedded|jsonl|chat|preference|text|parquet|hf`): what `task=prepare` reads and where it
  writes the dataset;
- `data` (`data=shards|sft|rl|stdlib` and the `embedded_*` members): the DataModule training reads.

`phase` (sequence length, mixture, token budget of a curriculum stage) and `prepare` (dedup, filters,
tokenizer) complete them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from glm46.data.quality import QualityRules
from glm46.lit import StdlibDataModule
from glm46.lit.preference_data import PreferenceDataModule
from glm46.lit.shard_data import ShardDataModule
from glm46.rl.engine import RolloutSettings
from glm46.rl.grpo_settings import GRPOSettings
from glm46.rl.ppo_module import PPOSettings
from glm46.rl.prompts import PromptDataModule
from glm46.rl.rlhf import RewardSettings

from .derive import target_schema


@dataclass
class EmbeddedOptions:
    """Sizes of the generated domains of the embedded corpus (glm46.data.embedded.read_embedded)."""

    math_problems: int = MISSING
    reasoning_problems: int = MISSING
    sft_conversations: int = MISSING
    rl_prompts: int = MISSING
    tool_prompts: int = MISSING
    copy_drills: int = 0
    sft_tool_share: float = 0.1
    preference_pairs: int = 0  # the generated preference task (glm46.data.preference_task): its pairs
    style_prompts: int = 0  # and its prompts
    seed: int = MISSING  # of the generators; the run's `seed` is another (model init, data order)


@dataclass
class SourceData:
    """A source for task=prepare: `reader` (glm46.data.prepare.READERS) over `paths`, into `output_dir`."""

    reader: str = MISSING
    paths: List[str] = MISSING
    output_dir: str = MISSING
    default_domain: str = MISSING
    # The fields of a record's text and id (source=jsonl, parquet, hf): The Stack's `content`, for example
    text_key: str = "text"
    id_key: str = "id"
    split: Optional[str] = None  # source=hf: the split read (conf/source/hf.yaml: train)
    # The digit rule a tokenizer trained on this corpus follows (prepare.tokenizer.max_digits takes it): GLM-4's 3;
    # source=embedded_tools: 1, which its copy drill needs. A property of the corpus, so that `source=jsonl` under an
    # experiment on the tools corpus keeps GLM's rule.
    max_digits: int = 3
    # The domains of edited prose a model-based filter (prepare.perplexity, prepare.quality_classifier) is fitted on
    # when its cut is set without reference_domains or a model of its own: source=embedded's [docs]
    reference_domains: List[str] = field(default_factory=list)
    options: Optional[EmbeddedOptions] = None


ShardData = target_schema(ShardDataModule, path="glm46.lit.shard_data.ShardDataModule")  # and data=sft's subclass
PreferenceData = target_schema(PreferenceDataModule, path="glm46.lit.preference_data.PreferenceDataModule")
PromptData = target_schema(PromptDataModule, path="glm46.rl.prompts.PromptDataModule")
StdlibData = target_schema(StdlibDataModule, path="glm46.lit.StdlibDataModule")


@dataclass
class Phase:
    """A stage of the curriculum: its token budget, sequence length, packing, RoPE base and mixture."""

    name: str = MISSING
    tokens: int = MISSING
    seq_len: int = MISSING
    packing: str = MISSING
    rope_theta: float = MISSING
    mixture: Dict[str, float] = MISSING
    global_batch_tokens: Optional[int] = None  # set: trainer.accumulate_grad_batches follows from it
    lr_scale: float = 1.0  # the stage's share of optim's LR (schedule.lr.scale): RL runs far below pre-training


@dataclass
class RLPhase(Phase):
    """An RL stage: its prompts, and the GRPO settings GRPOLitModule takes whole (their schema is their class)."""

    prompts: int = MISSING
    prompts_per_step: int = MISSING
    max_prompt_len: int = MISSING
    grpo: GRPOSettings = field(default_factory=GRPOSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    reward: RewardSettings = field(default_factory=RewardSettings)
    ppo: PPOSettings = field(default_factory=PPOSettings)  # read by module=ppo only


@dataclass
class TokenizerSettings:
    path: Optional[str] = None  # an existing tokenizer.json to use as is; None: train one
    vocab_size: int = MISSING
    max_digits: int = 3  # of a number in one token: 3 as GLM-4's pre-tokenizer, 1 splits numbers into digits


@dataclass
class DedupSettings:
    exact: bool = MISSING
    url: bool = MISSING
    near: bool = MISSING
    threshold: float = MISSING
    num_perm: int = MISSING
    shingle_size: int = MISSING
    seed: int = MISSING  # of the MinHash permutations


QualitySettings = target_schema(QualityRules, path="glm46.data.quality.QualityRules")


@dataclass
class PerplexitySettings:
    reference_domains: List[str] = field(default_factory=list)
    model: Optional[str] = None
    order: int = MISSING
    domains: List[str] = MISSING
    max: Optional[float] = None
    buckets: List[float] = MISSING
    bucket_sample: int = MISSING


@dataclass
class QualityClassifierSettings:
    reference_domains: List[str] = field(default_factory=list)
    model: Optional[str] = None
    domains: List[str] = MISSING
    min_score: Optional[float] = None
    keep_fraction: Optional[float] = None
    threshold_sample: int = MISSING
    max_documents: int = MISSING
    folds: int = MISSING
    seed: int = MISSING
    hyperparameters: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ToxicitySettings:
    max: Optional[float] = None
    domains: List[str] = MISSING


@dataclass
class SemanticDedupSettings:
    threshold: Optional[float] = None
    domains: List[str] = MISSING
    clusters: int = MISSING
    fit_sample: int = MISSING
    max_tokens: int = MISSING
    seed: int = MISSING


@dataclass
class PrepareEstimate:
    corpus_tokens: Optional[float] = None
    bytes_per_token: float = MISSING
    tokens_per_document: float = MISSING
    task_seconds_per_token: float = MISSING
    clusters_seconds_per_document: float = MISSING
    filter_seconds_per_document: Dict[str, float] = field(default_factory=dict)


@dataclass
class PrepareConfig:
    """Settings of task=prepare (conf/prepare/default.yaml)."""

    num_workers: int = MISSING
    tasks: int = MISSING
    keep_excluded: bool = MISSING
    dry: bool = MISSING
    estimate: PrepareEstimate = field(default_factory=PrepareEstimate)
    tokenizer: TokenizerSettings = field(default_factory=TokenizerSettings)
    dedup: DedupSettings = field(default_factory=DedupSettings)
    quality: QualitySettings = field(default_factory=QualitySettings)
    perplexity: PerplexitySettings = field(default_factory=PerplexitySettings)
    quality_classifier: QualityClassifierSettings = field(default_factory=QualityClassifierSettings)
    toxicity: ToxicitySettings = field(default_factory=ToxicitySettings)
    semantic_dedup: SemanticDedupSettings = field(default_factory=SemanticDedupSettings)
