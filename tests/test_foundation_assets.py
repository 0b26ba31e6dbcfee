"""The foundation slice of the asset graph, materialized for real with the tiny profile."""

from __future__ import annotations

import os
from pathlib import Path
import subprocess
import sys

import pytest
from dagster import AssetKey, DagsterInstance, materialize

from trace_assets.settings import TINY



@pytest.fixture()
def tiny_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TRACE_PROFILE", "tiny")
    return tmp_path


def test_definitions_validate(tiny_env):
    env = {**os.environ, "TRACE_PROFILE": "tiny", "DAGSTER_HOME": str(tiny_env)}
    out = subprocess.run(
        [sys.executable, "-m", "dagster", "definitions", "validate", "-m", "trace_assets.definitions"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr


FOUNDATION = ["task_splits", "base_agent", "base_trajectories", "trajectory_splits"]


def test_materialize_foundation_with_tiny_settings(tiny_env):
    from trace_assets.assets.foundation import build_foundation_assets
    from trace_assets.definitions import build_resources

    assets = build_foundation_assets(TINY)
    resources = build_resources(TINY)
    instance = DagsterInstance.ephemeral()
    result = materialize(assets, instance=instance, resources=resources)
    assert result.success
    splits = result.output_for_node("task_splits")
    n_families = len({t["family"] for t in splits["train"]})
    assert n_families >= 6
    assert len(splits["train"]) == n_families * TINY.tasks.train_per_family
    assert not {t["task_id"] for t in splits["test"]} & {t["task_id"] for t in splits["train"] + splits["demo"]}

    d = result.output_for_node("trajectory_splits")
    assert len(d["d_plus"]) + len(d["d_minus"]) == len(splits["train"])
    store = resources["store"]
    rows = store.trajectories(policy="base")
    assert {r["split"] for r in rows} == {"train", "test"}
    assert len(rows) == len(splits["train"]) + len(splits["test"])

    agent = instance.get_latest_materialization_event(AssetKey("base_agent")).asset_materialization
    # `trace serve` finds the agent folder here (the IO manager's own "path" is its pickle).
    assert agent.metadata["model_path"].value == result.output_for_node("base_agent")["path"]
    assert (Path(agent.metadata["model_path"].value) / "config.json").exists()
    mat = instance.get_latest_materialization_event(AssetKey("base_trajectories")).asset_materialization
    assert "success_by_family" in mat.metadata and "sample_failed_trajectory" in mat.metadata
    # Re-materializing adds no duplicate rows and keeps the same data version.
    again = materialize(assets, selection=FOUNDATION[2:], instance=instance, resources=resources)
    assert again.success and len(store.trajectories(policy="base")) == len(rows)


def test_the_wave_runner_can_run_each_step_in_a_process_of_its_own(tiny_env):
    """``make demo``'s isolation: every step of a run executes in a fresh process (its memory goes
    back to the OS when it exits), the results land in the same instance, and nothing is stale after."""
    import dataclasses

    from dagster import AssetSelection, DagsterEventType

    from trace_assets.definitions import build_definitions
    from trace_assets.orchestrate import run_stale, stale_items

    (tiny_env / "dagster").mkdir()
    instance = DagsterInstance.local_temp(str(tiny_env / "dagster"), overrides={"telemetry": {"enabled": False}})
    defs = build_definitions()  # from TRACE_PROFILE=tiny, as the step processes rebuild it
    selection = AssetSelection.assets("task_splits", "base_agent")

    run_ids, failures = run_stale(defs, instance, selection, isolate_steps=True)
    assert run_ids and not failures, failures
    pids = {}
    for run_id in run_ids:
        for entry in instance.all_logs(run_id, of_type=DagsterEventType.STEP_SUCCESS):
            pids[entry.step_key] = entry.dagster_event.pid
    assert {"task_splits", "base_agent"} <= set(pids), pids
    assert os.getpid() not in pids.values(), pids
    assert len(set(pids.values())) == len(pids), f"each step has a process of its own: {pids}"
    assert all(s.name == "FRESH" for s in stale_items(defs, instance, selection).values())
    assert run_stale(defs, instance, selection, isolate_steps=True) == ([], [])

    # definitions from settings the step processes would not rebuild are refused, not run
    other = build_definitions(dataclasses.replace(TINY, tasks=dataclasses.replace(TINY.tasks, train_per_family=5)))
    with pytest.raises(ValueError, match="TRACE_PROFILE"):
        run_stale(other, instance, selection, isolate_steps=True)
