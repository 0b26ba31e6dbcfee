"""The per-capability automation condition, evaluated by Dagster's own evaluator.

A miniature of the real graph (C* -> capability_spec[c] -> synthetic_env[c]) carries the real
condition and the real dynamic partitions: a partition is requested when it is new or when one of
its inputs got a NEW data version, and not when an input merely re-materialized unchanged.
"""

from __future__ import annotations

from dagster import (
    AssetKey, DagsterInstance, DataVersion, Output, asset, evaluate_automation_conditions, materialize,
)

from trace_assets.assets.identify import capability_partitions, per_capability_automation

VERSIONS: dict[str, str] = {}


@asset(name="selected_capabilities")
def c_star() -> Output[int]:
    return Output(0, data_version=DataVersion(VERSIONS.get("c_star", "v0")))


@asset(name="capability_spec", partitions_def=capability_partitions, automation_condition=per_capability_automation,
       deps=["selected_capabilities"])
def spec(context) -> Output[int]:
    return Output(0, data_version=DataVersion(VERSIONS.get(context.partition_key, "s0")))


@asset(name="synthetic_env", partitions_def=capability_partitions, automation_condition=per_capability_automation,
       deps=["capability_spec"])
def env(context) -> Output[int]:
    return Output(0, data_version=DataVersion("e0"))


ASSETS = [c_star, spec, env]
SPEC, ENV = AssetKey("capability_spec"), AssetKey("synthetic_env")


def test_requests_only_partitions_whose_inputs_changed():
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("capability", ["a", "b"])
    materialize([c_star], instance=instance)
    for pk in ("a", "b"):
        materialize(ASSETS, selection=["capability_spec", "synthetic_env"], partition_key=pk, instance=instance)
    result = evaluate_automation_conditions(defs=ASSETS, instance=instance)
    cursor = result.cursor
    result = evaluate_automation_conditions(defs=ASSETS, instance=instance, cursor=cursor)
    assert result.total_requested == 0, "everything is materialized and nothing changed"
    cursor = result.cursor

    # C* re-materialized with a new version: every spec is re-checked (cheap; the firewall) ...
    VERSIONS["c_star"] = "v1"
    materialize([c_star], instance=instance)
    result = evaluate_automation_conditions(defs=ASSETS, instance=instance, cursor=cursor)
    assert result.get_requested_partitions(SPEC) == {"a", "b"}
    assert result.get_num_requested(ENV) == 0
    cursor = result.cursor

    # ... spec "a" really changed, spec "b" came out identical: only env "a" is requested.
    VERSIONS["a"] = "s1"
    for pk in ("a", "b"):
        materialize(ASSETS, selection=["capability_spec"], partition_key=pk, instance=instance)
    result = evaluate_automation_conditions(defs=ASSETS, instance=instance, cursor=cursor)
    assert result.get_requested_partitions(ENV) == {"a"}
    assert result.get_num_requested(SPEC) == 0
    cursor = result.cursor

    # A new capability gets both of its partitions requested in one tick (Dagster runs them in
    # dependency order); the existing capabilities are left alone.
    instance.add_dynamic_partitions("capability", ["c"])
    result = evaluate_automation_conditions(defs=ASSETS, instance=instance, cursor=cursor)
    assert result.get_requested_partitions(SPEC) == {"c"}
    assert result.get_requested_partitions(ENV) == {"c"}
