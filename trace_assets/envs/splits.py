"""Seeded, family-stratified task splits of a target environment.

Seeds are drawn without replacement from ``[0, TARGET_SEED_LIMIT)``; synthetic environments draw
from ``[SYNTHETIC_SEED_BASE, ...)``, so no synthetic task can coincide with a test task. Every family
gets exactly ``demo_per_family`` / ``train_per_family`` / ``test_per_family`` tasks. The ``test``
split is for measuring only: nothing in Step 1 reads it.

A seed is also a task's database (``generate_db(seed)``), and families draw their seeds
independently, so a test seed of one family could be a demo or train seed of another: the same
users and orders that Steps 1-3 saw. A test seed is therefore never a seed of any demo or train
task, nor of another test task; a colliding draw is replaced by the family's next fresh draw.
Without a collision the splits are exactly the plain per-family draw, and raising
``test_per_family`` leaves the demo and train tasks as they were (the draw is prefix-stable), so a
larger test split reuses the same base agent and Step 1. :func:`split_overlaps` checks all of it.

A benchmark environment with its own split (``env.official_splits()``, e.g. tau2-bench's
``split_tasks.json``) keeps it: no task ever moves between its train and test. The counts then cap
what is taken per family, in the file's order: ``demo`` is the first ``demo_per_family`` official
train tasks of a family (the warm-start demos), ``train`` the next ``train_per_family``, and
``test`` the first ``test_per_family`` official test tasks.
"""

from __future__ import annotations

import random
from typing import Any

from trace_assets.envs.base import Environment, Task

TARGET_SEED_LIMIT = 100_000
SYNTHETIC_SEED_BASE = 1_000_000
SPLITS = ("demo", "train", "test")


def synthetic_draw(knob: str, family: str, seed: int) -> float:
    """The uniform draw in [0, 1) that decides ``knob`` for the synthetic task ``(family, seed)``:
    one seeded stream per knob, so turning one knob never reshuffles another."""
    return random.Random(f"synthetic/{knob}/{family}/{seed}").random()


def make_splits(env: Environment, *, demo_per_family: int, train_per_family: int, test_per_family: int, seed: int) -> dict[str, list[Task]]:
    """``{"demo": [...], "train": [...], "test": [...]}``, deterministic in ``seed``."""
    counts = {"demo": demo_per_family, "train": train_per_family, "test": test_per_family}
    out: dict[str, list[Task]] = {name: [] for name in SPLITS}
    official = getattr(env, "official_splits", None)
    if official is not None:
        given = official()
        for family in env.families():
            train = [t for t in given["train"] if t.family == family]
            out["demo"].extend(train[:demo_per_family])
            out["train"].extend(train[demo_per_family : demo_per_family + train_per_family])
            out["test"].extend([t for t in given["test"] if t.family == family][:test_per_family])
        return out
    seen = demo_per_family + train_per_family
    draws = {}
    for family in env.families():
        rng = random.Random(f"{seed}:{family}")
        draws[family] = (rng, rng.sample(range(TARGET_SEED_LIMIT), sum(counts.values())))
    taken = {s for _, seeds in draws.values() for s in seeds[:seen]}  # every database Steps 1-3 may see
    for family, (rng, seeds) in draws.items():
        out["demo"].extend(env.make_task(family, s) for s in seeds[:demo_per_family])
        out["train"].extend(env.make_task(family, s) for s in seeds[demo_per_family:seen])
        for s in seeds[seen:]:
            while s in taken:  # a demo/train database of any family, or an earlier test task's
                s = rng.randrange(TARGET_SEED_LIMIT)
            taken.add(s)
            out["test"].append(env.make_task(family, s))
    return out


def configured_splits(env: Environment, tasks: Any, **counts: int) -> dict[str, list[Task]]:
    """:func:`make_splits` as ``tasks`` (the ``[tasks]`` settings) configures it; ``counts``
    (``demo_per_family`` ...) override its sizes, e.g. a benchmark playing more train tasks."""
    sizes = {k: getattr(tasks, k) for k in ("demo_per_family", "train_per_family", "test_per_family")}
    unknown = set(counts) - set(sizes)
    if unknown:
        raise TypeError(f"configured_splits: unknown counts {sorted(unknown)}")
    return make_splits(env, **{**sizes, **counts}, seed=tasks.seed)


def split_overlaps(splits: dict[str, list[Task]]) -> list[str]:
    """What the ``test`` split shares with the ``demo`` and ``train`` splits (the tasks Steps 1-3
    see) or with itself: a task id, or a database seed (``task.seed``, the seed of
    ``generate_db``); also a test seed in the synthetic range. [] = disjoint."""
    problems = []
    seen = [t for name in ("demo", "train") for t in splits.get(name, [])]
    seen_ids, seen_seeds = {t.task_id for t in seen}, {t.seed for t in seen}
    test_ids, test_seeds = set(), set()
    for task in splits.get("test", []):
        if task.task_id in seen_ids or task.task_id in test_ids:
            problems.append(f"test task {task.task_id} is also a {'demo/train' if task.task_id in seen_ids else 'test'} task")
        if task.seed in seen_seeds or task.seed in test_seeds:
            problems.append(f"test task {task.task_id} shares database seed {task.seed} with "
                            f"{'a demo/train' if task.seed in seen_seeds else 'another test'} task")
        if task.seed >= SYNTHETIC_SEED_BASE:
            problems.append(f"test task {task.task_id} has a synthetic seed {task.seed}")
        test_ids.add(task.task_id)
        test_seeds.add(task.seed)
    return problems


def tasks_of(splits: dict[str, list[dict[str, Any]]], name: str) -> list[Task]:
    """The tasks of split ``name`` from a stored ``task_splits`` value (tasks as plain dicts)."""
    return [Task.from_dict(t) for t in splits[name]]


class TaskPoolEnv:
    """A target environment restricted to a fixed list of tasks, for GRPO on the target itself.

    ``sample_tasks(n, offset)`` reads positions ``offset .. offset + n - 1`` of an endless stream
    that visits every task once per epoch, in a fresh order each epoch seeded by ``seed`` (a
    shuffling sampler, as TRL's: consecutive iterations never see one family only). Same
    ``seed`` and offset, same tasks. Everything else is the wrapped environment's.
    """

    def __init__(self, env: Environment, tasks: list[Task], *, seed: int = 0) -> None:
        if not tasks:
            raise ValueError("TaskPoolEnv needs at least one task")
        self.env, self.tasks, self.name, self.seed = env, list(tasks), env.name, seed
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            self._orders[epoch] = random.Random(f"{self.seed}:pool-epoch:{epoch}").sample(range(len(self.tasks)), len(self.tasks))
        return self._orders[epoch]

    def sample_tasks(self, n: int, *, offset: int = 0) -> list[Task]:
        size = len(self.tasks)
        return [self.tasks[self._order(k // size)[k % size]] for k in range(offset, offset + n)]

    def __getattr__(self, attr: str):  # tool_schemas, system_prompt, families, make_task, start
        return getattr(self.env, attr)
