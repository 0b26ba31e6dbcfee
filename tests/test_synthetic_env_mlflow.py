"""synthetic_env logs its isolation matrix to MLflow: the table, the heatmap PNG, every row, and the
blocking check's verdicts, in a run tagged with the spec hash (the tiny model, a real local store)."""

from __future__ import annotations

import json
from pathlib import Path

from dagster import AssetCheckResult, DagsterInstance, Output, build_asset_context

CAP = "confirm_before_writing"


def test_synthetic_env_logs_its_isolation_matrix(tmp_path, monkeypatch, tiny_model_path):
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path))
    from resources.llm import SynthesizerResource
    from resources.mlflow_registry import MlflowRegistry
    from resources.models import ModelResource
    from resources.store import TraceStore
    from trace_assets.assets.synthesize import build_synthesize_assets
    from trace_assets.identify.heuristic import RULES
    from trace_assets.settings import PROFILES
    from trace_assets.synthesize import isolation_markdown

    [asset_def] = build_synthesize_assets(PROFILES["tiny"])
    registry = MlflowRegistry()
    rule = RULES[CAP]
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("capability", [CAP])
        context = build_asset_context(partition_key=CAP, instance=instance)
        events = list(asset_def.op.compute_fn.decorated_fn(
            context, synthesizer=SynthesizerResource(), store=TraceStore(), mlflow=registry,
            models=ModelResource(base_model="tiny", generation_backend="transformers"),
            capability_spec={"name": CAP, "description": rule.description, "failure_modes": [],
                             "example_trajectory_ids": []},
            base_agent={"path": str(tiny_model_path), "checksum": None}))
    output = next(e for e in events if isinstance(e, Output))
    check = next(e for e in events if isinstance(e, AssetCheckResult))
    iso = output.value["isolation"]
    run_id = output.metadata["mlflow_run_id"].value

    client = registry.client()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == f"synthetic-env-{CAP}"
    assert run.data.tags["trace.kind"] == "synthetic_env" and run.data.tags["trace.capability"] == CAP
    assert run.data.tags["trace.envspec_hash"] == output.value["spec_hash"]
    metrics = run.data.metrics
    assert metrics["isolation_passed"] == float(iso["passed"])
    assert metrics["check_passed"] == float(check.passed)
    for row in iso["rows"]:
        assert metrics[f"isolation.success.{row['agent']}"] == row["success"]
        assert metrics[f"isolation.mean_reward.{row['agent']}"] == row["mean_reward"]
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"isolation_matrix.md", "isolation_heatmap.png", "isolation.json", "calibration.json", "envspec.json"} <= artifacts
    folder = Path(client.download_artifacts(run_id, ""))
    assert (folder / "isolation_matrix.md").read_text().strip() == isolation_markdown([iso]).strip()
    assert (folder / "isolation_heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((folder / "isolation.json").read_text())["rows"] == iso["rows"]
    assert json.loads((folder / "envspec.json").read_text())["capability"]["name"] == CAP
