"""Step 1 assets: capability_dictionary -> label_matrix -> capability_stats -> selected_capabilities
(C*) -> capability_spec (partitioned by capability; the firewall).

Staleness is designed so that changing delta or rho re-materializes only ``selected_capabilities``:
the thresholds live in its ``code_version`` and nowhere upstream, it makes no analyst call, and a
capability whose spec did not change keeps the same ``capability_spec`` data version, so nothing
downstream of it becomes stale.
"""


from typing import Any

import polars as pl
from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    AutomationCondition,
    AssetCheckSpec,
    DataVersion,
    DynamicPartitionsDefinition,
    Failure,
    MetadataValue,
    Output,
    asset,
    asset_check,
)

from resources.llm import AnalystResource
from resources.store import TraceStore
from trace_assets.identify.capabilities import Capability, dictionary_version
from trace_assets.identify.labelling import label_trajectories, train_trajectories
from trace_assets.identify.stats import aggregate, select
from trace_assets.figures import delta_cov_scatter, png_metadata, to_markdown
from trace_assets.hashing import stable_hash
from trace_assets.settings import Settings

GROUP = "identify"
capability_partitions = DynamicPartitionsDefinition(name="capability")

# Per-capability assets re-materialize when they become missing (a new capability) or when one of
# their inputs got a NEW data version, not on every upstream materialization: the firewall holds.
per_capability_automation = (
    (AutomationCondition.missing().newly_true() | AutomationCondition.any_deps_match(AutomationCondition.data_version_changed()))
    .since_last_handled()
    & ~AutomationCondition.any_deps_missing()
    & ~AutomationCondition.any_deps_in_progress()
    & ~AutomationCondition.in_progress()
).with_label("new or inputs' data version changed")


def analyst_identity(settings: Settings) -> dict[str, Any]:
    """What makes two analysts interchangeable: kind, model and prompt version (not the key)."""
    a = settings.analyst
    identity: dict[str, Any] = {"kind": a.kind}
    if a.kind == "llm":
        from trace_assets.identify.llm_analyst import prompts_hash

        identity.update(model=a.model, temperature=a.temperature, prompts=prompts_hash())
    return identity


def _outcomes(splits: dict[str, list[str]]) -> pl.DataFrame:
    return pl.DataFrame(
        {"trajectory_id": splits["d_plus"] + splits["d_minus"],
         "success": [True] * len(splits["d_plus"]) + [False] * len(splits["d_minus"])},
        schema={"trajectory_id": pl.String, "success": pl.Boolean},
    )


def build_identify_assets(settings: Settings) -> list:
    rule = settings.selection_rule()
    n_runs = settings.analyst.n_runs
    identity = analyst_identity(settings)

    @asset(group_name=GROUP, code_version=stable_hash(identity), kinds={"python"})
    def capability_dictionary(
        context: AssetExecutionContext, analyst: AnalystResource, store: TraceStore, trajectory_splits: dict
    ) -> Output[dict[str, Any]]:
        """Phase 1: the analyst induces at most 10 capabilities from D+ and D-.

        Versioned by a hash of its content; labels are keyed by that version.
        """
        impl = analyst.build()
        d_plus = train_trajectories(store, trajectory_splits["d_plus"])
        d_minus = train_trajectories(store, trajectory_splits["d_minus"])
        capabilities = impl.induce(d_plus, d_minus)
        version = dictionary_version(capabilities)
        table = pl.DataFrame([
            {"name": c.name, "description": c.description, "failure_modes": "; ".join(c.failure_modes),
             "examples": ", ".join(c.example_trajectory_ids[:3])}
            for c in capabilities
        ]) if capabilities else pl.DataFrame()
        return Output(
            {"version": version, "analyst": impl.name, "capabilities": [c.to_dict() for c in capabilities]},
            data_version=DataVersion(version),
            metadata={
                "dictionary_version": version, "analyst": impl.name, "n_capabilities": len(capabilities),
                "analyst_calls": impl.calls,
                "capabilities": MetadataValue.md(to_markdown(table) if capabilities else "_none_"),
            },
        )

    @asset(
        group_name=GROUP, code_version=stable_hash([identity, n_runs]), kinds={"duckdb"},
        check_specs=[AssetCheckSpec("label_completeness", asset="label_matrix", blocking=True,
                                    description="Every trajectory x capability x run is labelled.")],
    )
    def label_matrix(
        context: AssetExecutionContext, analyst: AnalystResource, store: TraceStore,
        trajectory_splits: dict, capability_dictionary: dict,
    ):
        """Phase 2: NA / PRESENT / LACKING for every (trajectory, capability, run), in DuckDB ``labels``.

        Incremental: only keys not yet labelled for the current dictionary version go to the
        analyst. Invalid analyst output is retried, then recorded in ``label_errors``; the asset
        fails, naming trajectories and capabilities, when errors exceed ``max_error_share``.
        """
        impl = analyst.build()
        version = capability_dictionary["version"]
        capabilities = [Capability.from_dict(c) for c in capability_dictionary["capabilities"]]
        ids = trajectory_splits["d_plus"] + trajectory_splits["d_minus"]
        run = label_trajectories(impl, store, capabilities, ids, n_runs, version, log=context.log.info)
        problem = run.failure(settings.analyst.max_error_share)
        if problem:
            raise Failure(problem)
        labelled = store.label_summary(version, ids)
        yield Output(
            {"dictionary_version": version, "runs": n_runs, "n_labels": labelled["n"]},
            data_version=DataVersion(stable_hash([version, labelled["hash"]])),
            metadata={
                "analyst_calls": impl.calls, "pairs_sent": run.pairs_sent, "labels_reused": run.labels_reused,
                "labels": labelled["n"], "expected_labels": run.expected, "errors": len(run.errors),
                "label_counts": MetadataValue.md(to_markdown(labelled["counts"])),
            },
        )
        yield AssetCheckResult(
            check_name="label_completeness", passed=labelled["n"] == run.expected,
            metadata={"labelled": labelled["n"], "expected": run.expected},
        )

    @asset(group_name=GROUP, kinds={"duckdb", "polars"})
    def capability_stats(
        context: AssetExecutionContext, store: TraceStore, trajectory_splits: dict,
        capability_dictionary: dict, label_matrix: dict,
    ) -> Output[dict[str, pl.DataFrame]]:
        """ER+, ER-, Delta, Cov and the six counts per run and capability (SQL in DuckDB), and
        their mean and std over runs. Thresholds are not applied here (see selected_capabilities)."""
        runs = store.capability_run_stats(capability_dictionary["version"], _outcomes(trajectory_splits))
        summary = aggregate(runs) if runs.height else pl.DataFrame()
        metadata: dict[str, Any] = {
            "per_run": MetadataValue.md(to_markdown(runs.drop("total_failed", "total_passed")) if runs.height else "_no labels_"),
            "summary": MetadataValue.md(to_markdown(summary) if summary.height else "_no labels_"),
            "total_failed": len(trajectory_splits["d_minus"]), "total_passed": len(trajectory_splits["d_plus"]),
        }
        if summary.height:
            metadata.update(png_metadata(delta_cov_scatter(summary, title="Δ against Cov"), "delta_cov_scatter"))
        return Output(
            {"runs": runs, "summary": summary},
            data_version=DataVersion(stable_hash(runs.to_dicts())),
            metadata=metadata,
        )

    @asset(
        group_name=GROUP, code_version=stable_hash(rule.__dict__), kinds={"python"},
        check_specs=[AssetCheckSpec("c_star_not_empty", asset="selected_capabilities",
                                    description="Warns when no capability clears the thresholds.")],
    )
    def selected_capabilities(context: AssetExecutionContext, capability_stats: dict, capability_dictionary: dict):
        """C*: capabilities with Delta >= delta and Cov >= rho in at least K of N runs (or the
        significance alternative, reported side by side). Registers their ``capability`` partitions.

        Data version = hash(C*): the selected names and their specs.
        """
        runs, summary = capability_stats["runs"], capability_stats["summary"]
        chosen = select(rule, runs) if runs.height else pl.DataFrame(schema={"capability": pl.String, "selected": pl.Boolean})
        by_name = {c["name"]: Capability.from_dict(c) for c in capability_dictionary["capabilities"]}
        table = summary.join(chosen, on="capability", how="left") if summary.height else chosen
        selected = []
        for row in table.filter(pl.col("selected")).sort("capability").iter_rows(named=True):
            cap = by_name[row["capability"]]
            failed_ids = cap.example_trajectory_ids
            selected.append({
                **cap.spec(),
                "justification": {
                    "delta_mean": row["delta_mean"], "cov_mean": row["cov_mean"],
                    "runs_passed": row["runs_passed"], "runs": row["runs"],
                    "example_failed_trajectory_ids": failed_ids,
                },
            })
        names = [c["name"] for c in selected]
        existing = set(context.instance.get_dynamic_partitions(capability_partitions.name))
        new = [n for n in names if n not in existing]
        if new:
            context.instance.add_dynamic_partitions(capability_partitions.name, new)
            context.log.info(f"registered capability partitions: {new}")
        c_star_hash = stable_hash([{k: v for k, v in c.items() if k != "justification"} for c in selected])
        deferred = sorted(table.filter(pl.col("deferred"))["capability"].to_list()) if "deferred" in table.columns else []
        metadata = {
            "c_star": MetadataValue.json(names), "n_selected": len(names), "deferred": MetadataValue.json(deferred),
            "thresholds": MetadataValue.json(rule.__dict__),
            "selection": MetadataValue.md(to_markdown(table) if table.height else "_no capabilities_"),
            "dictionary_version": capability_dictionary["version"],
        }
        if summary.height:
            metadata.update(png_metadata(
                delta_cov_scatter(table, delta=rule.delta if rule.method == "threshold" else None, rho=rule.rho,
                                  title=f"C* = {len(names)} selected (green)"), "selection_scatter"))
        yield Output(
            {"capabilities": selected, "names": names, "deferred": deferred, "rule": rule.__dict__,
             "dictionary_version": capability_dictionary["version"]},
            data_version=DataVersion(c_star_hash), metadata=metadata,
        )
        yield AssetCheckResult(
            check_name="c_star_not_empty", passed=bool(names), severity=AssetCheckSeverity.WARN,
            description=None if names else "no capability cleared the thresholds: nothing will be trained",
        )

    @asset(group_name=GROUP, partitions_def=capability_partitions, kinds={"json"},
           automation_condition=per_capability_automation)
    def capability_spec(context: AssetExecutionContext, selected_capabilities: dict, capability_dictionary: dict) -> Output[dict[str, Any]]:
        """One capability's spec (name, description, failure modes): the firewall of DESIGN.md.

        Its data version hashes this capability's spec alone, so a change elsewhere in C* leaves it,
        and everything trained from it, fresh. A capability that left C* keeps its partition and
        history; it is marked ``selected: false`` in metadata and no longer routed to.
        """
        name = context.partition_key
        chosen = {c["name"]: c for c in selected_capabilities["capabilities"]}
        known = {c["name"]: Capability.from_dict(c) for c in capability_dictionary["capabilities"]}
        if name in chosen:
            entry = chosen[name]
            spec = {k: entry[k] for k in ("name", "description", "failure_modes")}
            justification = entry["justification"]
            examples = justification["example_failed_trajectory_ids"]
        elif name in known:
            spec, justification = known[name].spec(), None
            examples = known[name].example_trajectory_ids
        else:
            raise Failure(f"capability {name!r} is in neither C* nor the current dictionary; its history is kept")
        # Example ids and the dictionary version (its labels' key) travel with the spec for Step 2 but
        # stay out of the data version: new examples of the same capability must not make its
        # environment or adapter stale.
        return Output(
            {**spec, "example_trajectory_ids": examples, "selected": name in chosen,
             "dictionary_version": capability_dictionary["version"]},
            data_version=DataVersion(stable_hash(spec)),
            metadata={
                "selected": name in chosen, "spec_hash": stable_hash(spec),
                "c_star_data_version": stable_hash(selected_capabilities["names"]),
                "justification": MetadataValue.json(justification or {}),
                "thresholds": MetadataValue.json(selected_capabilities["rule"]),
            },
        )

    @asset_check(asset=capability_stats, description="Every rate is in [0, 1] and the counts add up to |F| and |P|.")
    def stats_sanity(capability_stats: dict) -> AssetCheckResult:
        problems = []
        for row in capability_stats["runs"].iter_rows(named=True):
            where = f"{row['capability']} run {row['run']}"
            for col in ("er_minus", "er_plus", "cov"):
                if not 0.0 <= row[col] <= 1.0:
                    problems.append(f"{where}: {col}={row[col]}")
            if row["lacking_f"] + row["present_f"] + row["na_f"] != row["total_failed"]:
                problems.append(f"{where}: F counts do not add up to |F|={row['total_failed']}")
            if row["lacking_p"] + row["present_p"] + row["na_p"] != row["total_passed"]:
                problems.append(f"{where}: P counts do not add up to |P|={row['total_passed']}")
            if abs(row["delta"] - (row["er_minus"] - row["er_plus"])) > 1e-9:
                problems.append(f"{where}: delta != er_minus - er_plus")
        return AssetCheckResult(passed=not problems, metadata={"problems": MetadataValue.json(problems[:20])})

    return [capability_dictionary, label_matrix, capability_stats, selected_capabilities, capability_spec, stats_sanity]
