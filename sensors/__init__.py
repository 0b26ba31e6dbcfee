"""Operating TRACE: the landing-folder sensor, nightly re-identification and the automation sensor.

``build_operate_definitions(settings)`` returns ``{"sensors", "schedules", "jobs"}`` for
``trace_assets.definitions.build_definitions``; ``ensure_pools`` pins the ``train`` pool.

* ``sensors.landing``: ``new_trajectories_sensor`` imports files dropped in the landing folder and
  requests a ``reidentify`` run when new trajectories landed.
* ``sensors.schedules``: the ``reidentify`` job, the ``nightly_reidentification`` schedule and the
  ``trace_automation`` sensor.
* ``sensors.reaper``: ``dead_run_reaper`` marks failed, and frees the pool slots of, runs whose
  worker process is gone (``record_worker`` is what a pool-slot step calls first).

Default status: all four are RUNNING. The landing sensor is cheap (a directory listing every
30 s) and acts only on files someone put there; the schedule launches nothing unless trajectories
changed; the automation sensor is what makes declared automation conditions act at all (it is
STOPPED otherwise). Stop any of them in the UI; that choice persists in the instance.
"""

from __future__ import annotations

from typing import Any

from sensors.landing import build_new_trajectories_sensor
from sensors.reaper import (  # noqa: F401 - the package's API
    REAPER_SENSOR_NAME, WORKER_TAG, build_reaper_sensor, process_alive, reap_dead_runs, record_worker,
)
from sensors.schedules import build_automation_sensor, build_nightly_schedule, build_reidentify_job

TRAIN_POOL = "train"


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
