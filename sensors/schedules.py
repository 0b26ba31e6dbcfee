"""Scheduled and automatic operation: the ``reidentify`` job, its nightly schedule, the automation sensor.

* ``reidentify`` (job): ``trajectory_splits → label_matrix → capability_stats →
  selected_capabilities``. It does not re-induce the capability dictionary: ``label_matrix`` is
  incremental (only unlabelled keys go to the analyst), so it labels only the new trajectories and
  recomputes the statistics and C*. The landing sensor (``sensors.landing``) requests it too.
* ``nightly_reidentification`` (schedule, 02:00 UTC): the same job, for trajectories that arrived
  by other means (``trace import``). Its run key is a fingerprint of the train trajectories, so a
  night without new data launches nothing.
* ``trace_automation``: the automation-condition sensor over every asset.
"""

from __future__ import annotations

import hashlib
import json

from dagster import (
    AssetSelection,
    AutomationConditionSensorDefinition,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    RunRequest,
    ScheduleEvaluationContext,
    define_asset_job,
    schedule,
)

from resources.store import TraceStore

REIDENTIFY_JOB = "reidentify"
REIDENTIFY_ASSETS = ("trajectory_splits", "label_matrix", "capability_stats", "selected_capabilities")
SCHEDULE_NAME = "nightly_reidentification"
AUTOMATION_SENSOR_NAME = "trace_automation"


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
