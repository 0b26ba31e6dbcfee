"""The lineage of one capability's adapter, assembled from the three stores that hold it.

``audit(capability, instance, registry)`` returns a plain dict (``trace audit <cap> --json`` prints
it as is):

* ``mlflow``: registered model, version, aliases, lineage tags, training run id, params and last
  metrics (MLflow registry);
* ``environment``: EnvSpec hash and path, calibration rounds, isolation (``synthetic_env`` metadata);
* ``selection``: Delta, Cov, runs passed, the thresholds in force, whether it is in the current C*,
  and the failed trajectory ids that justified it (``capability_spec`` / ``selected_capabilities``);
* ``dagster_runs``: the run id of the latest materialization of every step for this capability.

Every missing link is reported as ``None`` with the reason in ``problems``; the audit never raises
for an incomplete chain, because auditing a half-built pipeline is a normal thing to do.
"""

from __future__ import annotations

from typing import Any

from dagster import AssetKey, AssetRecordsFilter, DagsterInstance

STEPS = ("task_splits", "base_agent", "base_trajectories", "trajectory_splits", "capability_dictionary",
         "label_matrix", "capability_stats", "selected_capabilities")
PARTITIONED_STEPS = ("capability_spec", "synthetic_env", "lora_adapter")


def _latest(instance: DagsterInstance, key: str, partition: str | None = None):
    if partition is None:
        return instance.get_latest_materialization_event(AssetKey(key))
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=AssetKey(key), asset_partitions=[partition]), limit=1
    ).records
    return records[0].event_log_entry if records else None


def _metadata(event) -> dict[str, Any]:
    if event is None:
        return {}
    return {k: v.value for k, v in event.asset_materialization.metadata.items()}


def audit(capability: str, instance: DagsterInstance, registry: Any) -> dict[str, Any]:
    problems: list[str] = []
    runs = {key: getattr(_latest(instance, key), "run_id", None) for key in STEPS}
    runs.update({key: getattr(_latest(instance, key, capability), "run_id", None) for key in PARTITIONED_STEPS})
    for key, run_id in runs.items():
        if run_id is None:
            problems.append(f"{key}: never materialized" + (f" for {capability}" if key in PARTITIONED_STEPS else ""))

    spec_md = _metadata(_latest(instance, "capability_spec", capability))
    selected_md = _metadata(_latest(instance, "selected_capabilities"))
    justification = spec_md.get("justification") or {}
    selection = {
        "in_current_c_star": capability in (selected_md.get("c_star") or []),
        "delta_mean": justification.get("delta_mean"), "cov_mean": justification.get("cov_mean"),
        "runs_passed": justification.get("runs_passed"), "runs": justification.get("runs"),
        "thresholds": selected_md.get("thresholds"),
        "failed_trajectory_ids": justification.get("example_failed_trajectory_ids", []),
        "spec_hash": spec_md.get("spec_hash"), "dictionary_version": selected_md.get("dictionary_version"),
    }
    env_md = _metadata(_latest(instance, "synthetic_env", capability))
    environment = {
        "envspec_hash": env_md.get("spec_hash"), "spec_path": env_md.get("spec_path"),
        "calibrated": env_md.get("calibrated"), "calibration_rounds": env_md.get("calibration_rounds"),
        "calibration": env_md.get("calibration"), "isolation": env_md.get("isolation"),
    }
    adapter_md = _metadata(_latest(instance, "lora_adapter", capability))
    mlflow: dict[str, Any] = {"model_name": adapter_md.get("model_name"), "model_version": adapter_md.get("model_version")}
    if adapter_md:
        try:
            client = registry.client()
            version = client.get_model_version(adapter_md["model_name"], str(adapter_md["model_version"]))
            run = client.get_run(version.run_id)
            mlflow.update({
                "aliases": list(version.aliases), "tags": dict(version.tags), "run_id": version.run_id,
                "source": version.source, "params": dict(run.data.params), "metrics": dict(run.data.metrics),
            })
        except Exception as exc:  # the MLflow store may be elsewhere or pruned: report, don't crash
            problems.append(f"mlflow: {type(exc).__name__}: {exc}")
        mlflow["reward_before"] = adapter_md.get("reward_before")
        mlflow["reward_after"] = adapter_md.get("reward_after")
        mlflow["success_null"] = adapter_md.get("success_null")
        mlflow["promoted"] = adapter_md.get("promoted")
        mlflow["promotion_reason"] = adapter_md.get("promotion_reason")
        mlflow["fidelity"] = adapter_md.get("fidelity")
        if mlflow.get("tags") and mlflow["tags"].get("trace.envspec_hash") != environment["envspec_hash"]:
            problems.append("the registered adapter was trained on another EnvSpec than the latest synthetic_env")
    return {"capability": capability, "mlflow": mlflow, "environment": environment, "selection": selection,
            "dagster_runs": runs, "problems": problems}


def render(report: dict[str, Any]) -> str:
    """The audit as readable text (for the CLI)."""
    sel, env, ml = report["selection"], report["environment"], report["mlflow"]
    fmt = lambda v: "—" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
    lines = [
        f"Capability: {report['capability']}  (in current C*: {fmt(sel['in_current_c_star'])})",
        "",
        "MLflow",
        f"  model {fmt(ml.get('model_name'))} version {fmt(ml.get('model_version'))} aliases {fmt(ml.get('aliases'))}",
        f"  training run {fmt(ml.get('run_id'))}",
        f"  metrics {fmt({k: round(v, 4) for k, v in (ml.get('metrics') or {}).items()})}",
        f"  reward on held-out synthetic seeds: before {fmt(ml.get('reward_before'))} after {fmt(ml.get('reward_after'))}",
        f"  promoted to champion: {fmt(ml.get('promoted'))}: {fmt(ml.get('promotion_reason'))}",
        f"  fidelity of the evaluation path: {fmt(ml.get('fidelity'))}",
        "Environment",
        f"  EnvSpec {fmt(env['envspec_hash'])} at {fmt(env['spec_path'])}",
        f"  calibrated {fmt(env['calibrated'])} in {fmt(env['calibration_rounds'])} round(s); isolation {fmt(env['isolation'])}",
        "Selection",
        f"  Δ {fmt(sel['delta_mean'])}  Cov {fmt(sel['cov_mean'])}  runs passed {fmt(sel['runs_passed'])}/{fmt(sel['runs'])}",
        f"  thresholds {fmt(sel['thresholds'])}",
        f"  justified by failed trajectories: {', '.join(sel['failed_trajectory_ids']) or '—'}",
        "Dagster runs",
        *[f"  {key:<22} {fmt(run_id)}" for key, run_id in report["dagster_runs"].items()],
    ]
    if report["problems"]:
        lines += ["Problems", *[f"  ! {p}" for p in report["problems"]]]
    return "\n".join(lines)
