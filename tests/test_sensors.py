"""Operating TRACE: the landing-folder sensor, the nightly schedule, the automation sensor and pools.

The sensor is evaluated with ``build_sensor_context`` on a real (ephemeral) instance and a real
``TraceStore`` in ``tmp_path``; a "restart" is a new context built from the stored cursor.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from dagster import (
    DagsterInstance,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    RunRequest,
    SensorResult,
    build_schedule_context,
    build_sensor_context,
)

from resources.store import TraceStore
import sensors.landing as landing_sensor
from sensors import build_operate_definitions, ensure_pools
from sensors.landing import build_new_trajectories_sensor, load_cursor
from sensors.schedules import REIDENTIFY_ASSETS, REIDENTIFY_JOB, build_reidentify_job


def _record(i: int) -> dict:
    return {
        "task_id": f"retail/order_status/{i:05d}",
        "env": "retail",
        "messages": [
            {"role": "user", "content": f"Where is order W{i}?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_order_details", "arguments": json.dumps({"order_id": f"W{i}"})}}
            ]},
            {"role": "tool", "name": "get_order_details", "content": "{}"},
            {"role": "assistant", "content": "It is pending."},
        ],
        "reward": float(i % 2),
    }


def _write(path: Path, records: list[dict], extra_lines: list[str] = ()) -> Path:
    path.write_text("\n".join([*map(json.dumps, records), *extra_lines]) + "\n")
    return path


@pytest.fixture()
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    landing = tmp_path / "landing"
    monkeypatch.setenv("TRACE_LANDING_DIR", str(landing))
    landing.mkdir()
    store = TraceStore(database=str(tmp_path / "data" / "t.duckdb"))
    job = build_reidentify_job()
    sensor = build_new_trajectories_sensor(job, settle_s=0.0)
    with DagsterInstance.ephemeral() as instance:
        yield {"landing": landing, "store": store, "sensor": sensor, "instance": instance, "data": tmp_path / "data"}


def _tick(env, cursor: str | None = None) -> SensorResult:
    ctx = build_sensor_context(instance=env["instance"], cursor=cursor, resources={"store": env["store"]})
    result = env["sensor"](ctx)
    assert isinstance(result, SensorResult)
    return result


def _count(store: TraceStore) -> int:
    return store.query("SELECT count(*) AS n FROM trajectories").item()


def test_new_file_is_imported_once_and_requests_one_reidentify_run(env):
    landing, store = env["landing"], env["store"]
    _write(landing / "batch1.jsonl", [_record(i) for i in range(20)])
    start = time.perf_counter()
    first = _tick(env)
    latency = time.perf_counter() - start
    print(f"\nlanding → imported in one sensor evaluation: {latency * 1000:.0f} ms for 20 trajectories")
    assert _count(store) == 20
    assert len(first.run_requests) == 1
    request = first.run_requests[0]
    assert request.run_key and request.run_key.startswith("landed-")
    assert request.tags["trace/new_trajectories"] == "20"
    assert not (landing / "batch1.jsonl").exists() and (landing / "imported" / "batch1.jsonl").exists()
    cursor = load_cursor(first.cursor)
    (entry,) = cursor["files"].values()
    assert entry["name"] == "batch1.jsonl" and entry["status"] == "imported" and entry["n_inserted"] == 20
    assert {"size", "mtime"} <= set(entry)

    # the same content lands again under another name: no import, no run
    _write(landing / "batch1-copy.jsonl", [_record(i) for i in range(20)])
    again = _tick(env, first.cursor)
    assert not again.run_requests and _count(store) == 20
    assert not (landing / "batch1-copy.jsonl").exists()
    assert load_cursor(again.cursor)["files"] == cursor["files"]

    # an empty folder: nothing to do
    idle = _tick(env, again.cursor)
    assert not idle.run_requests and idle.skip_reason


def test_duplicate_content_with_a_fresh_cursor_inserts_nothing_and_requests_no_run(env):
    """Even without the cursor (lost instance), the store's idempotence means no second run."""
    landing, store = env["landing"], env["store"]
    _write(landing / "a.jsonl", [_record(i) for i in range(5)])
    assert len(_tick(env).run_requests) == 1
    _write(landing / "a.jsonl", [_record(i) for i in range(5)])
    result = _tick(env, None)
    assert not result.run_requests and _count(store) == 5
    # both copies are kept, nothing lost
    assert len(list((landing / "imported").glob("a*.jsonl"))) == 2


def test_malformed_file_is_quarantined_with_a_reason_and_the_sensor_keeps_going(env):
    landing, store = env["landing"], env["store"]
    _write(landing / "bad.jsonl", [_record(100)], extra_lines=["{not json", json.dumps({"task_id": "x"})])
    (landing / "garbage.parquet").write_bytes(b"this is not parquet")
    _write(landing / "good.jsonl", [_record(i) for i in range(3)])
    (landing / ".partial.jsonl").write_text("{")  # hidden: a producer still writing
    (landing / "notes.txt").write_text("ignored")

    result = _tick(env)  # must not raise
    quarantine = env["data"] / "quarantine"
    reasons = sorted(quarantine.glob("*.reason.json"))
    assert len(reasons) == 2
    texts = " ".join(p.read_text() for p in reasons)
    assert "bad.jsonl:2" in texts and "garbage.parquet" in texts
    assert sorted(p.name.split("_", 1)[1] for p in quarantine.iterdir() if not p.name.endswith(".reason.json")) == [
        "bad.jsonl", "garbage.parquet"]
    # the valid line of the bad file is stored, as `trace import` does; the good file too
    assert _count(store) == 4
    assert len(result.run_requests) == 1
    statuses = {e["name"]: e["status"] for e in load_cursor(result.cursor)["files"].values()}
    assert statuses == {"bad.jsonl": "quarantined", "garbage.parquet": "quarantined", "good.jsonl": "imported"}
    assert {p.name for p in landing.iterdir()} == {".partial.jsonl", "notes.txt", "imported"}


def test_importer_errors_are_retried_then_quarantined(env, monkeypatch):
    landing = env["landing"]
    _write(landing / "locked.jsonl", [_record(1)])

    def boom(*args, **kwargs):
        raise OSError("database is locked")

    monkeypatch.setattr(landing_sensor, "import_file", boom)
    cursor = None
    for attempt in range(landing_sensor.MAX_ATTEMPTS):
        result = _tick(env, cursor)
        cursor = result.cursor
        assert not result.run_requests
        assert (landing / "locked.jsonl").exists() == (attempt < landing_sensor.MAX_ATTEMPTS - 1)
    reason = next((env["data"] / "quarantine").glob("*.reason.json"))
    assert "database is locked" in reason.read_text()


def test_restart_with_the_stored_cursor_does_not_reimport(env, monkeypatch):
    landing, store = env["landing"], env["store"]
    _write(landing / "night.jsonl", [_record(i) for i in range(4)])
    first = _tick(env)
    assert len(first.run_requests) == 1
    stored = first.cursor

    # "restart": a new instance-side evaluation with the stored cursor; the file reappears (for
    # example, the move to imported/ was lost in a crash)
    (landing / "imported" / "night.jsonl").rename(landing / "night.jsonl")
    calls = []
    monkeypatch.setattr(landing_sensor, "import_file", lambda *a, **k: calls.append(a))
    env["sensor"] = build_new_trajectories_sensor(build_reidentify_job(), settle_s=0.0)
    second = _tick(env, stored)
    assert calls == [] and not second.run_requests and _count(store) == 4

    # even with the cursor lost, the store's idempotence means nothing new and so no run request
    monkeypatch.undo()
    monkeypatch.setenv("TRACE_LANDING_DIR", str(landing))
    (landing / "imported" / "night.jsonl").rename(landing / "night.jsonl")
    third = _tick(env, None)
    assert not third.run_requests  # nothing new in the store


def test_settle_time_leaves_files_being_written(env):
    sensor = build_new_trajectories_sensor(build_reidentify_job(), settle_s=60.0)
    _write(env["landing"] / "fresh.jsonl", [_record(1)])
    ctx = build_sensor_context(instance=env["instance"], resources={"store": env["store"]})
    result = sensor(ctx)
    assert not result.run_requests and (env["landing"] / "fresh.jsonl").exists()


def test_landing_dir_override(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("TRACE_LANDING_DIR", raising=False)
    assert landing_sensor.landing_folder() == tmp_path / "data" / "landing"
    monkeypatch.setenv("TRACE_LANDING_DIR", str(tmp_path / "drop"))
    assert landing_sensor.landing_folder() == tmp_path / "drop"
    assert landing_sensor.landing_folder(tmp_path / "explicit") == tmp_path / "explicit"


def test_operate_definitions_wiring_and_schedule(tmp_path, monkeypatch):
    from trace_assets.definitions import build_definitions
    from trace_assets.settings import TINY

    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    defs = build_definitions(TINY)
    repo = defs.get_repository_def()
    sensors_by_name = {s.name: s for s in repo.sensor_defs}
    assert set(sensors_by_name) == {"new_trajectories_sensor", "trace_automation", "dead_run_reaper"}
    assert all(s.default_status == DefaultSensorStatus.RUNNING for s in sensors_by_name.values())
    job = defs.resolve_job_def(REIDENTIFY_JOB)
    keys = {k.to_user_string() for k in job.asset_layer.executable_asset_keys}
    assert keys == set(REIDENTIFY_ASSETS) and "capability_dictionary" not in keys
    assert sensors_by_name["new_trajectories_sensor"].job_name == REIDENTIFY_JOB

    schedule = repo.get_schedule_def("nightly_reidentification")
    assert schedule.cron_schedule == "0 2 * * *" and schedule.execution_timezone == "UTC"
    assert schedule.job_name == REIDENTIFY_JOB and schedule.default_status == DefaultScheduleStatus.RUNNING

    store = TraceStore(database=str(tmp_path / "s.duckdb"))
    when = datetime(2026, 1, 2, 2, 0, tzinfo=timezone.utc)
    with DagsterInstance.ephemeral() as instance:
        ctx = build_schedule_context(instance=instance, scheduled_execution_time=when, resources={"store": store})
        first = schedule.evaluate_tick(ctx).run_requests
        assert len(first) == 1 and isinstance(first[0], RunRequest)
        assert first[0].run_key.startswith("nightly-") and first[0].tags["trace/trigger"] == "nightly"
        # unchanged trajectories → the same run key (Dagster launches a run key once per schedule)
        ctx = build_schedule_context(instance=instance, scheduled_execution_time=when, resources={"store": store})
        assert schedule.evaluate_tick(ctx).run_requests[0].run_key == first[0].run_key
        _write(tmp_path / "x.jsonl", [_record(7)])
        from trace_assets.trajectories import import_file

        import_file(tmp_path / "x.jsonl", store)
        ctx = build_schedule_context(instance=instance, scheduled_execution_time=when, resources={"store": store})
        assert schedule.evaluate_tick(ctx).run_requests[0].run_key != first[0].run_key

    ops = build_operate_definitions(TINY)
    assert (len(ops["sensors"]), len(ops["schedules"]), len(ops["jobs"])) == (3, 1, 1)


def test_train_pool_is_limited_to_one():
    with DagsterInstance.ephemeral() as instance:
        ensure_pools(instance)
        info = instance.event_log_storage.get_concurrency_info("train")
        assert info.slot_count == 1 and not info.using_default_limit


def test_repo_dagster_yaml_loads_with_pools_monitoring_and_crash_retries(tmp_path, monkeypatch):
    from trace_assets import paths

    monkeypatch.setenv("DAGSTER_HOME", str(paths.REPO_ROOT))
    monkeypatch.setenv("TRACE_DAGSTER_DIR", str(tmp_path / "dagster"))
    with DagsterInstance.get() as instance:
        assert instance.run_monitoring_enabled
        assert instance.run_retries_enabled and instance.run_retries_max_retries == 1
        assert instance.run_retries_retry_on_asset_or_op_failure is False
        pools = instance.get_concurrency_config().pool_config
        assert pools.default_pool_limit == 1
        ensure_pools(instance)
        assert instance.event_log_storage.get_concurrency_info("train").slot_count == 1


def test_a_killed_demo_frees_its_train_slot_and_a_live_one_blocks_a_second(tmp_path, monkeypatch):
    """`trace demo` runs in-process: if it is killed, its run keeps the `train` slot claimed and the
    next training would wait forever. The next demo marks such runs failed and frees the slot."""
    import subprocess
    import sys

    from dagster import DagsterRunStatus
    from dagster._core.storage.dagster_run import DagsterRun

    from trace_assets.orchestrate import DEMO_PID_TAG, demo_lock

    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with DagsterInstance.ephemeral() as instance:
        ensure_pools(instance)
        orphan = instance.add_run(DagsterRun(job_name="trace_main", run_id="orphan", status=DagsterRunStatus.STARTED,
                                             tags={DEMO_PID_TAG: str(dead.pid)}))
        ui_run = instance.add_run(DagsterRun(job_name="trace_main", run_id="from-the-ui", status=DagsterRunStatus.STARTED))
        instance.event_log_storage.claim_concurrency_slot("train", orphan.run_id, "lora_adapter")
        assert instance.event_log_storage.get_concurrency_info("train").claimed_slots

        with demo_lock(instance):
            assert not instance.event_log_storage.get_concurrency_info("train").claimed_slots
            assert instance.get_run_by_id("orphan").status == DagsterRunStatus.FAILURE
            assert instance.get_run_by_id(ui_run.run_id).status == DagsterRunStatus.STARTED  # not ours: untouched
            lock = tmp_path / "data" / ".demo.lock"
            assert lock.read_text() == str(os.getpid())
            lock.write_text(str(os.getppid()))  # pretend another live demo holds the folder
            with pytest.raises(SystemExit, match="another `trace demo`"):
                with demo_lock(instance):
                    pass
            lock.write_text(str(os.getpid()))
        assert not lock.exists()


def test_reaper_fails_runs_whose_recorded_worker_died_and_only_those(tmp_path):
    """Runs started from the UI or the CLI carry the worker tag their pool-slot step recorded."""
    import socket
    import subprocess
    import sys

    from dagster import DagsterRunStatus
    from dagster._core.storage.dagster_run import DagsterRun

    from sensors import WORKER_TAG, build_reaper_sensor

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    with DagsterInstance.ephemeral() as instance:
        ensure_pools(instance)
        runs = {
            "dead-here": {WORKER_TAG: f"{host}:{dead.pid}"},
            "alive-here": {WORKER_TAG: f"{host}:{os.getpid()}"},
            "dead-elsewhere": {WORKER_TAG: f"another-host:{dead.pid}"},  # e.g. a Docker worker: not ours to judge
            "untagged": {},
        }
        for run_id, tags in runs.items():
            instance.add_run(DagsterRun(job_name="trace_main", run_id=run_id, status=DagsterRunStatus.STARTED, tags=tags))
        instance.event_log_storage.claim_concurrency_slot("train", "dead-here", "lora_adapter")
        result = build_reaper_sensor()(build_sensor_context(instance=instance))
        assert "dead-here" in result.skip_message
        status = {run_id: instance.get_run_by_id(run_id).status for run_id in runs}
        assert status == {"dead-here": DagsterRunStatus.FAILURE, "alive-here": DagsterRunStatus.STARTED,
                          "dead-elsewhere": DagsterRunStatus.STARTED, "untagged": DagsterRunStatus.STARTED}
        assert not instance.event_log_storage.get_concurrency_info("train").claimed_slots
