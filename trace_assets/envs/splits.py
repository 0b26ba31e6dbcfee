"""Seeded, family-stratified task splits of a target environment.

Seeds are drawn without replacement from ``[0, TARGET_SEED_LIMIT)``; synthetic environments draw
from ``[SYNTHETIC_SEED_BASE, ...)``, so no synthetic task can coincide with a test task. Every family
gets exactly ``demo_per_family`` / ``train_per_family`` / ``test_per_family`` tasks. The ``test``
split is for measuring only: nothing in Step 1 reads it.
"""

from __future__ import annotations

import random

from trace_assets.envs.base import Environment, Task

TARGET_SEED_LIMIT = 100_000
SYNTHETIC_SEED_BASE = 1_000_000
SPLITS = ("demo", "train", "test")


def make_splits(env: Environment, *, demo_per_family: int, train_per_family: int, test_per_family: int, seed: int) -> dict[str, list[Task]]:
    """``{"demo": [...], "train": [...], "test": [...]}``, deterministic in ``seed``."""
    counts = {"demo": demo_per_family, "train": train_per_family, "test": test_per_family}
    out: dict[str, list[Task]] = {name: [] for name in SPLITS}
    for family in env.families():
        rng = random.Random(f"{seed}:{family}")
        seeds = rng.sample(range(TARGET_SEED_LIMIT), sum(counts.values()))
        start = 0
        for name in SPLITS:
            out[name].extend(env.make_task(family, s) for s in seeds[start : start + counts[name]])
            start += counts[name]
    return out


class TaskPoolEnv:
    """A target environment restricted to a fixed list of tasks, for GRPO on the target itself.

    ``sample_tasks(n, offset)`` cycles through ``tasks`` from ``offset``; everything else is the
    wrapped environment's.
    """

    def __init__(self, env: Environment, tasks: list[Task]) -> None:
        if not tasks:
            raise ValueError("TaskPoolEnv needs at least one task")
        self.env, self.tasks, self.name = env, list(tasks), env.name

    def sample_tasks(self, n: int, *, offset: int = 0) -> list[Task]:
        return [self.tasks[(offset + i) % len(self.tasks)] for i in range(n)]

    def __getattr__(self, attr: str):  # tool_schemas, system_prompt, families, make_task, start
        return getattr(self.env, attr)
