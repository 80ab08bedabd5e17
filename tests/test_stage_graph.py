"""An experiment's stages as a graph (glm46.app.stage_graph): what each makes, what it needs, the waves that can run
side by side, the experts a unified stage learnt from, and a stage naming one that is not before it refused."""

from pathlib import Path

import pytest

from glm46.app.stage_graph import dependencies, resolved, stage_kind, teachers, waves, with_output
from glm46.errors import ConfigError

POST_TRAINING = {  # toy_glm45_post's graph, its overrides cut to what the graph reads
    "midtrain": ["phase=toy_midtrain"],
    "cold_start": ["phase=toy_sft"],
    "reward_model": ["module=reward_model"],
    "expert_a": ["init_from=@cold_start"],
    "expert_b": ["init_from=@cold_start", "phase.reward.model=@reward_model"],
    "sample_a": ["task=sample", "sample.model=@expert_a"],
    "sample_b": ["task=sample", "sample.model=@expert_b", "sample.reward_model=@reward_model"],
    "data": ["task=prepare", "source.paths=[@sample_a,@sample_b]", "prepare.tokenizer.path=@cold_start/tokenizer.json"],
    "unified": ["data.path=@data", "init_from=@midtrain"],
}


def test_references_resolve_to_what_each_kind_of_stage_makes():
    run = Path("/run")
    kinds = {name: stage_kind(overrides) for name, overrides in POST_TRAINING.items()}
    assert kinds["sample_a"] == "sample" and kinds["data"] == "prepare" and kinds["unified"] == "train"
    assert resolved(POST_TRAINING["data"] + ["note=a@b", "x=@"], run, kinds) == [
        "task=prepare",
        "source.paths=[/run/stages/sample_a/samples.jsonl,/run/stages/sample_b/samples.jsonl]",
        "prepare.tokenizer.path=/run/stages/cold_start/hf/tokenizer.json",
        "note=a@b",  # not a reference: @ inside a value
        "x=@",
    ]
    unified = ["data.path=/run/stages/data/data", "init_from=/run/stages/midtrain/hf"]
    assert resolved(POST_TRAINING["unified"], run, kinds) == unified
    assert with_output("sample", [], run / "stages" / "s") == ["sample.output=/run/stages/s/samples.jsonl"]
    assert with_output("prepare", [], run / "stages" / "d") == ["source.output_dir=/run/stages/d/data"]
    with pytest.raises(ConfigError, match="task=eval: stages train, sample or prepare"):
        stage_kind(["task=eval"])


def test_the_graph_says_which_stages_can_run_side_by_side():
    needs = dependencies(POST_TRAINING, ["init_from=@unified"])
    assert needs["cold_start"] == ["midtrain"]  # a training stage without init_from: the one before it
    assert needs["sample_b"] == ["expert_b", "reward_model"] and needs["final"] == ["unified"]
    assert waves(needs) == [
        ["midtrain"],
        ["cold_start"],
        ["reward_model", "expert_a"],
        ["expert_b", "sample_a"],
        ["sample_b"],
        ["data"],
        ["unified"],
        ["final"],
    ]
    kinds = {name: stage_kind(overrides) for name, overrides in POST_TRAINING.items()}
    assert teachers("unified", needs, kinds, POST_TRAINING) == ["expert_a", "expert_b"]  # not the reward model
    assert teachers("expert_b", needs, kinds, POST_TRAINING) == []


@pytest.mark.parametrize(
    "stages, message",
    [
        ({"a": ["init_from=@b"], "b": []}, "stage a: @b names no stage listed before it"),
        ({"a": ["sample.model=@nowhere"]}, "stage a: @nowhere names no stage"),
    ],
)
def test_a_stage_naming_no_earlier_stage_is_refused(stages, message):
    with pytest.raises(ConfigError, match=message):
        dependencies(stages)
