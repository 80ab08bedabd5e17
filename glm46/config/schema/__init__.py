"""Structured-config schemas of every config group, registered in Hydra's ConfigStore before composing.

`conf/config.yaml` starts from `run_schema` (RunConfig); members of groups with several shapes start from
theirs (`defaults: [schema]`, e.g. conf/model/*.yaml from GLM46Config). A misspelt or misplaced key, or a
value of the wrong type, then fails while composing, naming its full key.
"""

from hydra.core.config_store import ConfigStore

from glm46.config.resolvers import register_resolvers
from glm46.modules import GLM46Config
from glm46.rl.engine import RolloutSettings

from .data import Phase, PreferenceData, PromptData, RLPhase, ShardData, SourceData, StdlibData
from .launch import DeepSpeedParallelism, ParallelismConfig
from .root import RunConfig, Task
from .training import (
    CALLBACKS,
    LOGGERS,
    AdamWOptim,
    CausalLMModule,
    DPOModule,
    GRPOModule,
    MuonOptim,
    PPOModule,
    RewardModelModule,
    WarmupCosineSchema,
    WarmupStableDecaySchema,
)

__all__ = ["RunConfig", "Task", "register_configs"]

GROUP_SCHEMAS = {
    "model": {"schema": GLM46Config},
    "module": {
        "causal_lm_schema": CausalLMModule,
        "grpo_schema": GRPOModule,
        "reward_model_schema": RewardModelModule,
        "dpo_schema": DPOModule,
        "ppo_schema": PPOModule,
    },
    "optim": {"muon_schema": MuonOptim, "adamw_schema": AdamWOptim},
    "schedule/schema": {"warmup_cosine": WarmupCosineSchema, "warmup_stable_decay": WarmupStableDecaySchema},
    "data": {
        "shards_schema": ShardData,
        "prompts_schema": PromptData,
        "preference_schema": PreferenceData,
        "stdlib_schema": StdlibData,
    },
    "source": {"schema": SourceData},
    "phase": {"schema": Phase, "rl_schema": RLPhase},
    "phase/rollout": {"rollout_schema": RolloutSettings},
    "parallelism": {"schema": ParallelismConfig, "deepspeed_schema": DeepSpeedParallelism},
    "callbacks/schema": CALLBACKS,
    "logger/schema": LOGGERS,
}


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    for group, schemas in GROUP_SCHEMAS.items():
        for name, node in schemas.items():
            store.store(group=group, name=name, node=node)
    register_resolvers()
