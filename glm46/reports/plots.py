"""Pictures of a run: the loss curves and the expert load, from the files in its run directory.

`python -m glm46.reports.plots RUN_DIR` redraws every plot a run writes (a curriculum's curriculum.png too); training
draws them at the end of a run.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402

from glm46.reports.skills import evaluations, skills_of  # noqa: E402


def read_metrics(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """metrics.csv -> {metric: (steps, values)} for every metric with at least one value."""
    series: dict[str, tuple[list, list]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key != "step" and value not in ("", None):
                    steps, values = series.setdefault(key, ([], []))
                    steps.append(int(float(row["step"])))
                    values.append(float(value))
    return {k: (np.array(s), np.array(v)) for k, (s, v) in series.items()}


def plot_losses(metrics: dict, out: Path) -> Path:
    fig, (ax_loss, ax_vio) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in ("train/loss", "train/mtp_loss", "val/loss"):
        if name in metrics:
            ax_loss.plot(*metrics[name], label=name, marker="o" if name.startswith("val") else None)
    ax_loss.set(xlabel="optimizer step", ylabel="cross-entropy (nats)", title="loss")
    ax_loss.legend()
    if "moe/maxvio" in metrics:
        ax_vio.plot(*metrics["moe/maxvio"], label="mean over MoE layers")
        ax_vio.legend()
    ax_vio.set(xlabel="optimizer step", ylabel="(max load - mean) / mean", title="MaxVio")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_reward_model_vs_monitor(metrics: dict, out: Path) -> Path:
    """RL against a reward model: its normalised reward beside the monitor, a rule the policy is not trained on, on
    the training rollouts and the held-out greedy replies. The reward rising while the rule falls is the policy
    over-optimising the reward model."""
    fig, (ax_rm, ax_rule) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, ax in (("rm_reward", ax_rm), ("monitor", ax_rule)):
        for split, marker in (("rl", None), ("val", "o")):
            if f"{split}/{name}" in metrics:
                ax.plot(*metrics[f"{split}/{name}"], label=f"{split}/{name}", marker=marker)
        ax.legend()
    ax_rm.set(xlabel="optimizer step", ylabel="(score - mean) / std", title="reward model")
    ax_rule.set(xlabel="optimizer step", ylabel="share of replies", title="monitor (the rule it is not trained on)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_expert_load(history: Path, out: Path) -> Path:
    data = np.load(history)
    steps, counts = data["steps"], data["counts"]  # [records], [records, layers, E]
    first, last = counts[0], counts[-1]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, load, step in ((axes[0], first, steps[0]), (axes[1], last, steps[-1])):
        relative = load / load.mean(axis=-1, keepdims=True)
        image = ax.imshow(relative, aspect="auto", cmap="viridis", vmin=0, vmax=max(2.0, relative.max()))
        ax.set(xlabel="expert", ylabel="MoE layer (main, then MTP)", title=f"load / mean load, step {step}")
        ax.set_yticks(range(load.shape[0]))
    fig.colorbar(image, ax=axes, shrink=0.8)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def on_token_axis(metrics: dict, series: str, offset: float) -> tuple[np.ndarray, np.ndarray]:
    """A metric of a stage against the tokens seen before the stage (`offset`) plus the stage's own."""
    steps, tokens = metrics["train/tokens_seen"]
    series_steps, values = metrics[series]
    return offset + np.interp(series_steps, steps, tokens), values


def on_recipe_clock(run_dir: Path) -> bool:
    """Whether a stage's phase is one of its recipe's (conf/recipe), from the composition it saved (.hydra/)."""
    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        return False
    cfg = yaml.safe_load(path.read_text())
    return cfg["phase"]["name"] in (cfg.get("recipe") or {}).get("phases", {})


def plot_curriculum(
    stages: list[tuple[str, Path]], skills: dict[str, dict[str, tuple[float, tuple[float, float]]]], out: Path
) -> Path:
    """The stages of a curriculum on one axis of tokens seen: each stage's train/loss (its mean reward for RL) above,
    its LR below (one curve through the stages on the recipe's clock: pre-training and mid-training), boundaries
    marked; beside them each skill's accuracy after each stage with its 95% interval.
    skills: skill -> stage -> (accuracy, (low, high) of its interval)."""
    fig = plt.figure(figsize=(13, 7))
    grid = fig.add_gridspec(2, 2, width_ratios=[2, 1], height_ratios=[3, 2])
    ax_loss, ax_acc = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[:, 1])
    ax_lr = fig.add_subplot(grid[1, 0], sharex=ax_loss)
    ax_reward, offset, clock = None, 0.0, []
    for index, (name, run_dir) in enumerate(stages):
        color = f"C{index}"  # a stage's color in both panels
        metrics = read_metrics(run_dir / "metrics.csv") if (run_dir / "metrics.csv").exists() else {}
        if "train/tokens_seen" not in metrics:
            continue
        if "rl/reward_mean" in metrics:  # RL: its policy loss says little; the reward is what it raises
            ax_reward = ax_reward or ax_loss.twinx()
            ax_reward.plot(*on_token_axis(metrics, "rl/reward_mean", offset), "k.-", label=f"{name} (reward)")
            ax_reward.set_ylabel("RL reward (mean over samples, black)")
        elif "train/loss" in metrics:
            ax_loss.plot(*on_token_axis(metrics, "train/loss", offset), ".-", color=color, label=name)  # dots: short
        if "optim/lr" in metrics:
            tokens_lr = on_token_axis(metrics, "optim/lr", offset)
            if on_recipe_clock(run_dir):  # one line through the stages that share the recipe's clock
                clock.extend(zip(*tokens_lr))
            else:
                ax_lr.plot(*tokens_lr, ".-", color=color, label=name)
        for ax in (ax_loss, ax_lr):
            ax.axvline(offset, color="grey", linestyle=":")
        ax_loss.text(offset, 1.0, f" {name}", transform=ax_loss.get_xaxis_transform(), va="bottom", fontsize=8)
        offset += float(metrics["train/tokens_seen"][1][-1])
    ax_loss.set(ylabel="train/loss (nats)")
    ax_loss.legend(loc="upper right", fontsize=8)
    if clock:
        ax_lr.plot(*zip(*clock), "k.-", label="pre-training and mid-training (one clock)")
    ax_lr.legend(loc="lower left", fontsize=8)
    ax_lr.set(xlabel="tokens seen (RL: prompt rows x max_prompt_len)", ylabel="optim/lr", yscale="log")
    ax_lr.set_title("LR: one warm-up and one decay through the recipe's clock; SFT and RL on their own", fontsize=9)
    top = 0.1
    for number, (skill, accuracy) in enumerate(skills.items()):
        names = list(accuracy)
        values = [accuracy[n][0] for n in names]
        errors = [  # below and above each value (clamped: at 0 or 1 the interval's end meets the value, up to rounding)
            [max(v - accuracy[n][1][0], 0.0) for n, v in zip(names, values)],
            [max(accuracy[n][1][1] - v, 0.0) for n, v in zip(names, values)],
        ]
        shift = 0.08 * (number - (len(skills) - 1) / 2)  # side by side, so that the intervals do not overlap
        ax_acc.errorbar([i + shift for i in range(len(names))], values, yerr=errors, marker="o", capsize=4, label=skill)
        ax_acc.set_xticks(range(len(names)), names, rotation=30)
        top = max([top, *(accuracy[n][1][1] for n in names)])
    ax_acc.set(ylabel="share of held-out prompts (greedy)", title="skills per stage (95% interval)")
    ax_acc.set_ylim(0, top * 1.1)
    ax_acc.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_sweep(members: list[tuple[str, Path, int, int, bool]], out: Path) -> list[Path]:
    """A sweep's members on one axis of tokens seen: train/loss left, val/loss right (when logged). members: (legend
    label, metrics.csv, group, replicate, finished): a group's members share a color, its replicates (seeds) differ
    in line style, an unfinished member's line is dotted. Nothing is drawn without a curve."""
    styles = ["-", "--", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1))]
    curves = [(m, read_metrics(m[1])) for m in members if m[1].is_file()]
    curves = [(m, metrics) for m, metrics in curves if "train/tokens_seen" in metrics]
    if not curves:
        return []
    panels = [name for name in ("train/loss", "val/loss") if any(name in metrics for _, metrics in curves)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, series in zip(axes[0], panels):
        for (name, _, group, replicate, done), metrics in curves:
            if series in metrics:
                ax.plot(
                    *on_token_axis(metrics, series, 0.0),
                    linestyle=styles[replicate % len(styles)] if done else ":",
                    marker="o" if series.startswith("val") else None,
                    color=f"C{group % 10}",
                    label=name if done else f"{name} (unfinished)",
                )
        ax.set(xlabel="tokens seen", ylabel=f"{series} (nats)", title=series)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [out]


def plot_run(run_dir: str | Path, curriculum: bool = False) -> list[Path]:
    """loss.png, reward_model.png and expert_load.png of a run where it has their data; with `curriculum`, also a
    curriculum's curriculum.png (which the curriculum draws itself when it ends)."""
    run_dir = Path(run_dir)
    written = [path for path in [redraw_curriculum(run_dir) if curriculum else None] if path]
    if (run_dir / "metrics.csv").exists():
        metrics = read_metrics(run_dir / "metrics.csv")
        written.append(plot_losses(metrics, run_dir / "loss.png"))
        if "rl/rm_reward" in metrics and "rl/monitor" in metrics:
            written.append(plot_reward_model_vs_monitor(metrics, run_dir / "reward_model.png"))
    if (run_dir / "expert_load.npz").exists():
        written.append(plot_expert_load(run_dir / "expert_load.npz", run_dir / "expert_load.png"))
    return written


def redraw_curriculum(run_dir: Path) -> Path | None:
    """curriculum.png of a finished curriculum again, from its curriculum.json and its stages' directories
    (`python -m glm46.reports.plots RUN_DIR`); None for a run that is no curriculum."""
    file = run_dir / "curriculum.json"
    if not file.is_file():
        return None
    stages = [(s["stage"], Path(s["run_dir"])) for s in json.loads(file.read_text()) if s["kind"] == "train"]
    return plot_curriculum(stages, skills_of(evaluations(stages)), run_dir / "curriculum.png")


if __name__ == "__main__":
    for path in plot_run(sys.argv[1], curriculum=True):
        print(path)
