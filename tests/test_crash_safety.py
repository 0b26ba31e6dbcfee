"""kill -9 of a process materializing ``lora_adapter`` in the middle of a GRPO iteration, then a
re-materialization: training resumes from the newest checkpoint, MLflow holds no half-registered
version, and the ``train`` pool slot is free again. The run is started the way the CLI starts one
(``materialize`` in-process against the persistent instance of the repo's dagster.yaml), not by
``trace demo``: it is the reaper (the daemon's ``dead_run_reaper`` sensor) that frees the slot."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from trace_assets import paths

CAPABILITY = "confirm_before_writing"

MATERIALIZE = textwrap.dedent("""
    import json, os, sys, time
    from dagster import DagsterInstance, asset, materialize
    from sensors import ensure_pools
    from trace_assets.assets.identify import capability_partitions
    from trace_assets.assets.train import build_train_assets
    from trace_assets.definitions import build_resources
    from trace_assets.settings import TINY
    from trace_assets.synthesize.spec import spec_hash
    from trace_assets.train import grpo

    model_path, spec_path = sys.argv[1], sys.argv[2]
    if os.environ.get("HANG_IN_ITERATION"):  # the harness's crash point: inside iteration N's optimization
        hang_at = int(os.environ["HANG_IN_ITERATION"])
        optimize = grpo.GRPOTrainer.optimize

        def slow_optimize(self, samples, iteration):
            if iteration == hang_at:
                print(f"HANGING in iteration {iteration}", flush=True)
                time.sleep(600)
            return optimize(self, samples, iteration)

        grpo.GRPOTrainer.optimize = slow_optimize

    spec = json.load(open(spec_path))

    @asset(name="synthetic_env", partitions_def=capability_partitions)
    def synthetic_env():
        return {"calibration": {"passed": True}, "spec_path": spec_path, "spec_hash": spec_hash(spec)}

    @asset(name="base_agent")
    def base_agent():
        return {"path": model_path, "checksum": "tiny"}

    @asset(name="task_splits")
    def task_splits():  # no train split: the gate's target guard measures nothing here
        return {}

    instance = DagsterInstance.get()
    ensure_pools(instance)
    instance.add_dynamic_partitions("capability", [sys.argv[3]])
    resources = {k: v for k, v in build_resources(TINY).items() if k in ("models", "mlflow", "io_manager", "store")}
    result = materialize([synthetic_env, base_agent, task_splits, *build_train_assets(TINY)], partition_key=sys.argv[3],
                         instance=instance, resources=resources)
    print("RESULT", json.dumps({"success": result.success, "run_id": result.run_id}), flush=True)
""")


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "TRACE_DATA_DIR": str(tmp_path / "data"), "TRACE_DAGSTER_DIR": str(tmp_path / "data" / "dagster"),
            "DAGSTER_HOME": str(paths.REPO_ROOT), "PYTHONPATH": str(paths.REPO_ROOT)}


def test_kill_9_mid_iteration_then_rematerialize(tiny_model_path, tmp_path, monkeypatch):
    from dagster import DagsterInstance, DagsterRunStatus, build_sensor_context

    from sensors import build_reaper_sensor
    from trace_assets.envs import get_environment
    from trace_assets.synthesize.template import template_spec

    for key, value in _env(tmp_path).items():
        if key != "PYTHONPATH":
            monkeypatch.setenv(key, value)
    spec = template_spec({"name": CAPABILITY, "description": "Ask for an explicit yes before any write.",
                          "failure_modes": []}, get_environment("retail"))
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    argv = [sys.executable, "-c", MATERIALIZE, str(tiny_model_path), str(spec_path), CAPABILITY]
    adapters = tmp_path / "data" / "adapters" / CAPABILITY

    # 1. start, and kill -9 inside iteration 2 (iteration 1 is checkpointed)
    proc = subprocess.Popen(argv, cwd=paths.REPO_ROOT, env={**_env(tmp_path), "HANG_IN_ITERATION": "2"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "HANGING in iteration 2" in line or time.monotonic() > deadline:
            break
    assert "HANGING in iteration 2" in seen[-1], "".join(seen[-40:])
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    [out_dir] = list(adapters.iterdir())
    assert sorted(p.name for p in (out_dir / "checkpoints").iterdir() if not p.name.startswith(".")) == ["iter-0001"]
    assert not (out_dir / "trace_adapter.json").exists()

    with DagsterInstance.get() as instance:
        [killed] = [r for r in instance.get_runs() if r.status == DagsterRunStatus.STARTED]
        assert instance.event_log_storage.get_concurrency_info("train").claimed_slots  # held by a dead process
        mlflow_client = _mlflow_client(tmp_path)
        assert not mlflow_client.search_registered_models()  # nothing half-registered
        assert not [r for e in mlflow_client.search_experiments() for r in mlflow_client.search_runs([e.experiment_id])]

        # 2. the daemon's reaper (a sensor tick): the run is failed, its slot freed
        sensor = build_reaper_sensor()
        skip = sensor(build_sensor_context(instance=instance))
        assert killed.run_id in str(skip.skip_message)
        assert instance.get_run_by_id(killed.run_id).status == DagsterRunStatus.FAILURE
        assert not instance.event_log_storage.get_concurrency_info("train").claimed_slots

    # 3. re-materialize: resumes at iteration 2 from the newest checkpoint, registers one version
    rerun = subprocess.run(argv, cwd=paths.REPO_ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert '"success": true' in rerun.stdout, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["resumed_from"] == 1 and summary["iterations_done"] == 2
    manifest = json.loads((out_dir / "trace_adapter.json").read_text())
    assert [row["iteration"] for row in manifest["curve"]] == [1, 2]
    with DagsterInstance.get() as instance:
        assert not instance.event_log_storage.get_concurrency_info("train").claimed_slots
        statuses = sorted(r.status.value for r in instance.get_runs())
        assert statuses == ["FAILURE", "SUCCESS"]
    mlflow_client = _mlflow_client(tmp_path)
    [version] = mlflow_client.search_model_versions(f"name = 'trace-lora-{CAPABILITY}'")
    # one whole version; champion only if the promotion gate promoted it (a random tiny model is not)
    aliases = mlflow_client.get_registered_model(f"trace-lora-{CAPABILITY}").aliases
    assert int(version.version) == 1 and version.tags["trace.promoted"] in ("True", "False")
    assert ("champion" in aliases) == (version.tags["trace.promoted"] == "True")
    runs = [r for e in mlflow_client.search_experiments() for r in mlflow_client.search_runs([e.experiment_id])]
    assert [r.info.status for r in runs] == ["FINISHED"]


def _mlflow_client(tmp_path: Path):
    from resources.mlflow_registry import MlflowRegistry

    return MlflowRegistry().client()


def test_an_interrupted_run_stops_the_wave_runner(tmp_path):
    """Ctrl-C (or SIGTERM) during a run: Dagster captures the signal, ends the run as failed and
    returns normally. The wave runner must stop there, not start the next run as if a step had
    merely failed (it used to: a SIGTERM'd ``make experiment`` went on with the next seed)."""
    import pytest
    from dagster import AssetSelection, DagsterInstance, Definitions, StaticPartitionsDefinition, asset

    from trace_assets.orchestrate import run_stale

    played = []

    @asset(partitions_def=StaticPartitionsDefinition(["0", "1"]))
    def seeded(context):
        played.append(context.partition_key)
        if context.partition_key == "0":
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends; Dagster maps SIGTERM to the same
            time.sleep(1.0)  # the interrupt is acted on at the executor's next checkpoint
        return context.partition_key

    instance = DagsterInstance.local_temp(str(tmp_path), overrides={"telemetry": {"enabled": False}})
    defs = Definitions(assets=[seeded])
    with pytest.raises(KeyboardInterrupt):
        run_stale(defs, instance, AssetSelection.assets(seeded))
    assert played == ["0"]
    # an ordinary failure is not an interrupt: the runner reports it and goes on
    played.clear()

    @asset(name="seeded", partitions_def=StaticPartitionsDefinition(["0", "1"]))
    def failing(context):
        played.append(context.partition_key)
        if context.partition_key == "0":
            raise RuntimeError("a step failed")
        return context.partition_key

    run_ids, failures = run_stale(Definitions(assets=[failing]), instance, AssetSelection.assets(failing))
    assert sorted(played) == ["0", "1"] and len(failures) == 1 and "[0]" in failures[0]
