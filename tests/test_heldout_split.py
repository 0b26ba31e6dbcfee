"""The held-out test split is disjoint from everything Steps 1-3 see, by task id and by database seed.

Steps 1-3 see: the demo tasks (warm-start), the train tasks (Step 1, GRPO on the target and its
ablation), and synthetic tasks (calibration, GRPO training, the router's index and validation, the
held-out synthetic evaluation), whose databases are ``generate_db(synthetic seed)``.
"""

from __future__ import annotations

import random

import pytest

from trace_assets.envs import get_environment
from trace_assets.envs.base import Task
from trace_assets.envs.splits import SYNTHETIC_SEED_BASE, TARGET_SEED_LIMIT, make_splits, split_overlaps
from trace_assets.settings import PROFILES

ENV = get_environment("retail")


def _plain_draw(env, counts: dict[str, int], seed: int) -> dict[str, list[int]]:
    """The per-family draw as it was before test seeds were kept apart (the reference)."""
    out: dict[str, list[int]] = {name: [] for name in counts}
    for family in env.families():
        seeds = random.Random(f"{seed}:{family}").sample(range(TARGET_SEED_LIMIT), sum(counts.values()))
        start = 0
        for name, n in counts.items():
            out[name] += seeds[start:start + n]
            start += n
    return out


def _splits(profile: str, seed: int | None = None):
    t = PROFILES[profile].tasks
    return make_splits(ENV, demo_per_family=t.demo_per_family, train_per_family=t.train_per_family,
                       test_per_family=t.test_per_family, seed=t.seed if seed is None else seed)


def test_the_experiment_profile_holds_out_at_least_ten_tasks_per_family_disjoint_from_steps_1_to_3():
    splits = _splits("experiment")
    for family in ENV.families():
        assert sum(t.family == family for t in splits["test"]) >= 10
    assert split_overlaps(splits) == []
    for seed in range(40):  # whatever the split seed
        assert split_overlaps(_splits("experiment", seed)) == [], seed


def test_a_test_seed_that_another_family_trained_on_is_replaced():
    """Families draw independently, so the plain draw sometimes gives a test task the database of
    another family's train task; find such a split seed and check the split keeps them apart."""
    t = PROFILES["experiment"].tasks
    counts = {"demo": t.demo_per_family, "train": t.train_per_family, "test": t.test_per_family}
    colliding = None
    for seed in range(200):
        plain = _plain_draw(ENV, counts, seed)
        if set(plain["test"]) & set(plain["demo"] + plain["train"]):
            colliding = seed
            break
    assert colliding is not None, "no colliding draw in 200 seeds: the test cannot show the replacement"
    plain = _plain_draw(ENV, counts, colliding)
    splits = _splits("experiment", colliding)
    assert [x.seed for x in splits["demo"]] == plain["demo"] and [x.seed for x in splits["train"]] == plain["train"]
    assert split_overlaps(splits) == []
    assert len(splits["test"]) == len(plain["test"])
    kept = [a for a, b in zip([x.seed for x in splits["test"]], plain["test"]) if a == b]
    assert len(kept) >= len(plain["test"]) - 3  # only the colliding draws moved


def test_a_larger_test_split_keeps_the_demos_tasks_and_the_demo_split_is_unchanged():
    """The experiment reuses the demo's warm-started agent and Step 1: same demo and train tasks."""
    demo, experiment = _splits("demo"), _splits("experiment")
    assert [x.task_id for x in demo["demo"]] == [x.task_id for x in experiment["demo"]]
    assert [x.task_id for x in demo["train"]] == [x.task_id for x in experiment["train"]]
    t = PROFILES["demo"].tasks
    plain = _plain_draw(ENV, {"demo": t.demo_per_family, "train": t.train_per_family, "test": t.test_per_family}, t.seed)
    if not set(plain["test"]) & set(plain["demo"] + plain["train"]):  # the demo's draw had no collision
        assert [x.seed for x in demo["test"]] == plain["test"]


def test_no_synthetic_task_shares_a_database_or_an_id_with_a_test_task():
    from trace_assets.assets.route import ROUTER_VALIDATION_SHIFT
    from trace_assets.identify.heuristic import RULES
    from trace_assets.synthesize import CALIBRATION_OFFSET, SyntheticEnv, template_spec
    from trace_assets.train.config import GRPOConfig
    from trace_assets.train.heldout import HELD_OUT_OFFSET

    splits = _splits("experiment")
    test_seeds, test_ids = {t.seed for t in splits["test"]}, {t.task_id for t in splits["test"]}
    route = PROFILES["experiment"].route
    name = "confirm_before_writing"
    env = SyntheticEnv(template_spec({"name": name, "description": RULES[name].description, "failure_modes": []}, ENV), ENV)
    offsets = {"grpo": GRPOConfig().seed_offset, "calibration": CALIBRATION_OFFSET, "index": route.index_offset,
               "router validation": route.index_offset + ROUTER_VALIDATION_SHIFT, "held-out": HELD_OUT_OFFSET}
    for what, offset in offsets.items():
        for task in env.sample_tasks(3, offset=offset):
            assert task.seed >= SYNTHETIC_SEED_BASE and task.seed not in test_seeds, what
            assert task.task_id not in test_ids, what


def test_a_planted_overlap_is_reported():
    splits = _splits("tiny")
    assert split_overlaps(splits) == []
    train = splits["train"][0]
    shared_db = Task.from_dict({**splits["test"][0].to_dict(), "seed": train.seed})
    assert any("database seed" in p for p in split_overlaps({**splits, "test": [shared_db]}))
    assert any("also a demo/train task" in p for p in split_overlaps({**splits, "test": [train]}))
    twice = splits["test"][:1] * 2
    assert any("another test task" in p for p in split_overlaps({**splits, "test": twice}))


@pytest.mark.parametrize("profile", ["demo", "experiment", "paper"])
def test_every_profile_seeds_its_experiment(profile):
    assert len(PROFILES[profile].experiment.seeds) >= (1 if profile == "demo" else 3)
