"""The skills a curriculum's stages are compared on, read from each stage's evaluation: what the curriculum's report
(glm46.app.curriculum) prints and curriculum.png (glm46.reports.plots) draws."""

from __future__ import annotations

import json
from pathlib import Path

from glm46.eval import summarize
from glm46.intervals import interval

SKILLS = {  # name -> (its lm-eval task, the 0/1 metric of each prompt)
    "arithmetic": ("glm46_arithmetic", "exact_match"),
    "tool_arithmetic": ("glm46_tool_arithmetic", "exact_match"),
    "tool_calls": ("glm46_tool_arithmetic", "tool_calls"),  # whether the episode called the tool at all
    "preference": ("glm46_style", "follows_style"),  # the generated preference task's hidden rule
}


def evaluations(stages: list[tuple[str, Path]]) -> dict[str, dict[str, float]]:
    """Each evaluated stage's summarized scores (its eval/results.json, lm-eval's format)."""
    return {
        name: summarize(json.loads((where / "eval" / "results.json").read_text()))
        for name, where in stages
        if (where / "eval" / "results.json").is_file()
    }


def skills_of(scores: dict[str, dict[str, float]]) -> dict[str, dict[str, tuple[float, tuple[float, float]]]]:
    """skill -> stage -> (its held-out share, the 95% interval), for the SKILLS some stage measured."""
    skills = {}
    for skill, (task, metric) in SKILLS.items():
        measured = {name: score for name, score in scores.items() if f"{task}/{metric}" in score}
        if measured:
            skills[skill] = {
                name: (score[f"{task}/{metric}"], interval(score[f"{task}/{metric}"], int(score[f"{task}/n"])))
                for name, score in measured.items()
            }
    return skills
