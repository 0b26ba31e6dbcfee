"""Step 2 asset: synthetic_env, one validated, calibrated environment per capability partition.

The spec is data (``trace_assets/schemas/envspec.schema.json``), written by the configured
synthesizer, checked for fidelity and gold-solvability, then calibrated on base-agent rollouts at
the training temperature, then checked for isolation against ablated experts (the expert lacking
this capability must fail the environment, the experts lacking any other one must pass it). A
blocking check carries fidelity, calibration and isolation, so an environment that fails any of
them never reaches training. A spec the synthesizer cannot repair fails the run and leaves
the partition's previous materialization intact. Specs are stored content-addressed under
``<data>/envs/<capability>/<spec_hash>.json`` and never overwritten. Every materialization logs its
isolation matrix (table, heatmap PNG, JSON), calibration rounds and spec to MLflow, in a run of its
own (``MlflowRegistry.log_environment``; the run id is in the metadata).

A target without an expert (a user environment) gets a logged-decision-point environment instead
(``synthesize.build.build_logged_environment``): its episodes open at the first LACKING step of the
capability's labelled train trajectories (the labels of the dictionary version that
``capability_spec`` carries), with one measured calibration round and the weaker isolation
measure; logs that do not replay are quarantined and listed in ``rejected_specs``.
"""

import json
from typing import Any

from dagster import AssetCheckResult, AssetCheckSpec, AssetExecutionContext, DataVersion, Failure, MetadataValue, Output, asset

from resources.llm import SynthesizerResource
from resources.mlflow_registry import MlflowRegistry
from resources.models import ModelResource
from resources.store import TraceStore
from trace_assets import paths
from trace_assets.assets.identify import capability_partitions, per_capability_automation
from trace_assets.identify.capabilities import checked_partition_key
from trace_assets.envs import get_environment
from trace_assets.figures import png_metadata, reward_histogram, to_markdown
from trace_assets.hashing import stable_hash
from trace_assets.settings import Settings
from trace_assets.trajectories import render_markdown

GROUP = "synthesize"


CALIBRATION_VERSION = "disjoint-from-training-seeded-v1"
"""Bumped when calibration changes outside the settings (until 2026-12-01 it played GRPO's first
training tasks, with sampling seeds 0, 1, 2 whatever the training seed)."""


def build_synthesize_assets(settings: Settings) -> list:
    syn = settings.synthesis
    train_seed = settings.train.grpo.seed  # the training seed drives calibration's sampling too

    @asset(
        group_name=GROUP, partitions_def=capability_partitions, kinds={"json"},
        automation_condition=per_capability_automation,
        code_version=stable_hash([syn.__dict__, settings.section_hash("rollout"), train_seed, CALIBRATION_VERSION]),
        check_specs=[AssetCheckSpec("calibration_and_fidelity", asset="synthetic_env", blocking=True,
                                    description="Fidelity to the target, gold-solvable, calibrated reward band, "
                                                "isolation against ablated experts.")],
    )
    def synthetic_env(
        context: AssetExecutionContext, synthesizer: SynthesizerResource, models: ModelResource,
        store: TraceStore, mlflow: MlflowRegistry, capability_spec: dict, base_agent: dict,
    ):
        """The capability's training environment: an EnvSpec interpreted on the target's machinery."""
        name = checked_partition_key(context.partition_key)  # it becomes a path part below
        value, metadata = make_synthetic_env(context, settings, name, train_seed, synthesizer=synthesizer, models=models,
                                             store=store, capability_spec=capability_spec, base_agent=base_agent,
                                             mlflow=mlflow)
        check = value.pop("check")
        yield Output(value, data_version=DataVersion(value["spec_hash"]), metadata=metadata)
        yield AssetCheckResult(
            check_name="calibration_and_fidelity", passed=check["passed"], description=check["reason"],
            metadata={"rounds": MetadataValue.json(value["calibration"]["rounds"]),
                      "isolation": MetadataValue.json(value["isolation"])},
        )

    return [synthetic_env]


def make_synthetic_env(context: AssetExecutionContext, settings: Settings, name: str, train_seed: int, *,
                       synthesizer: SynthesizerResource, models: ModelResource, store: TraceStore,
                       capability_spec: dict, base_agent: dict,
                       mlflow: MlflowRegistry | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(value, metadata)`` of capability ``name``'s environment: synthesized, checked, calibrated
    on the base agent with sampling seeds from ``train_seed``, then checked for isolation
    (``synthesize.build``). ``value["check"]`` is the blocking check's ``{"passed", "reason"}``. With
    ``mlflow``, the environment is logged to a run of its own (its id in the metadata). The experiment
    calls it once per training seed."""
    from trace_assets.agent.model import load_tokenizer
    from trace_assets.llm_client import LLMError
    from trace_assets.synthesize import PrefixError, environment_of, isolation_heatmap, isolation_markdown, spec_hash
    from trace_assets.synthesize.build import (CalibrationRollouts, SpecRejected, build_environment,
                                               build_logged_environment, checked_spec)

    syn = settings.synthesis
    target = get_environment(settings.tasks.env)
    capability = {k: capability_spec[k] for k in ("name", "description", "failure_modes")}
    logged = not callable(getattr(target, "expert", None))  # a user environment: decision points from its logs
    if logged:
        version = capability_spec.get("dictionary_version")
        if not version:
            raise Failure(f"synthetic_env[{name}]: capability_spec carries no dictionary version (materialized "
                          "before logged decision points); re-materialize capability_spec")
        labels = store.lacking_steps(version, name)
        logs = [t for t in store.trajectories_by_id(sorted({l.trajectory_id for l in labels})) if t["split"] == "train"]
        context.log.info(f"{target.name!r} has no expert: decision points from {len(logs)} logged train trajectories "
                         f"with a LACKING step for {name}")
    else:
        wanted = set(capability_spec.get("example_trajectory_ids", []))
        failed = [t for t in store.trajectories(split="train") if t["trajectory_id"] in wanted]
        try:
            spec, rejected = checked_spec(capability, target, synthesizer.synthesize, failed)
        except LLMError as exc:
            raise Failure(f"synthetic_env[{name}]: no valid spec; the previous materialization is kept. {exc}") from exc
        except SpecRejected as exc:
            raise Failure(f"synthetic_env[{name}]: spec rejected; the previous materialization is kept: "
                          f"{exc.problems[:5]}") from exc

    tokenizer = load_tokenizer(base_agent["path"])
    backend = models.backend_for(base_agent["path"])
    context.log.info(f"generation backend: {models.backend_label(backend)}")
    rollout_fn = CalibrationRollouts(backend, tokenizer, max_steps=syn.max_steps,
                                     max_new_tokens=settings.rollout.max_new_tokens,
                                     max_context_tokens=settings.rollout.max_context_tokens, train_seed=train_seed,
                                     log=context.log.info)
    if logged:
        try:
            built = build_logged_environment(capability, logs, labels, target, rollout_fn, syn)
        except PrefixError as exc:
            raise Failure(f"synthetic_env[{name}]: no logged decision point; the previous materialization is kept. "
                          f"{exc}") from exc
        rejected = built.rejected
        for line in rejected:
            context.log.warning(line)
    else:
        built = build_environment(spec, target, rollout_fn, syn, rejected=rejected)
    report, iso = built.calibration, built.isolation
    final = report.spec
    digest = spec_hash(final)
    spec_path = paths.sub("envs", name) / f"{digest}.json"
    if not spec_path.exists():
        paths.atomic_write(spec_path, json.dumps(final, indent=2, sort_keys=True))
    rollouts = rollout_fn.last
    rewards = [r.result.reward for r in rollouts]
    env = environment_of(final, target)
    sample = max(rollouts, key=lambda r: r.result.reward, default=None)
    n_calibration = built.calibration_rollouts
    value = {
        "capability": name, "spec_path": str(spec_path), "spec_hash": digest, "env_name": env.name,
        "calibration": report.to_dict(), "isolation": iso, "rejected_specs": rejected,
        "calibration_rollouts": n_calibration,
        # whose LACKING labels the adapter's target guard reads (``assets.train.target_guard_tasks``)
        "dictionary_version": capability_spec.get("dictionary_version"),
    }
    metadata: dict[str, Any] = {
        "spec_hash": digest, "spec_path": MetadataValue.path(str(spec_path)),
        "synthesizer": "logged decision points" if logged else synthesizer.kind,
        "calibration_rounds": len(report.rounds), "calibrated": report.passed, "calibration_rollouts": n_calibration,
        "calibration": MetadataValue.md(to_markdown(__import__("polars").DataFrame(
            [{k: (json.dumps(v) if isinstance(v, dict) else v) for k, v in r.items()} for r in report.rounds]))),
        "isolation": MetadataValue.json({k: v for k, v in iso.items() if k != "rows"}),
        "isolation_matrix": MetadataValue.md(isolation_markdown([iso])),
        "isolation_rows": MetadataValue.json(iso["rows"]), "rejected_specs": MetadataValue.json(rejected),
    }
    heatmap_png = isolation_heatmap([iso], title=f"E_{name}: success of each agent")
    metadata.update(png_metadata(heatmap_png, "isolation_heatmap"))
    if mlflow is not None:
        metadata["mlflow_run_id"] = mlflow.log_environment(
            name, spec=final, isolation=iso, calibration=report.to_dict(), isolation_table=isolation_markdown([iso]),
            isolation_png=heatmap_png, lineage={"envspec_hash": digest, "dagster_run_id": context.run_id,
                                                "base_model": f"{models.base_model}@{base_agent.get('checksum') or base_agent['path']}"})
    if rewards:
        metadata.update(png_metadata(reward_histogram(rewards, title=f"{name}: last calibration round"), "reward_histogram"))
    if sample is not None:
        metadata["sample_episode"] = MetadataValue.md(render_markdown(sample.messages))
    passed = built.passed
    value["check"] = {"passed": passed, "reason": f"calibration: {report.reason}; isolation: {iso['reason']}"}
    return value, metadata
