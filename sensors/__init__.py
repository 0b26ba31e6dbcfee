"""Operating TRACE: the landing-folder sensor, nightly re-identification and the automation sensor.

``build_operate_definitions(settings)`` returns ``{"sensors", "schedules", "jobs"}`` for
``trace_assets.definitions.build_definitions``.

* ``new_trajectories_sensor`` watches the landing folder (``TRACE_LANDING_DIR``, else
  ``<data>/landing``) for ``*.jsonl`` / ``*.parquet`` files. Each new file goes through the same
  importer as ``trace import`` (``trace_assets.trajectories.import_file``). A good file is moved to
  ``landing/imported/``; a file with any bad line is moved to the quarantine folder beside a
  ``.reason.json`` (its valid lines are stored, as ``trace import`` does). A file that makes the
  importer raise (a locked database, a disk error) stays in place and is retried on the next tick;
  after ``MAX_ATTEMPTS`` failures it is quarantined with the error as reason. The sensor never
  raises because of a file. Its cursor (JSON) records every processed file by content hash, with
  name, size and mtime, so the same content is never imported twice, even after a restart or when a
  copy lands under another name. When new trajectories landed it requests one ``reidentify`` run
  whose run key is derived from the content hashes.
  Producers should write under a hidden or ``.tmp`` name and rename when done; files modified less
  than ``settle_s`` seconds ago are left for the next tick.
* ``reidentify`` (job): ``trajectory_splits → label_matrix → capability_stats →
  selected_capabilities``. It does not re-induce the capability dictionary: ``label_matrix`` is
  incremental (only unlabelled keys go to the analyst), so it labels only the new trajectories and
  recomputes the statistics and C*.
* ``nightly_reidentification`` (schedule, 02:00 UTC): the same job, for trajectories that arrived
  by other means (``trace import``). Its run key is a fingerprint of the train trajectories, so a
  night without new data launches nothing.
* ``trace_automation``: the automation-condition sensor over every asset.
* ``dead_run_reaper``: marks failed, and frees the pool slots of, runs whose worker process is gone
  (``kill -9``, an OOM kill, a reboot). Dagster's run monitoring cannot see that with the default
  run launcher (it has no worker health check), so a killed training would hold the one ``train``
  slot for ever. A step that takes a ``train`` slot records its ``host:pid`` (``WORKER_TAG``) at its
  start, whoever launched the run (UI, CLI, ``trace demo``); a run is reaped only when that host is
  this one and that process no longer exists. ``trace demo`` calls the same function before it
  starts, so it needs no daemon.

Default status: all three are RUNNING. The landing sensor is cheap (a directory listing every
30 s) and acts only on files someone put there; the schedule launches nothing unless trajectories
changed; the automation sensor is what makes declared automation conditions act at all (it is
STOPPED otherwise). Stop any of them in the UI; that choice persists in the instance.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from dagster import (
    AssetSelection,
    AutomationConditionSensorDefinition,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    RunRequest,
    ScheduleEvaluationContext,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    define_asset_job,
    schedule,
    sensor,
)

from resources.store import TraceStore
from trace_assets import paths
from trace_assets.settings import clip
from trace_assets.trajectories import SUPPORTED_SUFFIXES, RecordError, import_file, quarantine

REIDENTIFY_JOB = "reidentify"
REIDENTIFY_ASSETS = ("trajectory_splits", "label_matrix", "capability_stats", "selected_capabilities")
SENSOR_NAME = "new_trajectories_sensor"
SCHEDULE_NAME = "nightly_reidentification"
AUTOMATION_SENSOR_NAME = "trace_automation"
REAPER_SENSOR_NAME = "dead_run_reaper"
WORKER_TAG = "trace/worker"
"""``<hostname>:<pid>`` of the process running a run's pool-slot step (set by the step itself)."""
DEMO_PID_TAG = "trace/demo_pid"
"""The pid of the ``trace demo`` process that executes a run in-process."""
TRAIN_POOL = "train"
MAX_ATTEMPTS = 3
CURSOR_MAX_FILES = 5000  # the oldest entries are dropped beyond this; imports stay idempotent anyway


def landing_folder(override: str | os.PathLike | None = None) -> Path:
    """The watched folder: ``override``, else ``TRACE_LANDING_DIR``, else ``<data>/landing``."""
    chosen = override or os.environ.get("TRACE_LANDING_DIR")
    if chosen:
        folder = Path(chosen).expanduser().resolve()
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    return paths.landing_dir()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_cursor(raw: str | None) -> dict[str, Any]:
    """``{"files": {sha256: {name, size, mtime, status, n_inserted, at}}, "attempts": {sha256: n}}``."""
    try:
        cursor = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        cursor = {}
    cursor.setdefault("files", {})
    cursor.setdefault("attempts", {})
    return cursor


def dump_cursor(cursor: dict[str, Any]) -> str:
    files = cursor["files"]
    if len(files) > CURSOR_MAX_FILES:
        keep = sorted(files, key=lambda h: files[h].get("at", 0))[-CURSOR_MAX_FILES:]
        cursor["files"] = {h: files[h] for h in keep}
    return json.dumps(cursor, sort_keys=True)


def _candidates(folder: Path, settle_s: float) -> list[Path]:
    now = time.time()
    out = []
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.name.startswith(".") or path.suffix not in SUPPORTED_SUFFIXES:
            continue
        try:
            if now - path.stat().st_mtime < settle_s:
                continue  # possibly still being written
        except FileNotFoundError:
            continue
        out.append(path)
    return out


def _move_unique(path: Path, folder: Path, digest: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / path.name
    if target.exists():
        target = folder / f"{path.stem}.{digest[:12]}{path.suffix}"
    if target.exists():  # same name and same content already there: keep the first copy only
        path.unlink()
        return target
    shutil.move(str(path), target)
    return target


def process_landing(
    folder: Path, store: TraceStore, cursor: dict[str, Any], log: Any, *, settle_s: float = 0.0,
    quarantine_folder: Path | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Import every settled file in ``folder`` once. Returns (this tick's results, new cursor).

    Never raises because of a file: a bad file is quarantined, an importer error is retried later.
    """
    results = []
    imported_dir = folder / "imported"
    for path in _candidates(folder, settle_s):
        try:
            stat = path.stat()
            digest = file_sha256(path)
        except OSError as exc:
            log.warning(f"landing: cannot read {path.name}: {exc}; retrying on the next tick")
            continue
        entry = {"name": path.name, "size": stat.st_size, "mtime": stat.st_mtime, "at": time.time()}
        if digest in cursor["files"]:
            first = cursor["files"][digest]
            moved = _move_unique(path, imported_dir, digest)
            log.info(f"landing: {path.name} has the content of {first['name']} (already processed); "
                     f"not imported again, moved to {moved}")
            results.append({**entry, "sha256": digest, "status": "duplicate", "n_inserted": 0})
            continue
        try:
            report = import_file(path, store, move_bad=True, quarantine_folder=quarantine_folder)
        except Exception as exc:  # noqa: BLE001 - the sensor must keep running
            attempts = cursor["attempts"].get(digest, 0) + 1
            cursor["attempts"][digest] = attempts
            log.error(f"landing: importing {path.name} failed (attempt {attempts}/{MAX_ATTEMPTS}): {clip(repr(exc))}")
            if attempts >= MAX_ATTEMPTS:
                try:
                    target = quarantine(path, [RecordError(str(path), 0, "<file>", f"importer error: {exc!r}")],
                                        move=True, folder=quarantine_folder)
                except OSError as q_exc:
                    log.error(f"landing: could not quarantine {path.name}: {q_exc!r}")
                    continue
                cursor["attempts"].pop(digest, None)
                cursor["files"][digest] = {**entry, "status": "quarantined", "n_inserted": 0, "to": str(target)}
                results.append({**entry, "sha256": digest, "status": "quarantined", "n_inserted": 0})
            continue
        cursor["attempts"].pop(digest, None)
        if report.ok:
            try:
                target = str(_move_unique(path, imported_dir, digest))
            except OSError as exc:  # it is recorded in the cursor, so it will not be imported again
                log.warning(f"landing: imported {path.name} but could not move it: {exc!r}")
                target = str(path)
            status = "imported"
        else:
            target, status = report.quarantined_to, "quarantined"
            log.warning(f"landing: {report.summary()}; first errors: {[str(e) for e in report.errors[:5]]}")
        if report.ok:
            log.info(f"landing: {report.summary()} -> {target}")
        if report.warnings:
            log.warning(f"landing: {path.name}: {len(report.warnings)} warning(s), first: {[str(w) for w in report.warnings[:5]]}")
        cursor["files"][digest] = {**entry, "status": status, "n_inserted": report.n_inserted, "to": target}
        results.append({**entry, "sha256": digest, "status": status, "n_inserted": report.n_inserted,
                        "n_valid": report.n_valid, "n_errors": len(report.errors)})
    return results, cursor


def reidentify_run_key(digests: list[str]) -> str:
    if len(digests) == 1:
        return f"landed-{digests[0]}"
    return "landed-" + hashlib.sha256("\n".join(sorted(digests)).encode()).hexdigest()


def build_reidentify_job():
    return define_asset_job(
        REIDENTIFY_JOB,
        selection=AssetSelection.assets(*REIDENTIFY_ASSETS),
        description=(
            "Re-identification after new trajectories: D+/D−, incremental labels (only unlabelled "
            "trajectories go to the analyst), statistics and C*. The dictionary is not re-induced."
        ),
        tags={"trace/operation": "reidentify"},
    )


def build_new_trajectories_sensor(
    job, *, landing_dir: str | None = None, settle_s: float = 1.0, minimum_interval_seconds: int = 30,
    default_status: DefaultSensorStatus = DefaultSensorStatus.RUNNING,
):
    """The landing-folder sensor. ``landing_dir`` overrides ``TRACE_LANDING_DIR``."""

    @sensor(
        name=SENSOR_NAME, job=job, minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description="Imports new *.jsonl / *.parquet trajectory files from the landing folder and "
                    "requests a re-identification run when new trajectories landed.",
    )
    def new_trajectories_sensor(context: SensorEvaluationContext, store: TraceStore):
        folder = landing_folder(landing_dir)
        cursor = load_cursor(context.cursor)
        start = time.perf_counter()
        results, cursor = process_landing(folder, store, cursor, context.log, settle_s=settle_s)
        new_cursor = dump_cursor(cursor)
        if not results:
            return SensorResult(skip_reason=SkipReason(f"no new files in {folder}"), cursor=new_cursor)
        landed = [r for r in results if r["n_inserted"] > 0]
        context.log.info(f"landing: {len(results)} file(s) processed in {time.perf_counter() - start:.2f} s; "
                         f"{sum(r['n_inserted'] for r in landed)} new trajectories")
        if not landed:
            return SensorResult(
                skip_reason=SkipReason(f"{len(results)} file(s) processed, no new trajectories"), cursor=new_cursor,
            )
        request = RunRequest(
            run_key=reidentify_run_key([r["sha256"] for r in landed]),
            tags={
                "trace/trigger": "landing",
                "trace/files": ",".join(r["name"] for r in landed)[:200],
                "trace/new_trajectories": str(sum(r["n_inserted"] for r in landed)),
            },
        )
        return SensorResult(run_requests=[request], cursor=new_cursor)

    return new_trajectories_sensor


def trajectories_fingerprint(store: TraceStore) -> str:
    """A hash of the set of train trajectories of the base policy (what D+/D− are built from)."""
    frame = store.query(
        "SELECT count(*) AS n, coalesce(max(trajectory_id), '') AS hi, "
        "coalesce(sum(hash(trajectory_id)), 0)::VARCHAR AS h "
        "FROM trajectories WHERE split = 'train' AND policy = 'base'"
    )
    row = frame.row(0)
    return hashlib.sha256(json.dumps([str(v) for v in row]).encode()).hexdigest()[:16]


def build_nightly_schedule(job, *, default_status: DefaultScheduleStatus = DefaultScheduleStatus.RUNNING):
    @schedule(
        name=SCHEDULE_NAME, job=job, cron_schedule="0 2 * * *", execution_timezone="UTC",
        default_status=default_status,
        description="Nightly re-identification: labels only new trajectories, recomputes stats and C*. "
                    "Skipped when the train trajectories did not change since the last nightly run.",
    )
    def nightly_reidentification(context: ScheduleEvaluationContext, store: TraceStore):
        try:
            fingerprint = trajectories_fingerprint(store)
        except Exception as exc:  # noqa: BLE001 - an unreadable store still gets its nightly run
            context.log.warning(f"nightly: could not fingerprint the store ({exc!r}); running anyway")
            fingerprint = context.scheduled_execution_time.strftime("%Y%m%d") if context.scheduled_execution_time else "now"
        # Run keys are unique per schedule: an unchanged trajectory set is not re-run.
        return RunRequest(run_key=f"nightly-{fingerprint}", tags={"trace/trigger": "nightly", "trace/trajectories": fingerprint})

    return nightly_reidentification


def build_automation_sensor() -> AutomationConditionSensorDefinition:
    return AutomationConditionSensorDefinition(
        AUTOMATION_SENSOR_NAME, target=AssetSelection.all(), default_status=DefaultSensorStatus.RUNNING,
        description="Evaluates the assets' automation conditions (e.g. re-synthesize a capability whose spec "
                    "data version changed).",
    )


def record_worker(context: Any) -> None:
    """Tag the current run with this process (``WORKER_TAG``), so that it can be reaped if killed.
    Call it first thing in a step that holds a pool slot. A direct invocation (no stored run) is
    left alone."""
    if context.instance.get_run_by_id(context.run_id) is None:
        return
    context.instance.add_run_tags(context.run_id, {WORKER_TAG: f"{socket.gethostname()}:{os.getpid()}"})


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dead_owner(tags: dict[str, str]) -> str | None:
    """The owner of a run, described, if it is a process of this host that no longer exists."""
    worker = tags.get(WORKER_TAG, "")
    host, _, pid = worker.rpartition(":")
    if host == socket.gethostname() and pid.isdigit() and not process_alive(int(pid)):
        return f"its worker process {worker}"
    demo = tags.get(DEMO_PID_TAG, "")
    if demo.isdigit() and not process_alive(int(demo)) and not worker:
        return f"its `trace demo` process (pid {demo})"
    return None


def reap_dead_runs(instance: Any, log: Any = None) -> list[str]:
    """Mark failed every started run whose owning process is gone, and free its pool slots.

    Runs without an owner tag, or owned by another host (a Docker or Kubernetes worker), are never
    touched: only their own launcher can tell whether they live. Returns the reaped run ids.
    """
    from dagster import DagsterRunStatus, RunsFilter

    reaped = []
    for run in instance.get_runs(RunsFilter(statuses=[DagsterRunStatus.STARTED, DagsterRunStatus.STARTING])):
        owner = _dead_owner(run.tags)
        if owner is None:
            continue
        message = f"{owner} died; marked failed and its pool slots freed, so the next run can take them"
        instance.report_run_failed(run, message=message)
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        reaped.append(run.run_id)
        if log is not None:
            log(f"run {run.run_id}: {message}")
    return reaped


def build_reaper_sensor(*, minimum_interval_seconds: int = 30,
                        default_status: DefaultSensorStatus = DefaultSensorStatus.RUNNING):
    @sensor(name=REAPER_SENSOR_NAME, minimum_interval_seconds=minimum_interval_seconds, default_status=default_status,
            description="Marks failed, and frees the pool slots of, runs whose worker process was killed.")
    def dead_run_reaper(context: SensorEvaluationContext):
        reaped = reap_dead_runs(context.instance, context.log.warning)
        return SkipReason(f"reaped {len(reaped)} run(s) whose worker died: {reaped}" if reaped else "no dead runs")

    return dead_run_reaper


def build_operate_definitions(settings: Any = None, *, landing_dir: str | None = None) -> dict[str, list]:
    """``{"sensors": [...], "schedules": [...], "jobs": [...]}`` to pass into ``Definitions``."""
    job = build_reidentify_job()
    return {
        "sensors": [build_new_trajectories_sensor(job, landing_dir=landing_dir), build_automation_sensor(),
                    build_reaper_sensor()],
        "schedules": [build_nightly_schedule(job)],
        "jobs": [job],
    }


def ensure_pools(instance: Any, limits: dict[str, int] | None = None) -> None:
    """Pin pool limits in the instance (dagster.yaml can only set a default limit for all pools).

    Same as ``dagster instance concurrency set train 1``.
    """
    for pool, limit in (limits or {TRAIN_POOL: 1}).items():
        info = instance.event_log_storage.get_concurrency_info(pool)
        if info.using_default_limit or info.slot_count != limit:
            instance.event_log_storage.set_concurrency_slots(pool, limit)
