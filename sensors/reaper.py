"""``dead_run_reaper``: runs whose worker process is gone are marked failed and their pool slots freed.

Dagster's run monitoring cannot see a killed worker with the default run launcher (it has no worker
health check), so a killed training (``kill -9``, an OOM kill, a reboot) would hold the one
``train`` slot for ever. A step that takes a ``train`` slot records its ``host:pid``
(``WORKER_TAG``) at its start, whoever launched the run (UI, CLI, ``trace demo``); a run is reaped
only when that host is this one and that process no longer exists. ``trace demo`` calls the same
function before it starts, so it needs no daemon.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from dagster import DefaultSensorStatus, SensorEvaluationContext, SkipReason, sensor

from trace_assets.orchestrate import DEMO_PID_TAG

REAPER_SENSOR_NAME = "dead_run_reaper"
WORKER_TAG = "trace/worker"
"""``<hostname>:<pid>`` of the process running a run's pool-slot step (set by the step itself)."""


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
