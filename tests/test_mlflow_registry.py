"""MlflowRegistry against a real local SQLite store: run, params, metrics, artifacts, versions, aliases."""

from __future__ import annotations

from pathlib import Path

import pytest

from resources.mlflow_registry import MlflowRegistry, markdown_table, model_name

HISTORY = [
    {"iteration": 1, "mean_reward": 0.25, "success_rate": 0.0, "loss": 0.1, "clip_fraction": 0.0, "grad_norm": 1.5,
     "gen_time_s": 2.0, "opt_time_s": 1.0, "iter_time_s": 3.1},
    {"iteration": 2, "mean_reward": 0.5, "success_rate": 0.25, "loss": -0.05, "clip_fraction": 0.1, "grad_norm": 1.2,
     "gen_time_s": 2.1, "opt_time_s": 1.1, "iter_time_s": 3.3},
]
LINEAGE = {"c_star_version": "cstar-abc", "envspec_hash": "spec-123", "base_model": "tiny@sha256:0f0f",
           "dagster_run_id": "run-42"}


@pytest.fixture
def adapter_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 16}')
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    return folder


def test_default_store_lives_in_the_data_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path))
    registry = MlflowRegistry()
    assert registry.uri() == f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}"
    assert registry.artifact_location() == (tmp_path / "mlflow" / "artifacts").as_uri()


def test_log_training_registers_a_version_with_aliases_and_lineage(tmp_path, monkeypatch, adapter_dir):
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path))
    registry = MlflowRegistry()
    registered = registry.log_training(
        "confirm_before_writing", adapter_dir=adapter_dir,
        params={"grpo": {"learning_rate": 1e-4, "target_modules": ["q_proj", "v_proj"]}, "base_model": "tiny"},
        history=HISTORY, lineage=LINEAGE,
    )
    assert registered.name == model_name("confirm_before_writing") == "trace-lora-confirm_before_writing"
    assert registered.version == 1 and registered.aliases == ("champion",)

    client = registry.client()
    run = client.get_run(registered.run_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "trace"
    assert run.data.params["grpo.learning_rate"] == "0.0001"
    assert run.data.params["grpo.target_modules"] == "q_proj,v_proj"
    assert run.data.tags["trace.capability"] == "confirm_before_writing"
    assert run.data.tags["dagster.run_id"] == "run-42"
    rewards = client.get_metric_history(registered.run_id, "mean_reward")
    assert [(m.step, m.value) for m in rewards] == [(1, 0.25), (2, 0.5)]
    for key in ("success_rate", "loss", "clip_fraction", "grad_norm", "gen_time_s", "opt_time_s", "iter_time_s"):
        assert len(client.get_metric_history(registered.run_id, key)) == 2, key
    artifacts = {a.path for a in client.list_artifacts(registered.run_id)}
    assert {"adapter", "training_curve.png", "training.md"} <= artifacts
    assert {Path(a.path).name for a in client.list_artifacts(registered.run_id, "adapter")} == {
        "adapter_config.json", "adapter_model.safetensors"}
    assert registered.source.endswith("/adapter") and registered.source.startswith("file://")

    version = client.get_model_version(registered.name, "1")
    assert version.run_id == registered.run_id and version.source == registered.source
    assert version.tags["trace.envspec_hash"] == "spec-123"
    assert version.tags["trace.c_star_version"] == "cstar-abc"
    assert version.tags["trace.base_model"] == "tiny@sha256:0f0f"
    assert version.tags["dagster.run_id"] == "run-42"
    assert version.aliases == ["champion"]
    assert registry.resolve("confirm_before_writing", "latest")[0] == 1

    number, path = registry.resolve("confirm_before_writing", "champion")
    assert number == 1 and path.is_dir()
    assert (path / "adapter_model.safetensors").read_bytes() == b"weights"
    assert str(path).startswith(str(tmp_path / "mlflow" / "artifacts"))


def test_a_second_version_is_latest_while_champion_stays(tmp_path, adapter_dir):
    registry = MlflowRegistry(tracking_uri=f"sqlite:///{tmp_path / 'db.sqlite'}", artifact_root=str(tmp_path / "art"))
    first = registry.log_training("ground_arguments", adapter_dir=adapter_dir, params={}, history=HISTORY,
                                  lineage=LINEAGE)
    (adapter_dir / "adapter_model.safetensors").write_bytes(b"better")
    second = registry.log_training("ground_arguments", adapter_dir=adapter_dir, params={}, history=HISTORY[:1],
                                   lineage=LINEAGE, aliases=("latest", "challenger"))
    assert (first.version, second.version) == (1, 2)
    assert registry.resolve("ground_arguments", "latest")[0] == 2
    assert registry.resolve("ground_arguments", "challenger")[0] == 2
    number, path = registry.resolve("ground_arguments", "champion")
    assert number == 1 and (path / "adapter_model.safetensors").read_bytes() == b"weights"
    registry.set_alias("ground_arguments", "champion", 2)
    assert registry.resolve("ground_arguments", "champion")[0] == 2
    assert str(registry.artifact_location()).startswith((tmp_path / "art").as_uri())


def test_markdown_table_lists_every_iteration():
    table = markdown_table(HISTORY)
    lines = table.strip().splitlines()
    assert lines[0].startswith("| iteration | mean_reward | success_rate | loss")
    assert len(lines) == 2 + len(HISTORY) and lines[3].startswith("| 2 | 0.5 | 0.25")
