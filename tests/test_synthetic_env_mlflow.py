"""synthetic_env logs its isolation matrix to MLflow: the table, the heatmap PNG, every row, and the
blocking check's verdicts, in a run tagged with the spec hash (the tiny model, a real local store)."""

from __future__ import annotations

import dataclasses
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


class _NoExpert:
    """The retail target as a user environment: the Environment protocol and none of the target hooks."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name

    def __getattr__(self, attribute):
        if attribute in ("tool_schemas", "system_prompt", "families", "make_task", "start", "sample_tasks"):
            return getattr(self.inner, attribute)
        raise AttributeError(attribute)


def test_a_target_without_an_expert_gets_logged_decision_points(tmp_path, monkeypatch, tiny_model_path):
    """synthetic_env on a user environment: episodes open at the labelled LACKING steps of its logged
    train trajectories; a log that does not replay is quarantined; the weaker isolation measure, the
    calibration round and the spec reach the metadata and MLflow. The tiny random model never solves
    an episode, so the blocking check fails, and says the groups are not informative."""
    import copy
    from datetime import datetime, timezone

    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path))
    from resources.llm import SynthesizerResource
    from resources.mlflow_registry import MlflowRegistry
    from resources.models import ModelResource
    from resources.store import TraceStore
    import trace_assets.assets.synthesize as synthesize_assets
    from trace_assets.envs import get_environment
    from trace_assets.envs.retail.expert import demonstrate
    from trace_assets.identify.capabilities import Capability
    from trace_assets.identify.heuristic import RULES, HeuristicAnalyst
    from trace_assets.settings import PROFILES
    from trace_assets.synthesize.build import LOGGED_WEAKER

    retail = get_environment("retail")
    target = _NoExpert(retail)
    monkeypatch.setattr(synthesize_assets, "get_environment", lambda name: target)
    store, now = TraceStore(), datetime.now(timezone.utc).isoformat()
    records, rows = [], []
    for seed in range(20):
        task = retail.make_task(("cancel_pending", "modify_address", "return_delivered")[seed % 3], seed)
        messages, result = demonstrate(retail, task, lacking=CAP)
        records.append({"trajectory_id": f"log-{seed:02d}", "task_id": task.task_id, "env": "retail", "split": "train",
                        "policy": "base", "messages": messages, "reward": result.reward, "success": result.success,
                        "info": result.info, "source": "import", "created_at": now, "agent_id": ""})
    tampered = copy.deepcopy(records[0])
    tampered["trajectory_id"] = "log-tampered"
    tampered["messages"][next(i for i, m in enumerate(tampered["messages"]) if m["role"] == "tool")]["content"] = "{}"
    test_row = {**copy.deepcopy(records[1]), "trajectory_id": "log-test", "split": "test"}  # never a decision point
    store.insert_trajectories(records + [tampered, test_row], batch_name="logged")
    capability = Capability(CAP, RULES[CAP].description)
    for record in records + [tampered, test_row]:
        [label] = HeuristicAnalyst().label(record, [capability], 0)
        rows.append((record["trajectory_id"], CAP, 0, label.label, label.rationale, label.step))
    store.insert_labels(rows, analyst="heuristic", version="dict-v")

    [asset_def] = synthesize_assets.build_synthesize_assets(PROFILES["tiny"])
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("capability", [CAP])
        context = build_asset_context(partition_key=CAP, instance=instance)
        spec_of = {"name": CAP, "description": RULES[CAP].description, "failure_modes": [],
                   "example_trajectory_ids": [], "dictionary_version": "dict-v"}
        events = list(asset_def.op.compute_fn.decorated_fn(
            context, synthesizer=SynthesizerResource(), store=store, mlflow=MlflowRegistry(),
            models=ModelResource(base_model="tiny", generation_backend="transformers"),
            capability_spec=spec_of, base_agent={"path": str(tiny_model_path), "checksum": None}))
    output = next(e for e in events if isinstance(e, Output))
    check = next(e for e in events if isinstance(e, AssetCheckResult))
    value = output.value
    spec = json.loads(Path(value["spec_path"]).read_text())
    assert spec["kind"] == "logged_prefixes" and value["env_name"] == f"logged_{CAP}"
    assert sorted(p["trajectory_id"] for p in spec["prefixes"]) == [r["trajectory_id"] for r in records]
    assert [line.split(":")[0] for line in value["rejected_specs"]] == ["quarantined log-tampered"]
    iso = value["isolation"]
    assert iso["method"] == LOGGED_WEAKER and iso["passed"] and iso["rows"][0]["success"] == 0.0
    assert output.metadata["synthesizer"].value == "logged decision points"
    assert check.passed and [r["direction"] for r in value["calibration"]["rounds"]] == ["none"]  # tiny: any band
    run = MlflowRegistry().client().get_run(output.metadata["mlflow_run_id"].value)
    assert run.data.params["isolation_method"] == LOGGED_WEAKER and run.data.metrics["check_passed"] == 1.0

    # Step 3 trains on it: GRPO on train-side prefixes, the fidelity probe on logged conversations,
    # the held-out comparison on the held-out prefixes, each once; then the target guard plays the
    # target's train tasks of the families where the labels (of the env's dictionary) say LACKING.
    import trace_assets.assets.train as train_assets

    monkeypatch.setattr(train_assets, "get_environment", lambda name: target)
    held_out = [p["trajectory_id"] for p in spec["prefixes"] if p["side"] == "held_out"]
    assert value["dictionary_version"] == "dict-v"
    logged_tasks = [retail.make_task(("cancel_pending", "modify_address", "return_delivered")[seed % 3], seed)
                    for seed in range(20)]  # the logs' tasks, as above
    train_tasks = [retail.make_task("order_status", 7_000), *logged_tasks]
    lacking = sorted({t.family for t, r in zip(logged_tasks, records)
                      if any(row[0] == r["trajectory_id"] and row[3] == "LACKING" for row in rows)})
    assert len(lacking) >= 2
    with DagsterInstance.ephemeral() as instance:
        context = build_asset_context(partition_key=CAP, instance=instance)
        adapter = train_assets.train_capability_adapter(
            context, PROFILES["tiny"], CAP, models=ModelResource(base_model="tiny", generation_backend="transformers"),
            mlflow=MlflowRegistry(), store=store, synthetic_env=value, task_splits={"train": [t.to_dict() for t in train_tasks]},
            base_agent={"path": str(tiny_model_path), "checksum": None})
    assert adapter.value["rollouts"] > 0 and Path(adapter.value["adapter_dir"]).is_dir()
    assert adapter.value["reward_before"]["n"] == adapter.value["reward_after"]["n"] == min(PROFILES["tiny"].train.eval_tasks, len(held_out))
    guard = adapter.value["target_guard"]
    assert guard["lacking_families"] == lacking  # order_status: no LACKING log there
    first = {f: next(t.task_id for t in logged_tasks if t.family == f) for f in lacking}
    assert guard["task_ids"] == [first[lacking[0]], first[lacking[1]]]  # guard_tasks 2: LACKING families first, in turn
    assert guard["base"]["n"] == guard["adapter"]["n"] == 2
    outcomes = adapter.value["promotion"]["target_guard"]
    assert set(outcomes) == {"success", "success_lacking_families", "state_match", "info_communicated", "confirmed_writes"}
    assert outcomes["success"]["applicable"] == outcomes["success_lacking_families"]["applicable"] == 2
    assert "\n| state_match " in adapter.metadata["target_guard"].value

    # The same logs, a setting that asks for informative groups: the random model gives none, and the check says so.
    strict = dataclasses.replace(PROFILES["tiny"], synthesis=dataclasses.replace(PROFILES["tiny"].synthesis, min_informative=0.5))
    [asset_def] = synthesize_assets.build_synthesize_assets(strict)
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("capability", [CAP])
        events = list(asset_def.op.compute_fn.decorated_fn(
            build_asset_context(partition_key=CAP, instance=instance), synthesizer=SynthesizerResource(), store=store,
            mlflow=None, models=ModelResource(base_model="tiny", generation_backend="transformers"),
            capability_spec=spec_of, base_agent={"path": str(tiny_model_path), "checksum": None}))
    check = next(e for e in events if isinstance(e, AssetCheckResult))
    assert not check.passed and "of the groups are informative" in check.description
