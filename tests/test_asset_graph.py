"""Snapshot of the asset graph: an edge that appears or disappears is a design change to review."""

from __future__ import annotations

from trace_assets.settings import TINY

EXPECTED = {
    "task_splits": [],
    "base_agent": ["task_splits"],
    "base_trajectories": ["base_agent", "task_splits"],
    "trajectory_splits": ["base_trajectories"],
    "capability_dictionary": ["trajectory_splits"],
    "label_matrix": ["capability_dictionary", "trajectory_splits"],
    "capability_stats": ["capability_dictionary", "label_matrix", "trajectory_splits"],
    "selected_capabilities": ["capability_dictionary", "capability_stats"],
    "capability_spec": ["capability_dictionary", "selected_capabilities"],
    "synthetic_env": ["base_agent", "capability_spec"],
    "lora_adapter": ["base_agent", "synthetic_env", "task_splits"],
    "grpo_baseline": ["base_agent", "lora_adapter", "selected_capabilities", "synthetic_env", "task_splits"],
    "router": ["base_agent", "lora_adapter", "selected_capabilities", "synthetic_env", "trajectory_splits"],
    "router_eval": ["base_agent", "grpo_baseline", "lora_adapter", "router", "selected_capabilities", "task_splits"],
    "experiment_env": ["base_agent", "capability_spec"],
    "experiment_adapter": ["base_agent", "experiment_env", "task_splits"],
    "experiment_baselines": ["base_agent", "experiment_adapter", "experiment_env", "selected_capabilities", "task_splits"],
    "experiment_eval": ["base_agent", "experiment_adapter", "experiment_baselines", "experiment_env", "selected_capabilities",
                        "task_splits", "trajectory_splits"],
    "experiment_report": ["experiment_adapter", "experiment_eval", "selected_capabilities", "task_splits"],
}
PARTITIONED = {"capability_spec", "synthetic_env", "lora_adapter", "experiment_env", "experiment_adapter",
               "experiment_baselines", "experiment_eval"}
CHECKS = {("label_matrix", "label_completeness"), ("capability_stats", "stats_sanity"), ("selected_capabilities", "c_star_not_empty"),
          ("synthetic_env", "calibration_and_fidelity")}


def test_asset_graph_snapshot():
    from trace_assets.definitions import build_definitions

    defs = build_definitions(TINY)
    graph = defs.resolve_asset_graph()
    edges = {
        key.to_user_string(): sorted(p.to_user_string() for p in graph.get(key).parent_keys)
        for key in graph.materializable_asset_keys
    }
    assert edges == EXPECTED
    partitioned = {k.to_user_string() for k in graph.materializable_asset_keys if graph.get(k).partitions_def}
    assert partitioned == PARTITIONED
    checks = {(c.asset_key.to_user_string(), c.name) for c in graph.asset_check_keys}
    assert checks == CHECKS


def test_the_experiment_has_its_own_job_and_the_demo_never_runs_it():
    from trace_assets.assets.experiment import EXPERIMENT_JOB, EXPERIMENT_SELECTION, EXPERIMENT_TRAINING_JOB
    from trace_assets.definitions import MAIN_JOB, build_definitions
    from trace_assets.orchestrate import job_asset_keys

    defs = build_definitions(TINY)
    experiment = {k for k in EXPECTED if k.startswith("experiment_")}
    main = {k.to_user_string() for k in job_asset_keys(defs, MAIN_JOB)}
    assert main == set(EXPECTED) - experiment
    ran = {k.to_user_string() for k in job_asset_keys(defs, EXPERIMENT_SELECTION)}
    assert experiment <= ran and not ran & {"grpo_baseline", "router", "router_eval", "synthetic_env", "lora_adapter"}
    jobs = {k.to_user_string() for name in (EXPERIMENT_JOB, EXPERIMENT_TRAINING_JOB) for k in job_asset_keys(defs, name)}
    assert jobs == experiment
    graph = defs.resolve_asset_graph()
    seeds = {str(s) for s in TINY.experiment.seeds}
    from dagster import AssetKey

    assert set(graph.get(AssetKey("experiment_eval")).partitions_def.get_partition_keys()) == seeds


def test_all_partition_inputs_are_keyed_by_partition_for_one_and_for_many(tmp_path):
    """Dagster's filesystem IO manager hands an ALL-mapped input over bare when exactly one upstream
    partition exists (a C* of one capability, the demo's case): Step 4 assets must still see
    ``{capability: value}``. This once failed the demo's ``grpo_baseline``: "no adapter"."""
    from dagster import AssetIn, DynamicPartitionsDefinition, FilesystemIOManager, asset, instance_for_test, materialize

    from trace_assets.assets.route import ALL, EVERY_TRAINED, by_partition

    caps = DynamicPartitionsDefinition(name="caps")
    seen: list[dict] = []

    @asset(partitions_def=caps)
    def upstream(context):  # no annotations: this module has `from __future__ import annotations`
        return {"capability": context.partition_key}

    @asset(ins={"upstream": AssetIn(partition_mapping=ALL, metadata=EVERY_TRAINED)})
    def downstream(context, upstream):
        seen.append(by_partition(context, "upstream", upstream))

    resources = {"io_manager": FilesystemIOManager(base_dir=str(tmp_path / "io"))}
    # instance_for_test: telemetry off and nothing written under $DAGSTER_HOME (the repository).
    with instance_for_test() as instance:
        for names in (["only_one"], ["only_one", "and_another"]):
            instance.add_dynamic_partitions("caps", names)
            for name in names:
                assert materialize([upstream], partition_key=name, instance=instance, resources=resources).success
            assert materialize([upstream, downstream], selection=[downstream], instance=instance, resources=resources).success
            assert seen[-1] == {name: {"capability": name} for name in names}
