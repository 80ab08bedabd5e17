"""The recipe's timeline, printed by `task=plan`: every phase of the composed recipe (conf/recipe) with its place on
the token clock and, where it starts and where it ends, the values the trainer uses (LR, global batch, MTP weight,
balancer rate; glm46.optim.schedules.recipe_values)."""

from __future__ import annotations

from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from glm46.optim.schedules import recipe_values

COLUMNS = ("lr", "global_batch_tokens", "mtp_weight", "balancer_rate")


def short_tokens(n: float) -> str:
    """15000000000000 -> '15T', 22500000000000 -> '22.5T', 0 -> '0'."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n:g}"


def batch_tokens(n: int) -> str:
    """GLM's batch sizes in binary millions (64M = 2^26 tokens), other sizes as they are."""
    return f"{n // 2**20}M" if n % 2**20 == 0 else f"{n:,}"


def phase_compositions(cfg: DictConfig) -> dict[str, DictConfig]:
    """Each phase of cfg's recipe: cfg itself for its own phase, the others composed as this run with
    `phase=<name>` (its other overrides kept, those of its phase dropped), so that where the phases differ
    (sequence length, global batch) each row is the phase's own. Needs Hydra's context (run.py's tasks run in it)."""
    overrides = [o for o in HydraConfig.get().overrides.task if not o.lstrip("+~").startswith(("phase=", "phase."))]
    return {
        name: cfg if name == cfg.phase.name else compose(config_name="config", overrides=[*overrides, f"phase={name}"])
        for name in cfg.recipe.phases
    }


def timeline(phases: dict[str, DictConfig]) -> list[dict]:
    """One row per phase: its token range on the recipe's clock and recipe_values at its first and its last token
    (the next phase's first follows it on the same curves: the clock is one)."""
    rows = []
    for name, phase_cfg in phases.items():
        start, tokens = phase_cfg.schedule.start_tokens, phase_cfg.recipe.phases[name]
        rows.append(
            {
                "phase": name,
                "start": start,
                "end": start + tokens,
                "first": recipe_values(phase_cfg, 0),
                "last": recipe_values(phase_cfg, tokens - 1),
            }
        )
    return rows


def format_timeline(rows: list[dict], composed: str, recipe: str) -> str:
    """The table; `composed` (the run's own phase) is marked with *."""

    def values(key: str, row: dict) -> str:
        first, last = row["first"][key], row["last"][key]
        if key == "global_batch_tokens":
            return f"{batch_tokens(first)} -> {batch_tokens(last)}"
        return f"{first:.3g} -> {last:.3g}"

    header = ["phase", "tokens (on the clock)", "LR", "global batch", "MTP weight", "balancer rate"]
    table = [
        [
            ("* " if row["phase"] == composed else "  ") + row["phase"],
            f"{short_tokens(row['start'])} -> {short_tokens(row['end'])}",
            *(values(key, row) for key in COLUMNS),
        ]
        for row in rows
    ]
    widths = [max(len(r[i]) for r in [["  " + header[0], *header[1:]], *table]) for i in range(len(header))]
    lines = [
        f"recipe timeline (recipe={recipe}: {short_tokens(rows[-1]['end'])} tokens on one clock; values at each "
        f"phase's first -> last token; M = 2^20 tokens):",
        "  ".join(h.ljust(w) for h, w in zip(["  " + header[0], *header[1:]], widths)),
        *("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in table),
    ]
    if composed not in {row["phase"] for row in rows}:
        lines.append(f"phase={composed} is not on the recipe's clock: its schedules run over its own tokens")
    return "\n".join(line.rstrip() for line in lines)


def off_the_clock(cfg: DictConfig) -> str:
    """What `task=plan` says of a run the recipe's clock does not hold: its schedules' own clock and, for a
    post-training phase, the values it continues with."""
    line = f"phase={cfg.phase.name} is not on the recipe's clock: its schedules run over its own tokens"
    if cfg.phase.name in cfg.recipe.post_training:
        values = recipe_values(cfg, 0)
        line += (
            f"; as post-training it continues past the recipe's switch: MTP weight {values['mtp_weight']:.3g} and "
            f"balancer rate {values['balancer_rate']:.3g} (correction bias frozen) throughout"
        )
    return line
