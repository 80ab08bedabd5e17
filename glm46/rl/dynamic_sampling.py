"""Dynamic sampling (DAPO, arXiv:2503.14476; verl's `algorithm.filter_groups`, slime's dynamic sampling filter): a
prompt group whose rewards are all equal has advantages 0 and gives no gradient, so it is dropped, and the batch is
refilled from the next prompts of the data stream until it holds as many groups as one rollout batch.

With `phase.grpo.dynamic_sampling=true`, each rollout batch's groups go into a `Refill`; an update runs once it holds
a batch's worth of varied groups (on every data-parallel rank), or after `phase.grpo.max_draws` rollout batches, when
flat groups, in the order drawn, fill what is missing (verl raises there instead; the update is then plain GRPO's).
The update trains on the first varied groups in the order drawn; the surplus is dropped, as verl drops it. The data
position (the prompts drawn) advances only at an update, so that a run stopped between two draws resumes at the
update's prompts and draws the same groups again (each completion is seeded by its prompt's global index).
"""

from __future__ import annotations

from glm46.rl.core_algos import flat_groups
from glm46.rl.rollout_batch import Rollout


class Refill:
    """The groups drawn since the last update, varied and flat apart, each in the order drawn."""

    def __init__(self, group_size: int, pad_id: int):
        self.group_size, self.pad_id = group_size, pad_id
        self.varied: list[Rollout] = []
        self.flat: list[Rollout] = []
        self.draws = 0  # rollout batches added since the last update

    def add(self, rollout: Rollout) -> None:
        """One rollout batch's groups (rollout.rewards set), row by row as they lie: group by group."""
        flat = flat_groups(rollout.rewards, self.group_size).tolist()
        size = self.group_size
        for g, is_flat in enumerate(flat):
            (self.flat if is_flat else self.varied).append(rollout.select(slice(g * size, (g + 1) * size)))
        self.draws += 1

    def take(self, groups: int) -> tuple[Rollout, int]:
        """The update's `groups` groups: the first varied ones, then flat ones if too few were drawn; and how many are
        flat. Empties the refill."""
        chosen = (self.varied + self.flat)[:groups]
        filled = max(0, groups - len(self.varied))
        self.varied, self.flat, self.draws = [], [], 0
        return Rollout.concatenated(chosen, self.pad_id), filled
