"""Experiment assets (``make experiment``): Steps 2-4 again for every training seed, then the report.

Step 1 (C*), the capability specs and the test split are shared; what a seed changes is every
training: calibration's sampling, GRPO's sampling and LoRA initialization, the null control
(``Settings.for_seed``). The assets are thin: each calls the function its Step-2-4 counterpart
materializes with, under the seed's settings.

* ``experiment_env[capability|seed]`` and ``experiment_adapter[capability|seed]``: the capability's
  environment, calibrated with the seed, and its adapter (trained, null control, gate), registered
  in MLflow as ``experiment-seed<seed>-<capability>`` without any alias (``trace serve`` never
  serves them).
* ``experiment_baselines[seed]``: GRPO on the target at equal rollouts, and the ablation (GRPO at
  equal rollouts on the target families the seed's synthetic environments draw from, with the
  target's binary reward).
* ``experiment_eval[seed]``: the seed's router, and every system on the held-out test split
  (``route.evaluation.evaluate_systems``).
* ``experiment_report``: per-system success over the seeds with paired bootstrap intervals, the
  paired differences, the forest plot; ``<data>/reports/experiment.md`` (+ ``.json`` and the PNG)
  and one MLflow report run.

Every training folder is keyed by its inputs and checkpointed, so a killed experiment resumes where
it stopped, and ``make experiment`` (the demo's wave runner on ``experiment_job``) recomputes
nothing when nothing changed.
"""

import json
from typing import Any

from dagster import (
    AllPartitionMapping,
    AssetExecutionContext,
    AssetIn,
    AssetSelection,
    DataVersion,
    Failure,
    MetadataValue,
    MultiPartitionsDefinition,
    MultiToSingleDimensionPartitionMapping,
    Output,
    StaticPartitionsDefinition,
    asset,
)

from resources.llm import SynthesizerResource
from resources.mlflow_registry import MlflowRegistry
from resources.models import ModelResource
from resources.store import TraceStore
from trace_assets import paths, reports
from trace_assets.assets.identify import capability_partitions
from trace_assets.assets.route import (
    BINARY_REWARD,
    EVERY_TRAINED,
    build_router,
    by_partition,
    current_adapters,
    train_grpo_on_target,
)
from trace_assets.assets.synthesize import CALIBRATION_VERSION, make_synthetic_env
from trace_assets.assets.train import EVALUATION_VERSION, train_capability_adapter
from trace_assets.envs import get_environment
from trace_assets.envs.splits import tasks_of
from trace_assets.figures import png_metadata, to_markdown
from trace_assets.hashing import stable_hash
from trace_assets.identify.capabilities import checked_partition_key
from trace_assets.settings import Settings

GROUP = "experiment"
EXPERIMENT_JOB = "experiment_job"
EXPERIMENT_TRAINING_JOB = "experiment_training_job"
EXPERIMENT_PER_SEED = ("experiment_baselines", "experiment_eval", "experiment_report")
EXPERIMENT_PER_CAPABILITY_SEED = ("experiment_env", "experiment_adapter")
EXPERIMENT_SELECTION = AssetSelection.groups(GROUP).upstream()
"""What ``make experiment`` materializes (``orchestrate.run_stale``): the experiment and everything it reads."""
REPORT_VERSION = "experiment-report-v7"  # v5: what it cost (step durations, the machine); v6: the target's checks; v7: every materialization's cost


def registry_name(seed: int, system: str) -> str:
    """The MLflow model an experiment adapter is registered under (never the demo's)."""
    return f"experiment-seed{seed}-{system}"


def split_key(context: AssetExecutionContext) -> tuple[str, int]:
    """``(capability, seed)`` of a ``capability|seed`` partition, the capability checked as a path part."""
    key = context.partition_key
    keys = getattr(key, "keys_by_dimension", None) or dict(zip(("capability", "seed"), str(key).split("|")))
    return checked_partition_key(keys["capability"]), int(keys["seed"])


def by_capability(context: AssetExecutionContext, name: str, loaded: Any) -> dict[str, Any]:
    """A seed's input ``name`` mapped from its ``capability|seed`` partitions, as ``{capability: value}``."""
    def capability(key: Any) -> str:
        by_dimension = getattr(key, "keys_by_dimension", None)  # else its string: "<capability>|<seed>"
        return by_dimension["capability"] if by_dimension else str(key).split("|")[0]

    return {capability(k): v for k, v in by_partition(context, name, loaded).items()}


def spent_tokens(adapter: dict[str, Any]) -> int:
    """Generated tokens of an adapter's GRPO training (its curve's ``loss_tokens``); calibration's are not recorded."""
    return int(sum(row.get("loss_tokens", 0) for row in adapter.get("curve", [])))


def build_experiment_assets(settings: Settings) -> list:
    from trace_assets.agent.identity import planned_generation

    exp, syn = settings.experiment, settings.synthesis
    seeds = StaticPartitionsDefinition([str(s) for s in exp.seeds])
    per_capability_seed = MultiPartitionsDefinition({"capability": capability_partitions, "seed": seeds})
    to_seed = MultiToSingleDimensionPartitionMapping(partition_dimension_name="seed")
    to_capability = MultiToSingleDimensionPartitionMapping(partition_dimension_name="capability")
    generation = planned_generation(settings.generation)
    grpo_identity = settings.train.grpo.identity()  # the seed comes from the partition

    @asset(group_name=GROUP, partitions_def=per_capability_seed, kinds={"json"},
           code_version=stable_hash([syn.__dict__, settings.section_hash("rollout"), CALIBRATION_VERSION]),
           ins={"capability_spec": AssetIn(partition_mapping=to_capability)})
    def experiment_env(context: AssetExecutionContext, synthesizer: SynthesizerResource, models: ModelResource,
                       store: TraceStore, capability_spec: dict, base_agent: dict) -> Output[dict[str, Any]]:
        """The capability's environment, calibrated with this seed (as ``synthetic_env`` makes it)."""
        name, seed = split_key(context)
        value, metadata = make_synthetic_env(context, settings.for_seed(seed), name, seed, synthesizer=synthesizer,
                                             models=models, store=store, capability_spec=capability_spec,
                                             base_agent=base_agent)
        metadata["check"] = value["check"]["reason"]
        return Output(value, data_version=DataVersion(stable_hash([value["spec_hash"], value["check"]])), metadata=metadata)

    @asset(group_name=GROUP, partitions_def=per_capability_seed, pool="train", kinds={"pytorch", "mlflow"},
           code_version=stable_hash([grpo_identity, settings.train.eval_tasks, settings.train.promotion_alpha,
                                     settings.train.guard_tasks, generation, EVALUATION_VERSION]))
    def experiment_adapter(context: AssetExecutionContext, models: ModelResource, mlflow: MlflowRegistry,
                           store: TraceStore, experiment_env: dict, base_agent: dict,
                           task_splits: dict) -> Output[dict[str, Any]]:
        """The capability's adapter trained with this seed (as ``lora_adapter`` makes it), never aliased."""
        name, seed = split_key(context)
        if not experiment_env["check"]["passed"]:
            raise Failure(f"experiment_adapter[{name}|{seed}]: its environment failed its check "
                          f"({experiment_env['check']['reason']}); not training on it")
        return train_capability_adapter(context, settings.for_seed(seed), name, models=models, mlflow=mlflow,
                                        store=store, synthetic_env=experiment_env, base_agent=base_agent,
                                        task_splits=task_splits,
                                        registry_name=registry_name(seed, name), aliases_if_promoted=())

    @asset(group_name=GROUP, partitions_def=seeds, pool="train", kinds={"pytorch", "mlflow"},
           code_version=stable_hash([grpo_identity, exp.ablation, "experiment-baselines-v1"]),
           ins={"experiment_adapter": AssetIn(partition_mapping=to_seed, metadata=EVERY_TRAINED),
                "experiment_env": AssetIn(partition_mapping=to_seed, metadata=EVERY_TRAINED)})
    def experiment_baselines(context: AssetExecutionContext, models: ModelResource, mlflow: MlflowRegistry,
                             task_splits: dict, base_agent: dict, selected_capabilities: dict,
                             experiment_adapter: Any, experiment_env: Any) -> Output[dict[str, Any]]:
        """GRPO on the target and the ablation, each at this seed's TRACE rollouts."""
        from sensors import record_worker
        from trace_assets.experiment.report import ABLATION, GRPO
        from trace_assets.route.evaluation import adapter_rollouts
        from trace_assets.synthesize import environment_of

        record_worker(context)
        seed = int(context.partition_key)
        adapters = current_adapters(selected_capabilities, by_capability(context, "experiment_adapter", experiment_adapter))
        envs = by_capability(context, "experiment_env", experiment_env)
        if not adapters:
            raise Failure(f"experiment_baselines[{seed}]: no capability of C* has an adapter for this seed")
        budget = sum(map(adapter_rollouts, adapters.values())) + sum(
            envs[n].get("calibration_rollouts", 0) for n in selected_capabilities["names"] if n not in adapters and n in envs)
        seeded = settings.for_seed(seed)
        pool = tasks_of(task_splits, "train") + tasks_of(task_splits, "demo")
        value: dict[str, Any] = {"budget_rollouts": budget, "trace_adapters": sorted(adapters)}
        value[GRPO] = train_grpo_on_target(context, seeded, models=models, mlflow=mlflow, base_agent=base_agent,
                                           tasks=pool, budget=budget, trace_adapters=sorted(adapters),
                                           name=registry_name(seed, GRPO), aliases=())
        if exp.ablation:
            target = get_environment(settings.tasks.env)
            families = sorted({f for n in adapters
                               for f in environment_of(json.loads(open(envs[n]["spec_path"]).read()), target).families()})
            value[ABLATION] = train_grpo_on_target(
                context, seeded, models=models, mlflow=mlflow, base_agent=base_agent,
                tasks=[t for t in pool if t.family in families], budget=budget, trace_adapters=sorted(adapters),
                name=registry_name(seed, ABLATION), reward=BINARY_REWARD, aliases=())
        trained = {k: v for k, v in value.items() if isinstance(v, dict)}
        return Output(value, data_version=DataVersion(stable_hash({k: v["adapter_checksum"] for k, v in trained.items()})),
                      metadata={"budget_rollouts": budget, **{f"{k}_rollouts": v["rollouts"] for k, v in trained.items()},
                                **{f"{k}_families": MetadataValue.json(v.get("families")) for k, v in trained.items()}})

    @asset(group_name=GROUP, partitions_def=seeds, kinds={"python"},
           code_version=stable_hash([settings.route.__dict__, settings.rollout.__dict__, generation, exp.pass_k,
                                     exp.pass_k_trials, exp.pass_k_temperature, "experiment-eval-v2"]),
           ins={"experiment_adapter": AssetIn(partition_mapping=to_seed, metadata=EVERY_TRAINED),
                "experiment_env": AssetIn(partition_mapping=to_seed, metadata=EVERY_TRAINED)})
    def experiment_eval(context: AssetExecutionContext, models: ModelResource, store: TraceStore, task_splits: dict,
                        base_agent: dict, selected_capabilities: dict, trajectory_splits: dict,
                        experiment_adapter: Any, experiment_env: Any, experiment_baselines: dict) -> Output[dict[str, Any]]:
        """This seed's router, and every system on the held-out test split."""
        from trace_assets.experiment.report import ABLATION, BASE, GRPO, TRACE
        from trace_assets.route.evaluation import evaluate_systems, sampled_trials

        seed = int(context.partition_key)
        seeded = settings.for_seed(seed)
        trained = current_adapters(selected_capabilities, by_capability(context, "experiment_adapter", experiment_adapter))
        envs = by_capability(context, "experiment_env", experiment_env)
        router, _, _ = build_router(context, seeded, models=models, store=store, selected_capabilities=selected_capabilities,
                                    trained=trained, synthetic_env=envs, trajectory_splits=trajectory_splits,
                                    base_agent=base_agent)
        more = {ABLATION: experiment_baselines[ABLATION]} if ABLATION in experiment_baselines else {}
        report = evaluate_systems(seeded, models, store, task_splits=task_splits, base_agent=base_agent, router=router,
                                  grpo_baseline=experiment_baselines[GRPO], adapters=trained, log=context.log.info,
                                  more_baselines=more)
        trace_tokens = sum(spent_tokens(a) for a in trained.values())
        tokens = {"base": 0, **{n: spent_tokens(a) for n, a in trained.items()},
                  **{k: trace_tokens for k in ("trace_routed", "trace_soft", "oracle")},
                  **{k: experiment_baselines[k].get("tokens") for k in (GRPO, ABLATION) if k in experiment_baselines}}
        value = {"seed": seed, "task_ids": report["task_ids"], "families": report["families"],
                 "per_task": report["per_task"], "checks": report["checks"], "rollouts": {k: v for k, v in report["rollouts_spent"].items() if k != "evaluation"},
                 "tokens": tokens, "not_trained": [n for n in selected_capabilities["names"] if n not in trained],
                 "deferred": selected_capabilities.get("deferred", []),
                 "not_routed": router.get("not_routed", {}), "agent_id": report["agent_id"],
                 "routed": report["routed"] or [None] * len(report["task_ids"])}  # None: the base
        if exp.pass_k:  # repeated sampled episodes of base, TRACE routed and GRPO on target
            n = len(report["task_ids"])
            value["trials"] = sampled_trials(
                seeded, models, task_splits=task_splits, base_agent=base_agent,
                choices={BASE: [None] * n, TRACE: report["routed"] or [None] * n, GRPO: [GRPO] * n},
                folders={**{k: a["adapter_dir"] for k, a in trained.items()}, GRPO: experiment_baselines[GRPO]["adapter_dir"]},
                trials=exp.pass_k_trials, temperature=exp.pass_k_temperature, seed=seed, log=context.log.info)
        paths.atomic_write(paths.sub("reports") / f"experiment_seed{seed}.md", report["markdown"])
        return Output(value, data_version=DataVersion(stable_hash(value)), metadata={
            "report": MetadataValue.md(report["markdown"]), "systems": MetadataValue.md(to_markdown(report["systems"])),
            "not_trained": MetadataValue.json(value["not_trained"])})

    @asset(group_name=GROUP, kinds={"python", "mlflow"},
           code_version=stable_hash([exp.__dict__, REPORT_VERSION]),
           ins={"experiment_eval": AssetIn(partition_mapping=AllPartitionMapping(), metadata=EVERY_TRAINED),
                "experiment_adapter": AssetIn(partition_mapping=AllPartitionMapping(), metadata=EVERY_TRAINED)})
    def experiment_report(context: AssetExecutionContext, mlflow: MlflowRegistry, store: TraceStore, task_splits: dict,
                          selected_capabilities: dict, experiment_eval: Any, experiment_adapter: Any) -> Output[dict[str, Any]]:
        """Success per system over the seeds with paired bootstrap intervals, the paired
        differences (also on the families where each capability was LACKING on the train side) and
        the forest plot, and each seed's promotion verdicts: ``reports/experiment.md``, asset
        metadata and MLflow."""
        evals = by_partition(context, "experiment_eval", experiment_eval)
        gated: dict[str, dict[str, Any]] = {}
        for key, value in by_partition(context, "experiment_adapter", experiment_adapter).items():
            dims = getattr(key, "keys_by_dimension", None) or dict(zip(("capability", "seed"), str(key).split("|")))
            gated.setdefault(dims["seed"], {})[dims["capability"]] = value
        if not evals:
            raise Failure("experiment_report: no seed was evaluated")
        train = tasks_of(task_splits, "train")
        lacking = {name: store.lacking_families(name, train, version=selected_capabilities["dictionary_version"])
                   for name in selected_capabilities["names"]}
        adapters = {seed: current_adapters(selected_capabilities, values) for seed, values in gated.items()}
        report, notes = assemble_report(evals, settings, lacking=lacking, adapters=adapters)
        # the code location's whole graph: a run's own job graph holds only what the run selected
        from trace_assets.definitions import defs

        graph = defs.resolve_asset_graph()
        measured = EXPERIMENT_SELECTION.resolve(graph) - {context.asset_key}
        report["cost"] = {"machine": reports.machine(), "phases": reports.phase_rows(
            context.instance, [k for k in graph.toposorted_asset_keys if k in measured])}
        for note in notes:
            context.log.warning(note)
        markdown, png = write_report(report)
        metrics = {f"success_{r['system']}": r["estimate"] for r in report["systems"]}
        metrics.update({f"diff_{c['a']}_vs_{c['b']}": c["estimate"] for c in report["contrasts"]})
        metrics.update({f"diff_{c['a']}_vs_{c['b']}_low": c["low"] for c in report["contrasts"]})
        metrics.update({f"diff_{c['a']}_vs_{c['b']}_high": c["high"] for c in report["contrasts"]})
        for r in report["lacking"]:
            key = f"lacking_{r['capability']}_diff_{r['a']}_vs_{r['b']}".replace(":", "_")
            metrics.update({key: r["estimate"], f"{key}_low": r["low"], f"{key}_high": r["high"]})
        run_id = mlflow.log_report(markdown, {"experiment_forest": png}, metrics)
        return Output(report, data_version=DataVersion(stable_hash(report)), metadata={
            "report": MetadataValue.md(markdown), "mlflow_run_id": run_id,
            "report_path": MetadataValue.path(str(paths.sub("reports") / "experiment.md")),
            **png_metadata(png, "forest_plot")})

    return [experiment_env, experiment_adapter, experiment_baselines, experiment_eval, experiment_report]


def gate_row(seed: str, name: str, adapter: dict[str, Any]) -> dict[str, Any]:
    """One ``gates`` row of the report (``experiment.report.gates_table``) from an
    ``experiment_adapter`` value: its promotion verdict and what the gate read on the train side.
    An adapter gated before the target guard existed has none (``guard`` None)."""
    from trace_assets.train.heldout import LACKING_SUCCESS

    gate = adapter.get("promotion") or {}
    before, after, null = adapter.get("reward_before"), adapter.get("reward_after"), adapter.get("null")
    guard = gate.get("target_guard") or {}
    alpha = gate.get("alpha", 0.05)

    def counts(row: dict[str, Any] | None) -> dict[str, Any] | None:
        return ({"n": row["applicable"], "base": row["base"], "adapter": row["adapter"], "p": row["p_greater"]}
                if row and row["applicable"] else None)

    return {"seed": str(seed), "capability": name, "promoted": bool(adapter.get("promoted")),
            "synthetic": ({"n": after["n"], "base": before["success_rate"], "null": null["success_rate"],
                           "adapter": after["success_rate"]} if before and after and null else None),
            "guard": counts(guard.get("success")), "guard_lacking": counts(guard.get(LACKING_SUCCESS)),
            "checks_lost": [{"check": cid, "applicable": r["applicable"], "base": r["base"], "adapter": r["adapter"],
                             "p": r["p_greater"]} for cid, r in guard.items()
                            if cid not in ("success", LACKING_SUCCESS) and r["p_greater"] < alpha]}


def assemble_report(evals: dict[str, dict[str, Any]], settings: Settings,
                    lacking: dict[str, list[str]] | None = None,
                    adapters: dict[str, dict[str, dict[str, Any]]] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The experiment report (``experiment.report.build_report``) from the seeds' evaluations:
    the systems every evaluated seed has, in a fixed order (base, TRACE, oracle, the baselines,
    then adapters and their nulls); a system missing on a seed, and a seed not evaluated, are noted.
    ``lacking``: per capability, the families where it was LACKING on the train side (the
    adapters' contrasts are repeated there; a trained capability with none is noted).
    ``adapters``: per seed, ``{capability: experiment_adapter value}``, for the promotion gate's
    rows (:func:`gate_row`) of the evaluated seeds."""
    from trace_assets.experiment.report import ABLATION, BASE, GRPO, ORACLE, SOFT, TRACE, build_report

    exp = settings.experiment
    seeds = sorted(evals, key=int)
    notes = []
    missing_seeds = [str(s) for s in exp.seeds if str(s) not in evals]
    if missing_seeds:
        notes.append(f"seeds {', '.join(missing_seeds)} not evaluated (not run yet, or a step failed): the report covers seeds {', '.join(seeds)}")
    first = evals[seeds[0]]
    if any(evals[s]["task_ids"] != first["task_ids"] for s in seeds):
        raise Failure("experiment_report: the seeds were evaluated on different test tasks")
    common = set(first["per_task"])
    for s in seeds[1:]:
        common &= set(evals[s]["per_task"])
    for s in seeds:
        dropped = sorted(set(evals[s]["per_task"]) - common)
        if dropped:
            notes.append(f"seed {s}: {', '.join(dropped)} left out (not evaluated with every seed)")
        if evals[s].get("not_trained"):
            notes.append(f"seed {s}: in C* but not trained (environment failed its check): {', '.join(evals[s]['not_trained'])}")
    # what the settings cut from the design, so the report never reads as the full experiment
    if first.get("deferred"):
        notes.append(f"C* cut to its top {settings.selection.max_selected} by mean Δ ([selection] max_selected); "
                     f"passed the selection but not trained: {', '.join(first['deferred'])}")
    if ABLATION not in common:
        notes.append("the ablation (GRPO at equal rollouts on the synthetic environments' target families, binary "
                     "reward) was not trained ([experiment] ablation = false): isolation is not separated from reward shaping")
    head = [n for n in (BASE, TRACE, ORACLE, GRPO, ABLATION, SOFT) if n in common]
    rest = sorted(n for n in common if n not in head and not n.startswith("null:"))
    order = head + [x for n in rest for x in (n, f"null:{n}") if x in common]
    order += sorted(n for n in common if n not in order)
    outcomes = {n: [[r >= 1.0 for r in evals[s]["per_task"][n]] for s in seeds] for n in order}
    # pass^k per (seed, task): its mean over them is the mean over seeds of each seed's pass^k.
    sampled = [evals[s].get("trials") for s in seeds]
    trials = ({n: [t for per_seed in sampled for t in per_seed[n]] for n in sampled[0]}
              if all(sampled) and exp.pass_k else None)
    lacking = {n: f for n, f in (lacking or {}).items() if n in common}
    for name in sorted(n for n, f in lacking.items() if not f):
        notes.append(f"{name}: no train-side trajectory labelled it LACKING, so it has no LACKING-family contrast")
    routed = {s: evals[s]["routed"] for s in seeds if "routed" in evals[s]}  # evaluations before v4 lack it
    # per-check outcomes: evaluations before experiment-eval-v2 lack them, and then no seed's are shown
    checks = ({n: [evals[s]["checks"][n] for s in seeds] for n in order if all(n in evals[s]["checks"] for s in seeds)}
              if all("checks" in evals[s] for s in seeds) else None)
    report = build_report(
        outcomes, seeds=seeds, lacking=lacking, routed=routed, checks=checks, task_ids=first["task_ids"], families=first["families"],
        rollouts={n: [evals[s]["rollouts"].get(n) for s in seeds] for n in order},
        tokens={n: [evals[s]["tokens"].get(n) for s in seeds] for n in order}, trials=trials, pass_k=exp.pass_k or 4,
        samples=exp.bootstrap_samples, bootstrap_seed=exp.bootstrap_seed, notes=notes,
        gates=[gate_row(s, n, a) for s in seeds for n, a in sorted((adapters or {}).get(s, {}).items())])
    return report, notes


def write_report(report: dict[str, Any]) -> tuple[str, bytes]:
    """``(markdown, forest PNG)``, written to ``<data>/reports/experiment.md``, ``experiment.json``
    and ``experiment_forest.png`` (each atomically)."""
    from trace_assets.experiment.report import forest_png, report_markdown

    folder = paths.sub("reports")
    png = forest_png(report)
    markdown = report_markdown(report, figure="experiment_forest.png")
    for name, data in (("experiment_forest.png", png), ("experiment.md", markdown),
                       ("experiment.json", json.dumps(report, indent=1))):
        paths.atomic_write(folder / name, data)
    return markdown, png
