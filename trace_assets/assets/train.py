"""Step 3 asset: lora_adapter, one GRPO-trained LoRA per capability, registered in MLflow.

Runs in the Dagster concurrency pool ``train`` (limit 1 in dagster.yaml) so two trainings never
fight for the cores. Training output lives under ``<data>/adapters/<capability>/<key>``, where the
key hashes the environment spec, the base agent and the GRPO config: a killed run resumes from its
last checkpoint, and a finished one is reused instead of retrained. The metadata carries the whole
lineage a user audits: MLflow run and model version, Dagster run id, the C* data version, the
EnvSpec hash and the base model's identity.
"""

import json
from typing import Any

from dagster import AssetExecutionContext, AssetKey, DataVersion, Failure, MetadataValue, Output, asset

from resources.mlflow_registry import DEFAULT_ALIASES, MlflowRegistry
from resources.models import ModelResource
from resources.store import TraceStore
from trace_assets import paths
from trace_assets.paths import folder_checksum
from trace_assets.assets.identify import capability_partitions, per_capability_automation
from trace_assets.identify.capabilities import checked_partition_key
from trace_assets.envs import get_environment
from trace_assets.figures import png_metadata, to_markdown
from trace_assets.hashing import stable_hash
from trace_assets.settings import Settings

GROUP = "train"


def latest_data_version(context: AssetExecutionContext, key: str) -> str | None:
    """The data version of the latest materialization of ``key`` (for lineage)."""
    event = context.instance.get_latest_materialization_event(AssetKey(key))
    return event.asset_materialization.tags.get("dagster/data_version") if event else None


def build_train_assets(settings: Settings) -> list:
    from trace_assets.agent.identity import planned_generation

    train_cfg = settings.train
    grpo_config = train_cfg.grpo
    generation = planned_generation(settings.generation)

    @asset(
        group_name=GROUP, partitions_def=capability_partitions, pool="train", kinds={"pytorch", "mlflow"},
        code_version=stable_hash([grpo_config.identity(), train_cfg.eval_tasks, train_cfg.promotion_alpha,
                                  train_cfg.guard_tasks, generation, EVALUATION_VERSION]),
        automation_condition=per_capability_automation,
    )
    def lora_adapter(
        context: AssetExecutionContext, models: ModelResource, mlflow: MlflowRegistry, store: TraceStore,
        synthetic_env: dict, base_agent: dict, task_splits: dict,
    ) -> Output[dict[str, Any]]:
        """GRPO on the capability's synthetic environment (the base stays frozen), then the held-out
        evaluation against the base and the null control, the fidelity probe of the path it is
        evaluated through, the target guard on the train split, and the promotion gate in front of
        the MLflow alias ``champion``."""
        name = checked_partition_key(context.partition_key)  # it becomes a path part below
        return train_capability_adapter(context, settings, name, models=models, mlflow=mlflow, store=store,
                                        synthetic_env=synthetic_env, base_agent=base_agent, task_splits=task_splits)

    return [lora_adapter]


def train_grpo(models: ModelResource, base_agent: dict, env: Any, config: Any, out_dir: Any, *, what: str, tag: str,
               log: Any, reward_fn: Any = None) -> tuple[Any, Any]:
    """``(trainer, result)`` of GRPO on the base agent in ``out_dir`` (resuming from its newest
    checkpoint), generating through the configured path; used by ``lora_adapter`` and
    ``grpo_baseline``. ``reward_fn``: ``GRPOTrainer``'s (None: the episode's reward). A
    ``GRPOError`` fails the step, naming ``what``."""
    from trace_assets.train.grpo import GRPOError, GRPOTrainer

    model, tokenizer = models.load(base_agent["path"])
    trainer = GRPOTrainer(model, tokenizer, env, config, out_dir, reward_fn=reward_fn,
                          backend_factory=models.policy_backend_factory(base_agent["path"]),
                          progress=lambda m: log(f"[{tag}] {m.line()}"))
    try:
        return trainer, trainer.train()
    except GRPOError as exc:
        raise Failure(f"{what}: {exc}. Re-materializing resumes from the last checkpoint.") from exc


EVALUATION_VERSION = "null-control-fidelity-promotion-v3"
"""Bumped when the held-out evaluation or the promotion gate changes outside the settings
(v2: the null control is fidelity-probed on the path it is compared through; v3: the target guard)."""


def fidelity_checked(models: ModelResource, path: str, peft_model: Any, tokenizer: Any, probe: Any, what: str, log: Any,
                     *, null_dir: str | None = None):
    """``(models, policy_backend_factory, FidelityReport, null FidelityReport or None)`` of the
    evaluation path that keeps the adapter's effect, and, given ``null_dir``, its null control's
    too (judged on the adapter's scale, as ``router_eval`` judges it): the configured path, or,
    when its dtype's rounding fails either probe, the same in float32. A comparison with the null
    is only fair where both are applied as trained. Raises ``FidelityError`` when even float32
    fails (a stale or missing adapter)."""
    from trace_assets.agent import fidelity
    from trace_assets.train.heldout import null_active

    candidates = models.fidelity_candidates(path)
    for i, candidate in enumerate(candidates):
        factory = candidate.policy_backend_factory(path)
        backend = (factory or candidate.backend)(peft_model, tokenizer)
        report = fidelity.check_backend(candidate.backend_label(backend), peft_model, backend, probe)
        log.info(f"{what}: fidelity {report.line()}")
        null_report, problems = None, report.problems()
        if null_dir is not None and not problems:
            with null_active(peft_model, null_dir):  # the path serves the model as it is when built
                null_backend = (factory or candidate.backend)(peft_model, tokenizer)
                null_report = fidelity.check_backend(candidate.backend_label(null_backend), peft_model, null_backend, probe)
            log.info(f"{what}: its null control's fidelity {null_report.line()} (judged on the adapter's shift rms "
                     f"{report.rms_shift_ref:.4f})")
            problems = [f"null control: {p}" for p in null_report.problems(scale=report.rms_shift_ref)]
        last = i == len(candidates) - 1
        if not problems or last:
            if i:
                log.warning(f"{what}: the configured dtype loses the adapter's or its null's effect; evaluating in float32")
            fidelity.require(report, what)
            if null_report is not None:
                fidelity.require(null_report, f"{what} (its null control)", scale=report.rms_shift_ref)
            return candidate, factory, report, null_report
        log.warning(f"{what}: {'; '.join(problems)} through {report.path}: retrying in float32")
    raise AssertionError("unreachable")


def fidelity_line(report: dict[str, Any]) -> str:
    from trace_assets.agent.fidelity import FidelityReport

    return FidelityReport(**report).line()


def _metadata(value: dict[str, Any]) -> dict[str, Any]:
    import polars as pl

    from resources.mlflow_registry import training_curve_png

    before, after = value["reward_before"], value["reward_after"]
    metadata: dict[str, Any] = {
        "mlflow_run_id": value["mlflow_run_id"], "model_name": value["model_name"],
        "model_version": value["model_version"], "aliases": MetadataValue.json(value["aliases"]),
        "lineage": MetadataValue.json(value["lineage"]), "dagster_run_id": value["lineage"]["dagster_run_id"],
        "c_star_data_version": str(value["lineage"]["c_star_version"]), "envspec_hash": value["lineage"]["envspec_hash"],
        "base_model": value["lineage"]["base_model"], "rollouts": value["rollouts"], "iterations": value["iterations"],
        "reward_before": before["mean_reward"], "reward_after": after["mean_reward"],
        "success_before": before["success_rate"], "success_after": after["success_rate"],
        "success_null": (value.get("null") or {}).get("success_rate"),
        "promoted": bool(value.get("promoted")),
        "promotion_reason": (value.get("promotion") or {}).get("reason", "not evaluated by the promotion gate"),
        "fidelity": (fidelity_line(value["fidelity"]) if value.get("fidelity") else "not measured"),
        "null_fidelity": (fidelity_line(value["null_fidelity"]) if value.get("null_fidelity") else "not measured"),
        "generation": MetadataValue.json(value.get("generation") or {}),
        "time_per_iteration": MetadataValue.json(value["time_per_iteration"]),
        "adapter_dir": MetadataValue.path(value["adapter_dir"]),
    }
    guard = (value.get("promotion") or {}).get("target_guard")
    if guard:
        families = ", ".join((value.get("target_guard") or {}).get("lacking_families", [])) or "none"
        metadata["target_guard"] = MetadataValue.md(
            f"Train-split tasks of the target, every family in turn (the capability was LACKING in: {families}): "
            "how often base and adapter succeeded and passed each check, paired, and the one-sided sign test "
            "that the base does so more often. Success decides.\n\n"
            + to_markdown(pl.DataFrame([{"outcome": cid, **g} for cid, g in guard.items()])))
    if value["curve"]:
        metadata["training_curve_table"] = MetadataValue.md(to_markdown(pl.DataFrame(value["curve"])))
        import io

        buf = io.BytesIO()
        training_curve_png(value["curve"]).save(buf, format="PNG")
        metadata.update(png_metadata(buf.getvalue(), "training_curve"))
    return metadata


def target_guard_tasks(store: TraceStore, name: str, task_splits: dict, synthetic_env: dict,
                       limit: int) -> tuple[list[Any], list[str]]:
    """``(tasks, lacking families)`` of the gate's target guard: at most ``limit`` train-split tasks,
    every family in turn, first the families where Step 1 labelled ``name`` LACKING (under the
    dictionary version the environment was built from, where it records one;
    ``train.heldout.guard_tasks``)."""
    from trace_assets.envs.splits import tasks_of
    from trace_assets.train.heldout import guard_tasks

    if limit <= 0 or "train" not in task_splits:
        return [], []
    train = tasks_of(task_splits, "train")
    families = store.lacking_families(name, train, version=synthetic_env.get("dictionary_version"))
    return guard_tasks(train, families, limit), families


def train_capability_adapter(context: AssetExecutionContext, settings: Settings, name: str, *, models: ModelResource,
                             mlflow: MlflowRegistry, store: TraceStore, synthetic_env: dict, base_agent: dict,
                             task_splits: dict, registry_name: str | None = None,
                             aliases_if_promoted=DEFAULT_ALIASES) -> Output[dict[str, Any]]:
    """Capability ``name``'s adapter, as ``lora_adapter`` makes it with ``settings`` (its GRPO seed is
    ``settings.train.grpo.seed``): trained (or reused from its folder, keyed by spec, base and
    GRPO identity), fidelity-probed, evaluated against the base and the null control, checked
    against the base on the target guard's train tasks (:func:`target_guard_tasks`), gated, and
    registered in MLflow as ``registry_name`` (default ``name``), taking ``aliases_if_promoted``
    only when the gate promotes it. The experiment calls it once per training seed, under its own
    registry name and with no alias. A reused adapter has the data version it had when trained."""
    import polars as pl

    from trace_assets.agent import fidelity
    from trace_assets.agent.identity import generation_identity, planned_generation
    from trace_assets.agent.lora import null_adapter
    from trace_assets.synthesize import environment_of, example_conversations
    from trace_assets.envs.splits import TaskPoolEnv
    from trace_assets.train.heldout import EvalConfig, compare_base_and_adapter, promotion
    from trace_assets.train.runs import train_or_reuse

    from sensors import record_worker

    train_cfg = settings.train
    grpo_config = train_cfg.grpo
    generation = planned_generation(settings.generation)
    record_worker(context)  # it holds the `train` slot: a killed worker must be reapable
    if not synthetic_env["calibration"]["passed"]:
        raise Failure(
            f"lora_adapter[{name}]: its synthetic environment is not calibrated "
            f"({synthetic_env['calibration'].get('reason')}); not training on it."
        )
    isolation = synthetic_env.get("isolation") or {}
    if isolation.get("passed") is False:
        raise Failure(f"lora_adapter[{name}]: its synthetic environment does not isolate the capability "
                      f"({isolation.get('reason')}); not training on it.")
    spec = json.loads(open(synthetic_env["spec_path"]).read())
    target = get_environment(settings.tasks.env)
    env = environment_of(spec, target)
    key = stable_hash([synthetic_env["spec_hash"], base_agent.get("checksum") or base_agent["path"], grpo_config.identity()])
    out_dir = paths.sub("adapters", name, key)
    guard, guard_families = target_guard_tasks(store, name, task_splits, synthetic_env, train_cfg.guard_tasks)
    evaluation_key = stable_hash([generation, train_cfg.eval_tasks, train_cfg.promotion_alpha, EVALUATION_VERSION,
                                  [t.task_id for t in guard]])

    def evaluated_alike(value: dict[str, Any]) -> bool:
        # Another registry name (the experiment's seed 0 is the main job's adapter) reuses it as
        # registered: it is the same adapter, and re-registering would flip the manifest back and forth.
        if value.get("evaluation_key") == evaluation_key:
            return True
        context.log.info(f"{out_dir}: trained, but evaluated under another generation or gate: re-evaluating")
        return False

    def train_and_evaluate() -> dict[str, Any]:
        # A finished run resumes at its last checkpoint and only saves.
        trainer, result = train_grpo(models, base_agent, env, grpo_config, out_dir, what=f"lora_adapter[{name}]",
                                     tag=name, log=context.log.info)
        tokenizer = trainer.tokenizer
        # The path every evaluation of this adapter goes through: is its effect intact there? If a
        # faster dtype's rounding loses it, the evaluation takes the exact (fp32) path instead.
        probe_tasks = env.sample_tasks(2, offset=grpo_config.seed_offset)  # training seeds: train side
        probe = fidelity.make_probe(tokenizer, example_conversations(env, probe_tasks), env.tool_schemas())
        null_dir = null_adapter(result.adapter_dir, out_dir / "null", seed=grpo_config.seed)
        try:
            eval_models, policy_backends, fid, null_fid = fidelity_checked(
                models, base_agent["path"], trainer.model, tokenizer, probe, f"lora_adapter[{name}]", context.log,
                null_dir=str(null_dir))
        except fidelity.FidelityError as exc:
            raise Failure(str(exc)) from exc
        backend = (policy_backends or eval_models.backend)(trainer.model, tokenizer)
        comparison = compare_base_and_adapter(trainer.model, tokenizer, env,
                                              EvalConfig.from_limits(grpo_config, n_tasks=train_cfg.eval_tasks),
                                              backend_factory=policy_backends, null_dir=null_dir)
        harm = None
        if guard:  # the target's own episodes, with the limits the base's Step-1 episodes had
            pool = TaskPoolEnv(target, guard)
            context.log.info(f"[{name}] target guard: base and adapter on {len(guard)} train tasks "
                             f"({name} was LACKING in {guard_families or 'none of their families'})")
            harm = compare_base_and_adapter(trainer.model, tokenizer, pool,
                                            EvalConfig.from_limits(settings.rollout, n_tasks=len(guard), seed_offset=0),
                                            backend_factory=policy_backends)
            harm["lacking"] = [t.family in guard_families for t in pool.sample_tasks(len(guard))]  # in played order
        else:
            context.log.warning(f"[{name}] target guard off (guard_tasks {train_cfg.guard_tasks}) or no train split: "
                                "not measured")
        gate = promotion(comparison, alpha=train_cfg.promotion_alpha, target=harm)
        context.log.info(f"[{name}] {gate['reason']}")
        history = result.history
        rollouts = result.rollouts_played
        lineage = {
            "capability": name, "c_star_version": latest_data_version(context, "selected_capabilities"),
            "envspec_hash": synthetic_env["spec_hash"],
            "base_model": f"{models.base_model}@{base_agent.get('checksum') or base_agent['path']}",
            "dagster_run_id": context.run_id, "promoted": gate["promoted"], "promotion_reason": gate["reason"],
        }
        registered = mlflow.log_training(
            registry_name or name, adapter_dir=result.adapter_dir, history=history, lineage=lineage,
            params={**grpo_config.to_dict(), "capability": name, "train_profile": settings.profile},
            aliases=tuple(aliases_if_promoted) if gate["promoted"] else (),
            metrics={"heldout_success_base": comparison["base"].success_rate,
                     "heldout_success_adapter": comparison["adapter"].success_rate,
                     "heldout_success_null": comparison["null"].success_rate,
                     "fidelity_correlation": fid.correlation, "fidelity_rel_error": fid.rel_rms_error,
                     "promoted": float(gate["promoted"]),
                     **({"target_guard_success_base": harm["base"].success_rate,
                         "target_guard_success_adapter": harm["adapter"].success_rate} if harm else {})},
        )
        curve = pl.DataFrame([m.to_dict() if hasattr(m, "to_dict") else dict(m.__dict__) for m in history])
        return {
            "capability": name, "adapter_dir": str(result.adapter_dir),
            "adapter_checksum": folder_checksum(result.adapter_dir),
            "mlflow_run_id": registered.run_id, "model_name": registered.name, "model_version": registered.version,
            "aliases": list(registered.aliases), "lineage": lineage, "train_profile": settings.profile,
            "rollouts": rollouts, "calibration_rollouts": synthetic_env.get("calibration_rollouts", 0),
            "reward_before": comparison["base"].to_dict(), "reward_after": comparison["adapter"].to_dict(),
            "null": comparison["null"].to_dict(), "null_dir": str(null_dir),
            "promotion": gate, "promoted": gate["promoted"], "fidelity": fid.to_dict(),
            "target_guard": {"task_ids": [t.task_id for t in guard], "lacking_families": guard_families,
                             **({k: harm[k].to_dict() for k in ("base", "adapter")} if harm else {})},
            "null_fidelity": null_fid.to_dict() if null_fid is not None else None,
            "generation": generation_identity(backend), "evaluation_key": evaluation_key,
            "iterations": len(history),
            "time_per_iteration": {
                "gen_s": round(sum(m.gen_time_s for m in history) / max(len(history), 1), 1),
                "opt_s": round(sum(m.opt_time_s for m in history) / max(len(history), 1), 1),
            },
            "curve": curve.to_dicts(),
        }

    value, reused = train_or_reuse(out_dir, train_and_evaluate, reusable=evaluated_alike)
    if reused:
        context.log.info(f"Reusing the adapter trained and evaluated at {out_dir} (same spec, base, config, "
                         "generation and gate)")
    # One data version for one (adapter, verdict), whether trained now or reused.
    return Output(value, data_version=DataVersion(stable_hash([value["adapter_checksum"], value["promoted"]])),
                  metadata=_metadata(value))
