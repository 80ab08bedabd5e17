"""The bad-configuration catalogue: compositions that cannot run, each refused before any training or Slurm
submission, with a message naming the offending key and the values.

Each row is (id, base, bad, stage, patterns): `base + bad` is the command line; `stage` says where it is
refused: "compose" (Hydra's composition: hydra.errors.ConfigCompositionException, the message and its cause
checked) or "validate" (composition succeeds, glm46.app.tasks.validate raises ConfigError). Every pattern is a
regex that must occur in the message; together they name the key and the bad value(s). A second test
validates each `base` alone, so every refusal is the `bad` overrides' doing.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from glm46.config.checks import validate
from glm46.errors import ConfigError
from glm46.modules import cuda_kernels

from . import forked
from .unsafe_pickles import unsafe_checkpoint, unsafe_dcp_folder

REPO = Path(__file__).resolve().parents[1]

TINY = ["experiment=tiny_bytes"]  # the tiny model on the standard library's bytes: no dataset needed
TOY = ["experiment=toy_stage"]  # one toy curriculum stage on prepared shards (not read at validation)
EXTRA = ["hydra.searchpath=[file://{extra}]"]  # conf/ plus the files of the `extra` fixture
PHASE1 = ["experiment=pretrain_phase1", "cluster=h800_1024n", "data.path=/data"]  # the 355B phase-1 job, 1024 x 8 H800
TP4 = [*TINY, "parallelism=tp", "cluster.devices=4"]  # tensor parallel 2 x data parallel 2
TP16 = [*TINY, "parallelism=tp", "cluster.devices=16"]
EP6 = [*TINY, "parallelism=ep", "cluster.devices=6"]  # expert parallel 2 over 6 ranks
DATASET = [*TOY, "data.path={dataset}"]  # a prepared dataset with the toy_pretrain1 domains only
SFT = [*TOY, "phase=toy_sft", "data=embedded_sft", "data.path={dataset}"]  # the default run's SFT stage
RL = [*TOY, "phase=toy_rl", "data=embedded_rl", "module=grpo", "data.path={dataset}"]  # the default run's GRPO stage
COMPOSE, VALIDATE = "compose", "validate"

# One row per line reads as a table:
# fmt: off
TABLE = [
    # -- unknown group members, misspelt keys and wrong types: Hydra refuses while composing
    ("unknown-model", [], ["model=nope"], COMPOSE, [r"Could not find 'model/nope'", r"glm46_355b"]),
    ("unknown-cluster", [], ["cluster=nope"], COMPOSE, [r"Could not find 'cluster/nope'", r"h800_1024n"]),
    ("unknown-experiment", [], ["experiment=nope"], COMPOSE, [r"Could not find 'experiment/nope'", r"pretrain_phase1"]),
    ("unknown-optim", [], ["optim=nope"], COMPOSE, [r"Could not find 'optim/nope'", r"adamw"]),
    ("unknown-parallelism", [], ["parallelism=nope"], COMPOSE, [r"Could not find 'parallelism/nope'", r"fsdp2_ep"]),
    ("misspelt-model-key", [], ["model.hiden_size=3"], COMPOSE,
     [r"Key 'hiden_size' not in 'GLM46Config'", r"model\.hiden_size=3"]),
    ("misspelt-trainer-key", [], ["trainer.max_step=3"], COMPOSE,
     [r"Key 'max_step' not in 'TrainerConfig'", r"trainer\.max_step=3"]),
    ("misspelt-callback-key", [], ["callbacks.model_checkpoint.every_n_steps=3"], COMPOSE,
     [r"Key 'every_n_steps' not in 'ModelCheckpointCallback'", r"callbacks\.model_checkpoint\.every_n_steps=3"]),
    ("misplaced-key-in-an-experiment-file", EXTRA, ["experiment=misplaced"], COMPOSE,
     [r"In 'experiment/misplaced'", r"Key 'val_check_interval' not in 'ScheduleConfig'",
      r"full_key: schedule\.val_check_interval"]),
    ("unknown-top-level-key-in-an-experiment-file", EXTRA, ["experiment=unknown_top_level"], COMPOSE,
     [r"Key 'schedul' not in 'RunConfig'", r"full_key: schedul"]),
    ("mixture-domain-not-in-phase", TOY, ["phase.mixture.web=0.5"], COMPOSE,
     [r"Could not override 'phase\.mixture\.web'", r"\+phase\.mixture\.web=0\.5"]),
    ("model-int-is-text", [], ["model.num_hidden_layers=abc"], COMPOSE,
     [r"Value 'abc' of type 'str' could not be converted to Integer", r"full_key: model\.num_hidden_layers"]),
    ("model-bool-is-text", [], ["model.use_qk_norm=maybe"], COMPOSE,
     [r"Value 'maybe' is not a valid bool", r"full_key: model\.use_qk_norm"]),
    ("trainer-int-is-text", [], ["trainer.max_steps=many"], COMPOSE,
     [r"Value 'many' of type 'str' could not be converted to Integer", r"full_key: trainer\.max_steps"]),
    ("cluster-float-is-text", [], ["cluster.mfu=high"], COMPOSE,
     [r"Value 'high' of type 'str' could not be converted to Float", r"full_key: cluster\.mfu"]),
    # -- the task, missing values and the data's sizes
    ("unknown-task", [], ["task=nope"], COMPOSE,
     [r"Invalid value 'nope', expected one of \[train, prepare, estimate, plan, dryrun, eval, serve, export, score, "
      r"sample\]",
      r"full_key: task"]),
    ("serve-without-a-model", [], ["task=serve"], VALIDATE,
     [r"^serve\.model: no model to serve; set serve\.model=<a run directory or an HF directory>$"]),
    ("serve-a-folder-without-weights", [], ["task=serve", "serve.model=/nonexistent"], VALIDATE,
     [r"^serve\.model=/nonexistent: /nonexistent holds no model: neither config\.json"]),
    ("unknown-serving-engine", [], ["task=serve", "serve.engine=tgi"], COMPOSE,
     [r"Invalid value 'tgi', expected one of \[vllm, sglang\]", r"full_key: serve\.engine"]),
    ("mandatory-value-missing", PHASE1, ["data.path=???"], VALIDATE,
     [r"^data\.path: no value \(\?\?\?\) for task=train; set data\.path=\.\.\.$"]),
    ("prepare-without-source", TINY, ["task=prepare"], VALIDATE,
     [r"^task=prepare reads `source`, and none is chosen: source=embedded\|jsonl\|chat\|text\|parquet"]),
    ("mandatory-values-missing-for-prepare", [], ["task=prepare", "source=jsonl"], VALIDATE,
     [r"^source\.output_dir, source\.paths: no value \(\?\?\?\) for task=prepare"]),
    ("async-checkpoint-without-dcp", TINY,
     ["parallelism=ddp", "cluster.devices=2", "parallelism.async_checkpoint=true"], VALIDATE,
     [r"^parallelism\.async_checkpoint=true with parallelism=ddp: background saves write DCP folders"]),
    ("negative-restarts", TINY, ["cluster.max_restarts=-1"], VALIDATE,
     [r"^cluster\.max_restarts=-1 must be >= 0 \(0: a failed job waits for a person\)$"]),
    ("watchdog-factor-below-1", TINY, ["callbacks.watchdog.factor=0.5"], VALIDATE,
     [r"^callbacks\.watchdog: factor=0\.5 must be >= 1, min_seconds=300\.0 and first_step_seconds=1800\.0 > 0$"]),
    ("prometheus-port-out-of-range", TINY, ["monitoring.prometheus_port=70000"], VALIDATE,
     [r"^monitoring\.prometheus_port=70000: a TCP port is 1-65535 \(0: no exporter\)$"]),
    ("prometheus-port-is-text", TINY, ["monitoring.prometheus_port=http"], COMPOSE,
     [r"Value 'http' of type 'str' could not be converted to Integer", r"full_key: monitoring\.prometheus_port"]),
    ("prepare-tasks-zero", [], ["task=prepare", "source=embedded", "prepare.tasks=0"], VALIDATE,
     [r"^prepare\.tasks=0: the number of tasks of each stage is at least 1$"]),
    ("prepare-digits-zero", [], ["task=prepare", "source=embedded", "prepare.tokenizer.max_digits=0"], VALIDATE,
     [r"^prepare\.tokenizer\.max_digits=0: a token holds at least one digit$"]),
    ("perplexity-model-missing", [], ["task=prepare", "source=embedded", "prepare.perplexity.model=/nonexistent.arpa"],
     VALIDATE, [r"^prepare\.perplexity\.model=/nonexistent\.arpa: cannot be read as an ARPA model \(.*No such file"]),
    ("perplexity-buckets-reversed", [],
     ["task=prepare", "source=embedded", "prepare.perplexity.reference_domains=[docs]",
      "prepare.perplexity.buckets=[0.7,0.3]"],
     VALIDATE, [r"^prepare\.perplexity\.buckets=\[0\.7, 0\.3\]: two quantiles 0 < a < b < 1"]),
    ("perplexity-max-without-a-model", [],
     ["task=prepare", "source=embedded", "source.reference_domains=[]", "prepare.perplexity.max=3000"],
     VALIDATE, [r"^prepare\.perplexity\.max=3000\.0: no model to score with; set prepare\.perplexity\.reference_"]),
    ("quality-classifier-cut-without-a-model", [],
     ["task=prepare", "source=embedded", "source.reference_domains=[]", "prepare.quality_classifier.keep_fraction=0.1"],
     VALIDATE,
     [r"^prepare\.quality_classifier\.keep_fraction=0\.1: no model to score with; .*quality_classifier\.model="]),
    ("toxicity-max-above-one", [], ["task=prepare", "source=embedded", "prepare.toxicity.max=1.5"], VALIDATE,
     [r"^prepare\.toxicity\.max=1\.5: a probability from 0 to below 1 \(or null: no filter\)$"]),
    ("activation-checkpointing-mode-unknown", [], ["parallelism=fsdp2", "parallelism.activation_checkpointing=true",
                                                    "parallelism.activation_checkpointing_mode=partial"], VALIDATE,
     [r"parallelism\.activation_checkpointing_mode=partial: one of full, selective"]),
    ("quality-classifier-model-not-fasttext", [],
     ["task=prepare", "source=embedded", "prepare.quality_classifier.model={dataset}/tokens/shards.json"], VALIDATE,
     [r"^prepare\.quality_classifier\.model=.*shards\.json: cannot be read as a fastText model \(not a fastText"]),
    ("quality-classifier-unknown-hyperparameter", [],
     ["task=prepare", "source=embedded", "prepare.quality_classifier.reference_domains=[docs]",
      "+prepare.quality_classifier.hyperparameters.learning_rate=0.5"], VALIDATE,
     [r"^prepare\.quality_classifier\.hyperparameters: \['learning_rate'\] are not fastText's"]),
    ("semantic-dedup-threshold-above-one", [],
     ["task=prepare", "source=embedded", "prepare.semantic_dedup.threshold=1.5"], VALIDATE,
     [r"^prepare\.semantic_dedup\.threshold=1\.5: a cosine similarity above 0, at most 1$"]),
    ("embedded-tool-share-above-one", [], ["task=prepare", "source=embedded", "source.options.sft_tool_share=1.5"],
     VALIDATE, [r"^source\.options\.sft_tool_share=1\.5: a share of the sft conversations, from 0 to 1$"]),
    ("prepare-glob-matching-nothing", [], ["task=prepare", "source=jsonl", "source.paths=['/nonexistent/*.jsonl']",
                                           "source.output_dir={dataset}/out", "prepare.tasks=2"], VALIDATE,
     [r"^source\.paths: /nonexistent/\*\.jsonl matches nothing$"]),
    ("prepare-more-tasks-than-input-files", [], ["task=prepare", "source=jsonl", "source.paths=[{dataset}/tokens]",
                                                 "source.output_dir={dataset}/out", "prepare.tasks=3"], VALIDATE,
     [r"^prepare\.tasks=3: source\.paths holds 1 input file\(s\), and each read task takes whole files"]),
    ("batch-size-fraction", TINY, ["data.batch_size=1.5"], COMPOSE,
     [r"Value '1\.5' of type 'float' could not be converted to Integer", r"full_key: data\.batch_size"]),
    ("batch-size-zero", TINY, ["data.batch_size=0"], VALIDATE, [r"data\.batch_size=0 must be an integer >= 1"]),
    ("seq-len-text", TINY, ["data.seq_len=abc"], COMPOSE,
     [r"Value 'abc' of type 'str' could not be converted to Integer", r"full_key: data\.seq_len"]),
    ("seq-len-beyond-context", TINY, ["data.seq_len=4096"], VALIDATE,
     [r"data\.seq_len=4096 exceeds model\.max_position_embeddings=2048"]),
    # -- inconsistent model shapes (GLM46Config.validate)
    ("kv-heads-not-dividing-heads", [], ["model.num_key_value_heads=3"], VALIDATE,
     [r"^model: invalid model config: ", r"num_attention_heads=8 must be divisible by num_key_value_heads=3"]),
    ("top-k-above-experts", [], ["model.num_experts_per_tok=17"], VALIDATE,
     [r"num_experts_per_tok=17 must be <= n_routed_experts=16"]),
    ("dense-layers-above-layers", [], ["model.first_k_dense_replace=5"], VALIDATE,
     [r"first_k_dense_replace=5 must be <= num_hidden_layers=4"]),
    ("rotary-factor-above-1", [], ["model.partial_rotary_factor=1.5"], VALIDATE,
     [r"partial_rotary_factor=1\.5 must be in \(0, 1\]"]),
    ("rotary-dim-odd", [], ["model.head_dim=30", "model.partial_rotary_factor=0.1"], VALIDATE,
     [r"rotary dim = int\(head_dim=30 \* partial_rotary_factor=0\.1\) = 3 must be even"]),
    ("topk-group-above-groups", [], ["model.n_group=2", "model.topk_group=3"], VALIDATE,
     [r"topk_group=3 must be <= n_group=2"]),
    ("experts-not-dividing-groups", [], ["model.n_group=3"], VALIDATE,
     [r"n_routed_experts=16 must be divisible by n_group=3"]),
    ("hidden-size-zero", [], ["model.hidden_size=0"], VALIDATE, [r"hidden_size=0 must be >= 1"]),
    ("vocab-negative", [], ["model.vocab_size=-5"], VALIDATE, [r"vocab_size=-5 must be >= 1"]),
    # -- the cluster and the parallel layout (Layout.from_config, glm46.config.layout_checks.check_layout)
    ("devices-zero", TINY, ["cluster.devices=0"], VALIDATE, [r"cluster\.devices=0 must be an integer >= 1"]),
    ("nodes-negative", TINY, ["cluster.num_nodes=-1"], VALIDATE, [r"cluster\.num_nodes=-1 must be an integer >= 1"]),
    ("single-on-two-devices", TINY, ["cluster.devices=2"], VALIDATE,
     [r"parallelism=single runs one process, but the cluster has world size 2 "
      r"\(cluster\.num_nodes x cluster\.devices\)"]),
    ("world-not-dividing-tp", TP4, ["cluster.devices=3"], VALIDATE,
     [r"world size 3 \(cluster\.num_nodes x cluster\.devices\) must be divisible by parallelism\.tensor_parallel=2"]),
    ("tp-not-dividing-kv-heads", TP4, ["parallelism.tensor_parallel=4"], VALIDATE,
     [r"model\.num_key_value_heads=2 must be divisible by parallelism\.tensor_parallel=4"]),
    ("tp-not-dividing-heads", TP16, ["parallelism.tensor_parallel=16"], VALIDATE,
     [r"model\.num_attention_heads=8 must be divisible by parallelism\.tensor_parallel=16"]),
    ("ep-not-dividing-experts", EP6, ["parallelism.expert_parallel=3"], VALIDATE,
     [r"model\.n_routed_experts=16 must be divisible by parallelism\.expert_parallel=3"]),
    ("world-not-dividing-tp-x-ep", EP6, ["parallelism.expert_parallel=4"], VALIDATE,
     [r"world size 6 must be divisible by tensor_parallel x expert_parallel = 1 x 4 = 4"]),
    ("timeout-zero", [*TINY, "parallelism=ddp", "cluster.devices=2"], ["parallelism.timeout_s=0"], VALIDATE,
     [r"parallelism\.timeout_s=0 must be a number of seconds > 0"]),
    ("pipeline-parallel-single", TINY, ["parallelism.pipeline_parallel=2"], VALIDATE,
     [r"parallelism\.pipeline_parallel=2 needs engine=mesh .*: engine=single cannot split the layers into stages"]),
    ("pipeline-under-deepspeed", [*TINY, "parallelism=deepspeed_zero3", "optim=adamw", "cluster.devices=2"],
     ["parallelism.pipeline_parallel=2"], VALIDATE, [r"pipeline_parallel=2 needs engine=mesh .*engine=deepspeed"]),
    ("pipeline-batch-not-splitting", [*TINY, "parallelism=pp", "cluster.devices=2"],
     ["data.batch_size=3"], VALIDATE, [r"data\.batch_size=3 must be a multiple of parallelism\.microbatches=2"]),
    ("sequence-parallel-without-tp", TINY, ["parallelism.sequence_parallel=true"], VALIDATE,
     [r"parallelism\.sequence_parallel=true splits the sequence over the tensor-parallel ranks: it needs "
      r"engine=mesh with tensor_parallel > 1 \(here 1\)"]),
    ("sequence-not-splitting", [*TINY, "parallelism=tp", "cluster.devices=2", "parallelism.sequence_parallel=true"],
     ["data.seq_len=63"], VALIDATE, [r"data\.seq_len=63 must be divisible by parallelism\.tensor_parallel=2"]),
    ("context-parallel-under-ddp", [*TINY, "parallelism=ddp", "cluster.devices=2"], ["parallelism.context_parallel=2"],
     VALIDATE, [r"parallelism\.context_parallel=2 splits the sequence over ranks of the device mesh: it needs "
                r"engine=mesh \(fsdp2, tp, ep, \.\.\.\), not ddp"]),
    ("context-parallel-with-stages", [*TINY, "parallelism=pp", "cluster.devices=4"], ["parallelism.context_parallel=2"],
     VALIDATE, [r"parallelism\.context_parallel=2 with pipeline_parallel=2: the pipeline stages send whole sequences"]),
    ("context-not-balancing", [*TINY, "parallelism=fsdp2", "cluster.devices=2", "parallelism.context_parallel=2"],
     ["data.seq_len=66"], VALIDATE, [r"data\.seq_len=66 must be divisible by 2 x parallelism\.context_parallel = 4"]),
    ("context-parallel-world", [*TINY, "parallelism=fsdp2", "cluster.devices=3"], ["parallelism.context_parallel=2"],
     VALIDATE, [r"world size 3 .* must be divisible by tensor_parallel x context_parallel = 1 x 2"]),
    ("muon-under-deepspeed", [*TINY, "parallelism=deepspeed_zero3", "optim=adamw"], ["optim=muon"], VALIDATE,
     [r"optim\.optimizer=glm46\.optim\.Muon with parallelism\.engine=deepspeed"]),
    ("slurm-without-partition", ["cluster=local_slurm"], ["cluster.partition=null"], VALIDATE,
     [r"cluster=local_slurm submits to Slurm but cluster\.partition is not set"]),
    ("355b-does-not-fit-fsdp2", PHASE1, ["parallelism=fsdp2"], VALIDATE,
     [r"cluster=h800_1024n, parallelism=fsdp2: does not fit: [\d.]+ GiB per GPU > 90% of 80 GiB"]),
    # -- the phase's token budget and global batch
    ("budget-zero", TOY, ["phase.tokens=0"], VALIDATE,
     [r"phase\.tokens=0 is less than one global batch of 2048 tokens \(trainer\.max_steps=0\)"]),
    ("budget-below-global-batch", PHASE1, ["phase.tokens=1000000"], VALIDATE,
     [r"phase\.tokens=1000000 is less than one global batch of 67108864 tokens"]),
    ("global-batch-not-divisible", PHASE1, ["data.batch_size=48"], VALIDATE,  # 3 rows per pipeline microbatch
     [r"phase\.global_batch_tokens=67108864 is not divisible by data\.batch_size x data\.seq_len x data-parallel "
      r"ranks .* = 48 x 4096 x 64 = 12582912"]),
    # -- packing and mixture
    ("unknown-packing", TOY, ["phase.packing=zigzag"], VALIDATE,
     [r"data\.packing='zigzag' \(phase\.packing\) is not one of \['truncate', 'best_fit', 'pad'\]"]),
    ("sft-truncates", SFT, ["phase.packing=truncate"], VALIDATE,
     [r"data\.packing='truncate' with SFT data \(data=sft, embedded_sft\) would cut conversations"]),
    ("mixture-weight-negative", TOY, ["phase.mixture.code=-1"], VALIDATE,
     [r"data\.mixture\.code=-1\.0 \(phase\.mixture\) must be a number >= 0"]),
    ("mixture-all-zero", TOY, ["phase.mixture={code: 0, docs: 0, license: 0, math: 0, reasoning: 0}"], VALIDATE,
     [r"data\.mixture=\{'code': 0\.0, .*'reasoning': 0\.0\} \(phase\.mixture\) gives no domain a positive weight"]),
    ("mixture-domain-not-in-dataset", DATASET, ["phase=toy_midtrain"], VALIDATE,
     [r"names domains \['repo_code'\] that data\.path=\S+ does not have \(it has \['code', 'docs', 'license', "
      r"'math', 'reasoning', 'rl', 'sft'\]\)"]),
    # -- trainer and optimizer
    ("max-steps-zero", TINY, ["trainer.max_steps=0"], VALIDATE, [r"trainer\.max_steps=0 must be an integer >= 1"]),
    ("accumulation-zero", TINY, ["trainer.accumulate_grad_batches=0"], VALIDATE,
     [r"trainer\.accumulate_grad_batches=0 must be an integer >= 1"]),
    ("fsdp2-policy-contradicts-precision", [*TINY, "parallelism=fsdp2"],
     ["parallelism.mixed_precision={param_dtype: bfloat16}"], VALIDATE,
     [r"parallelism\.mixed_precision\.param_dtype=bfloat16 contradicts trainer\.precision=32-true"]),
    ("precision-unknown", TINY, ["trainer.precision=fp8"], VALIDATE,
     [r"trainer\.precision='fp8' is not one of Lightning's \['64-true', '32-true'.*'bf16-mixed'"]),
    ("optimizer-not-importable", TINY, ["optim.optimizer._target_=glm46.optim.Nope"], VALIDATE,
     [r"optim\.optimizer\._target_='glm46\.optim\.Nope' cannot be imported"]),
    ("lr-negative", TINY, ["optim.lr=-1"], VALIDATE, [r"optim\.lr=-1\.0 must be a number > 0"]),
    ("lr-negative-inner", TINY, ["optim.optimizer.lr=-1"], VALIDATE, [r"optim\.lr=-1\.0 must be a number > 0"]),
    ("lr-floor-above-peak", TINY, ["schedule.lr.min_factor=1.5"], VALIDATE,
     [r"schedule\.lr\.min_factor=1\.5 must be in \[0, 1\]: the floor as a share of the peak"]),
    ("ns-dtype-unknown", TINY, ["optim.optimizer.ns_dtype=float8"], VALIDATE,
     [r"optim\.optimizer\.ns_dtype='float8' \(Muon's Newton-Schulz\) is not one of \['bfloat16'"]),
    ("ns-steps-zero", TINY, ["optim.optimizer.ns_steps=0"], VALIDATE,
     [r"optim\.optimizer\.ns_steps=0 must be an integer >= 1"]),
    ("guard-action-unknown", TINY, ["guard.on_repeated=retry"], VALIDATE,
     [r"guard\.on_repeated='retry': expected 'rollback' or 'stop'"]),
    ("guard-spike-factor-below-1", TINY, ["guard.spike_factor=0.5"], VALIDATE, [r"spike_factor=0\.5 must be > 1"]),
    # -- RL: prompts, an RL phase and the GRPO module together, on data-parallel layouts, whole groups per update
    ("rl-phase-on-language-modelling-data", DATASET, ["phase=toy_rl", "module=grpo"], VALIDATE,
     [r"data=glm46\.lit\.shard_data\.ShardDataModule, phase=toy_rl, module=glm46\.rl\.grpo_module\.GRPOLitModule: "
      r"RL needs the prompts", r"phase=rl, toy_rl\) and module=grpo together"]),
    ("rl-phase-without-the-grpo-module", RL, ["module=causal_lm"], VALIDATE,
     [r"module=glm46\.lit\.GLM46LitModule: RL needs the prompts .* and module=grpo together \(experiment=rl\)"]),
    ("rl-split-within-a-layer", RL, ["parallelism=tp", "cluster.devices=2"], VALIDATE,
     [r"parallelism=tp \(parallelism\.tensor_parallel=2\): RL rolls out with the training model's own generate",
      r"\(single, ddp\) or sharded by FSDP2 or expert parallelism \(fsdp2, ep, fsdp2_ep\)"]),
    ("rl-evaluated-on-prompts-it-trains-on", RL, ["eval.after_train=true", "eval.domain_val_fraction.rl=0.02"],
     VALIDATE,
     [r"eval\.domain_val_fraction\.rl=0\.02 differs from data\.val_fraction=0\.1: the evaluation after training would "
      r"read prompts RL trained on"]),
    ("rl-evaluated-on-other-prompts-it-trains-on", RL, ["eval.after_train=true", "+phase.mixture.sft=0.25",
     "eval.val_fraction=0.2"], VALIDATE,
     [r"eval\.domain_val_fraction\.sft=0\.2 is more than data\.val_fraction=0\.1: the evaluation after training "
      r"would read sft prompts RL trained on"]),
    ("rl-with-accumulation", RL, ["trainer.accumulate_grad_batches=2"], VALIDATE,
     [r"trainer\.accumulate_grad_batches=2: an RL step is one rollout batch"]),
    ("rl-updates-split-a-group", RL, ["phase.grpo.updates_per_rollout=3"], VALIDATE,
     [r"phase\.grpo\.updates_per_rollout=3 must divide the prompts of a step \(data\.batch_size=8\)"]),
    ("rl-unknown-loss-aggregation", RL, ["phase.grpo.loss_aggregation=sum"], VALIDATE,
     [r"phase\.grpo\.loss_aggregation='sum': expected token_mean or seq_mean"]),
    ("rl-turn-of-no-tokens", RL, ["phase.grpo.max_turn_tokens=0"], VALIDATE,
     [r"phase\.grpo\.max_turn_tokens=0 must be >= 1 \(or null\)"]),
    ("rl-kl-without-a-start", RL, ["phase.grpo.kl_coef=0.1"], VALIDATE,
     [r"phase\.grpo\.kl_coef=0\.1: the KL is against the starting policy, and no init_from names it"]),
    ("rl-no-draw-per-update", RL, ["phase.grpo.dynamic_sampling=true", "phase.grpo.max_draws=0"], VALIDATE,
     [r"phase\.grpo\.max_draws=0 must be >= 1 \(rollout batches per update\)"]),
    ("ppo-dynamic-sampling", RL, ["module=ppo", "phase.grpo.dynamic_sampling=true"], VALIDATE,
     [r"phase\.grpo\.dynamic_sampling=true with module=ppo: PPO's advantages come from its critic's values"]),
    ("ppo-two-kl-penalties", RL, ["module=ppo", "phase.grpo.kl_coef=0.05", "phase.ppo.kl_coef=0.05"], VALIDATE,
     [r"phase\.grpo\.kl_coef=0\.05 with module=ppo: PPO's KL is its penalty in the token rewards"]),
    ("ppo-adaptive-kl-from-zero", RL, ["module=ppo", "phase.ppo.kl_target=0.01"], VALIDATE,
     [r"phase\.ppo\.kl_target=0\.01: an adaptive KL needs kl_target > 0, kl_horizon > 0 \(got 10000\) and a "
      r"starting kl_coef > 0 \(got 0\.0\)"]),
    ("rl-dual-clip-below-one", RL, ["phase.grpo.eps_clip_c=0.5"], VALIDATE,
     [r"phase\.grpo\.eps_clip_c=0\.5 must be > 1 \(dual clip\), or null"]),
    ("rl-a-group-of-one", RL, ["phase.grpo.samples_per_prompt=1"], VALIDATE,
     [r"phase\.grpo\.samples_per_prompt=1 leaves no group to normalise over"]),
    # -- RL rollouts from an inference engine (phase.rollout)
    ("rl-unknown-rollout-engine", RL, ["phase.rollout.engine=sglang"], VALIDATE,
     [r"phase\.rollout\.engine='sglang': expected local or vllm"]),
    ("rl-engine-tp-splits-a-head", RL, ["phase/rollout=vllm", "phase.rollout.tensor_parallel_size=3",
                                       "cluster.devices=4", "parallelism=ddp"], VALIDATE,
     [r"phase\.rollout\.engine=vllm: phase\.rollout\.tensor_parallel_size=3 must divide num_attention_heads=8"]),
    ("rl-engine-tp-beyond-a-node", RL, ["phase/rollout=vllm", "phase.rollout.tensor_parallel_size=2"], VALIDATE,
     [r"phase\.rollout\.tensor_parallel_size=2 > cluster\.devices=1: the engine is the first rank's child"]),
    ("rl-engine-on-gpus-of-its-own", RL, ["phase/rollout=vllm", "phase.rollout.colocate=false"], VALIDATE,
     [r"phase\.rollout\.colocate=false: an engine on GPUs of its own .* is not built"]),
    ("rl-importance-cap-below-1", RL, ["phase/rollout=vllm", "phase.rollout.tis_cap=0.5"], VALIDATE,
     [r"phase\.rollout\.tis_cap=0\.5: the cap of the importance ratio must be >= 1"]),
    ("rl-engine-share-of-a-gpu", RL, ["phase/rollout=vllm", "phase.rollout.gpu_memory_utilization=1.5"], VALIDATE,
     [r"phase\.rollout\.gpu_memory_utilization=1\.5: expected \(0, 1\]"]),
    ("rl-engine-python-missing", RL, ["phase/rollout=vllm", "phase.rollout.python=/nowhere/python"], VALIDATE,
     [r"phase\.rollout\.python=/nowhere/python does not exist: build the serving venv"]),
    ("rl-rollout-quantization", RL, ["phase/rollout=vllm", "phase.rollout.quantization=int4"], VALIDATE,
     [r"phase\.rollout\.quantization='int4': expected null or fp8"]),
    # -- checkpoints whose pickle would run code (tests/unsafe_pickles.py): refused before anything unpickles them
    ("init-from-a-checkpoint-that-runs-code", TINY, ["init_from={extra}/unsafe.ckpt"], VALIDATE,
     [r"^init_from=\S+/unsafe\.ckpt: \S+/unsafe\.ckpt: refused: its pickle asks for posix\.system, which no glm46 "
      r"checkpoint holds"]),
    ("resume-from-a-checkpoint-that-runs-code", TINY, ["ckpt_path={extra}/unsafe.ckpt"], VALIDATE,
     [r"^ckpt_path=\S+/unsafe\.ckpt: \S+/unsafe\.ckpt: refused: its pickle asks for posix\.system"]),
    ("init-from-a-dcp-folder-whose-item-runs-code", TINY, ["init_from={extra}/unsafe_dcp"], VALIDATE,
     [r"^init_from=\S+/unsafe_dcp: \S+/unsafe_dcp/__0_0\.distcp \(item evil\): refused: its pickle asks for "
      r"posix\.system"]),
]
# fmt: on

TOY_PRETRAIN1_DOMAINS = ["code", "docs", "license", "math", "reasoning"]


@pytest.fixture
def extra(tmp_path):
    """Experiment files with a misplaced and an unknown key, in a search-path folder beside conf/; checkpoints whose
    pickle writes a marker file if anything unpickles them without limits."""
    (tmp_path / "extra" / "experiment").mkdir(parents=True)
    header = "# @package _global_\ndefaults:\n  - tiny_bytes\n\n"
    (tmp_path / "extra" / "experiment" / "misplaced.yaml").write_text(
        header + "schedule:\n  val_check_interval: 2000\n"
    )
    (tmp_path / "extra" / "experiment" / "unknown_top_level.yaml").write_text(
        header + "schedul:\n  switch_tokens: 100\n"
    )
    unsafe_checkpoint(tmp_path / "extra" / "unsafe.ckpt", tmp_path / "marker")
    unsafe_dcp_folder(tmp_path / "extra" / "unsafe_dcp", tmp_path / "marker")
    yield tmp_path / "extra"
    assert not (tmp_path / "marker").exists(), "a checkpoint's pickle ran"


@pytest.fixture
def dataset(tmp_path):
    """A prepared dataset's index as validation reads it: tokens/shards.json with the toy_pretrain1 domains and
    the SFT conversations and RL prompts."""
    (tmp_path / "tokens").mkdir()
    index = {"domains": {d: {"documents": 1, "tokens": 1} for d in [*TOY_PRETRAIN1_DOMAINS, "rl", "sft"]}}
    (tmp_path / "tokens" / "shards.json").write_text(json.dumps(index))
    return tmp_path


def _filled(overrides: list[str], dataset: Path, extra: Path) -> list[str]:
    return [o.replace("{dataset}", str(dataset)).replace("{extra}", str(extra)) for o in overrides]


def test_the_catalogue_is_complete():
    ids = [row[0] for row in TABLE]
    assert len(ids) >= 24 and len(set(ids)) == len(ids)
    assert all(row[3] in (COMPOSE, VALIDATE) and row[2] and row[4] for row in TABLE)


@pytest.mark.parametrize("base", sorted({tuple(row[1]) for row in TABLE}), ids=" ".join)
def test_every_base_composition_is_accepted(compose_config, dataset, extra, base):
    """Each row's base alone validates: the refusal below is the row's `bad` overrides' doing."""
    validate(compose_config(*_filled(list(base), dataset, extra)))


@pytest.mark.parametrize("name, base, bad, stage, patterns", TABLE, ids=[row[0] for row in TABLE])
def test_a_bad_configuration_is_refused_naming_key_and_values(
    compose_config, dataset, extra, name, base, bad, stage, patterns
):
    overrides = _filled([*base, *bad], dataset, extra)
    if stage == COMPOSE:
        with pytest.raises(ConfigCompositionException) as error:
            compose_config(*overrides)
        message = f"{error.value}\n{error.value.__cause__ or ''}"
    else:
        cfg = compose_config(*overrides)  # composes: the refusal is validation's
        with pytest.raises(ConfigError) as error:
            validate(cfg)
        message = str(error.value)
    for pattern in patterns:
        assert re.search(pattern, message), f"{name}: {pattern!r} not in {message!r}"


def test_context_parallel_on_gpus_waits_for_its_verified_kernels(compose_config):
    """CP on a GPU cluster validates once its CUDA block kernels are verified (glm46.modules.cuda_kernels, on since
    the GPU suite's run), and is refused, naming the key, the cluster and the kernel, while they are off."""
    cfg = compose_config(
        *TINY, "parallelism=fsdp2", "cluster.devices=2", "cluster.accelerator=gpu", "parallelism.context_parallel=2"
    )
    assert cuda_kernels.VERIFIED["context_flash"]
    validate(cfg)
    with cuda_kernels.using(context_flash=False), pytest.raises(ConfigError) as error:
        validate(cfg)
    assert re.search(
        r"parallelism\.context_parallel=2 on cluster=local \(accelerator=gpu\): context parallelism's attention on "
        r"GPUs needs its CUDA block kernels \(cuda_kernels 'context_flash'\), not yet verified",
        str(error.value),
    )


def test_run_py_refuses_before_submitting(tmp_path):
    """Through run.py's real entry and the Slurm launcher: a refused job leaves no .submitit folder (nothing
    queued) and no checkpoint, and its message names the key and the value."""
    result = forked.run(
        [
            sys.executable,
            str(REPO / "run.py"),
            "cluster=local_slurm",
            *TINY,
            "optim.lr=-1",
            f"paths.sweep_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode != 0
    assert "optim.lr=-1.0 must be a number > 0" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "train" / ".submitit").exists()
    assert not list(tmp_path.rglob("*.ckpt"))
