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

from resources.mlflow_registry import MlflowRegistry
from resources.models import ModelResource
from trace_assets import paths
from trace_assets.paths import folder_checksum
from trace_assets.assets.identify import capability_partitions, per_capability_automation
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
    train_cfg = settings.train
    grpo_config = train_cfg.config()

    @asset(
        group_name=GROUP, partitions_def=capability_partitions, pool="train", kinds={"pytorch", "mlflow"},
        code_version=stable_hash([grpo_config.identity(), train_cfg.eval_tasks]),
        automation_condition=per_capability_automation,
    )
    def lora_adapter(
        context: AssetExecutionContext, models: ModelResource, mlflow: MlflowRegistry,
        synthetic_env: dict, base_agent: dict,
    ) -> Output[dict[str, Any]]:
        """GRPO on the capability's synthetic environment; the base stays frozen."""
        import polars as pl

        from trace_assets.synthesize import SyntheticEnv
        from trace_assets.train.heldout import EvalConfig, compare_base_and_adapter
        from trace_assets.train.grpo import GRPOError, GRPOTrainer

        name = context.partition_key
        if not synthetic_env["calibration"]["passed"]:
            raise Failure(
                f"lora_adapter[{name}]: its synthetic environment is not calibrated "
                f"({synthetic_env['calibration'].get('reason')}); not training on it."
            )
        spec = json.loads(open(synthetic_env["spec_path"]).read())
        env = SyntheticEnv(spec, get_environment(settings.tasks.env))
        key = stable_hash([synthetic_env["spec_hash"], base_agent.get("checksum") or base_agent["path"], grpo_config.identity()])
        out_dir = paths.sub("adapters", name, key)
        manifest = out_dir / "trace_adapter.json"
        if manifest.exists():
            value = json.loads(manifest.read_text())
            context.log.info(f"Reusing the adapter trained at {out_dir} (same spec, base and config)")
            return Output(value, data_version=DataVersion(value["adapter_checksum"][:16]), metadata=_metadata(value))

        model, tokenizer = models.load(base_agent["path"])

        policy_backends = models.policy_backend_factory(base_agent["path"])
        trainer = GRPOTrainer(model, tokenizer, env, grpo_config, out_dir, backend_factory=policy_backends,
                              progress=lambda m: context.log.info(f"[{name}] {m.line()}"))
        try:
            result = trainer.train()
        except GRPOError as exc:
            raise Failure(f"lora_adapter[{name}]: {exc}. Re-materializing resumes from the last checkpoint.") from exc
        comparison = compare_base_and_adapter(trainer.model, tokenizer, env, EvalConfig(
            n_tasks=train_cfg.eval_tasks, max_steps=grpo_config.max_steps, max_new_tokens=grpo_config.max_new_tokens,
            max_context_tokens=grpo_config.max_context_tokens,
        ), backend_factory=policy_backends)
        history = result.history
        rollouts = len(history) * grpo_config.groups * grpo_config.samples_per_group
        lineage = {
            "capability": name, "c_star_version": latest_data_version(context, "selected_capabilities"),
            "envspec_hash": synthetic_env["spec_hash"], "base_model": f"{models.base_model}@{base_agent.get('checksum') or base_agent['path']}",
            "dagster_run_id": context.run_id,
        }
        registered = mlflow.log_training(
            name, adapter_dir=result.adapter_dir, history=history, lineage=lineage,
            params={**grpo_config.to_dict(), "capability": name, "train_profile": train_cfg.profile},
        )
        curve = pl.DataFrame([m.to_dict() if hasattr(m, "to_dict") else dict(m.__dict__) for m in history])
        value = {
            "capability": name, "adapter_dir": str(result.adapter_dir), "adapter_checksum": folder_checksum(result.adapter_dir),
            "mlflow_run_id": registered.run_id, "model_name": registered.name, "model_version": registered.version,
            "aliases": list(registered.aliases), "lineage": lineage, "train_profile": train_cfg.profile,
            "rollouts": rollouts, "calibration_rollouts": synthetic_env.get("calibration_rollouts", 0),
            "reward_before": comparison["base"].to_dict(), "reward_after": comparison["adapter"].to_dict(),
            "iterations": len(history),
            "time_per_iteration": {
                "gen_s": round(sum(m.gen_time_s for m in history) / max(len(history), 1), 1),
                "opt_s": round(sum(m.opt_time_s for m in history) / max(len(history), 1), 1),
            },
            "curve": curve.to_dicts(),
        }
        tmp = manifest.with_suffix(".tmp")
        tmp.write_text(json.dumps(value, indent=2, default=str))
        tmp.replace(manifest)
        return Output(value, data_version=DataVersion(value["adapter_checksum"][:16]), metadata=_metadata(value))

    return [lora_adapter]


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
        "time_per_iteration": MetadataValue.json(value["time_per_iteration"]),
        "adapter_dir": MetadataValue.path(value["adapter_dir"]),
    }
    if value["curve"]:
        metadata["training_curve_table"] = MetadataValue.md(to_markdown(pl.DataFrame(value["curve"])))
        import io

        buf = io.BytesIO()
        training_curve_png(value["curve"]).save(buf, format="PNG")
        metadata.update(png_metadata(buf.getvalue(), "training_curve"))
    return metadata
