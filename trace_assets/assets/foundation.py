"""Foundation assets: task_splits -> base_agent -> base_trajectories -> trajectory_splits (D+, D-).

Thin Dagster wrappers: the logic lives in ``envs``, ``agent`` and ``trajectories``. Each asset
returns a data version derived from its content, and carries the hash of the settings that shape
it in ``code_version``, so that only what a change touches becomes stale.
"""


import json
from typing import Any

from dagster import (
    AssetExecutionContext,
    AssetsDefinition,
    DataVersion,
    Failure,
    MetadataValue,
    Output,
    asset,
)

from resources.models import ModelResource
from resources.store import PIPELINE_SOURCE, TraceStore
from trace_assets import paths
from trace_assets.paths import folder_checksum
from trace_assets.envs import get_environment
from trace_assets.envs.splits import configured_splits, split_overlaps, tasks_of
from trace_assets.figures import success_by_family, to_markdown
from trace_assets.hashing import stable_hash
from trace_assets.settings import Settings
from trace_assets.trajectories import render_markdown

GROUP = "foundation"


def build_foundation_assets(settings: Settings) -> list[AssetsDefinition]:
    task_cfg, warm_cfg, roll_cfg = settings.tasks, settings.warmstart, settings.rollout
    from trace_assets.agent.identity import planned_generation

    generation = planned_generation(settings.generation)  # a backend or dtype switch re-rolls the base
    # What shapes the warm-started weights; micro-batching and checkpointing only bound memory.
    warm_identity = {k: v for k, v in warm_cfg.__dict__.items() if k not in ("micro_batch_size", "gradient_checkpointing")}

    @asset(group_name=GROUP, code_version=settings.section_hash("tasks"), kinds={"python"})
    def task_splits(context: AssetExecutionContext) -> Output[dict[str, list[dict[str, Any]]]]:
        """Seeded train/test tasks of the target environment, stratified by family.

        ``demo`` tasks warm-start the demo agent, ``train`` tasks feed Step 1, ``test`` tasks are
        held out for measurement only.
        """
        env = get_environment(task_cfg.env)
        splits = configured_splits(env, task_cfg)
        overlaps = split_overlaps(splits)
        if overlaps:  # the test split must be unseen by Steps 1-3, by task and by database
            raise Failure(f"task_splits: the test split overlaps what Steps 1-3 see: {overlaps[:5]}")
        value = {name: [t.to_dict() for t in tasks] for name, tasks in splits.items()}
        counts = {
            family: {name: sum(t.family == family for t in tasks) for name, tasks in splits.items()}
            for family in env.families()
        }
        table = "| family | demo | train | test |\n|---|---|---|---|\n" + "\n".join(
            f"| {f} | {c['demo']} | {c['train']} | {c['test']} |" for f, c in counts.items()
        )
        return Output(
            value,
            data_version=DataVersion(stable_hash({k: [t["task_id"] for t in v] for k, v in value.items()})),
            metadata={
                "env": task_cfg.env,
                "n_demo": len(value["demo"]), "n_train": len(value["train"]), "n_test": len(value["test"]),
                "by_family": MetadataValue.md(table),
            },
        )

    @asset(
        group_name=GROUP,
        code_version=stable_hash([settings.base_model, stable_hash(warm_identity)]),
        kinds={"pytorch"},
    )
    def base_agent(context: AssetExecutionContext, models: ModelResource, task_splits: dict) -> Output[dict[str, Any]]:
        """The frozen base agent of TRACE: the base model, warm-started on expert demos if enabled.

        The result is cached under ``<data>/models/base_agent/<key>`` where the key hashes the base
        model, the warm-start settings and the demo tasks; an intact cached folder is reused.
        """
        from trace_assets.agent.warmstart import report_dict, train_warmstart

        source = models.base_model
        if not warm_cfg.enabled:
            path = models.resolve(source)
            return Output(
                {"path": path, "source": source, "warmstart": None, "checksum": None},
                data_version=DataVersion(stable_hash([path, source])),
                metadata={"model_path": path, "warmstart": "disabled: the base model is used as is"},
            )
        demo_tasks = tasks_of(task_splits, "demo")
        key = stable_hash([source, warm_identity, [t.task_id for t in demo_tasks]])
        folder = paths.models_dir() / "base_agent" / key
        manifest = folder / "trace_manifest.json"
        if manifest.exists() and json.loads(manifest.read_text())["checksum"] == folder_checksum(folder):
            value = json.loads(manifest.read_text())
            context.log.info(f"Reusing the warm-started agent at {folder} (checksum verified)")
        else:
            context.log.info(f"Warm-starting {source} on {len(demo_tasks)} expert demos")
            env = get_environment(task_cfg.env)

            def progress(step: int, total: int, loss: float) -> None:
                if step == 1 or step % 4 == 0 or step == total:
                    context.log.info(f"warm-start step {step}/{total} loss {loss:.4f}")

            with paths.atomic_folder(folder) as tmp:
                report = train_warmstart(
                    models.resolve(source), env, demo_tasks, tmp, epochs=warm_cfg.epochs, lr=warm_cfg.lr,
                    lora_r=warm_cfg.lora_r, lora_alpha=warm_cfg.lora_alpha, batch_size=warm_cfg.batch_size,
                    micro_batch_size=warm_cfg.micro_batch_size, gradient_checkpointing=warm_cfg.gradient_checkpointing,
                    confirm_rate=warm_cfg.confirm_rate, max_length=warm_cfg.max_length, seed=task_cfg.seed,
                    progress=progress,
                )
                value = {"path": str(folder), "source": source, "warmstart": report_dict(report),
                         "checksum": folder_checksum(tmp)}
                (tmp / "trace_manifest.json").write_text(json.dumps(value, indent=2))
        ws = value["warmstart"]
        return Output(
            value,
            data_version=DataVersion(value["checksum"][:16]),
            metadata={
                # Not "path": the IO manager writes its pickle's path under that key, over ours.
                "model_path": value["path"], "base_model": source, "checksum": value["checksum"],
                "demos": ws["n_demos"], "epochs": ws["epochs"], "train_time_s": ws["train_time_s"],
                "bf16_autocast": ws["bf16"], "final_loss": ws["losses"][-1] if ws["losses"] else None,
                "demo_families": MetadataValue.json(ws["demo_families"]),
            },
        )

    @asset(group_name=GROUP, code_version=stable_hash([settings.section_hash("rollout"), generation]), kinds={"duckdb"})
    def base_trajectories(
        context: AssetExecutionContext, models: ModelResource, store: TraceStore, task_splits: dict, base_agent: dict
    ) -> Output[dict[str, Any]]:
        """The base agent rolled out (greedy) on the train and test tasks, stored in DuckDB.

        Train trajectories feed Step 1; test trajectories are the base row of the final report.
        Rollouts are deterministic at T = 0, so ids repeat and re-materialising adds nothing twice.
        Every row carries the agent's identity (base checksum, no adapter, backend, dtype): another
        warm-start or dtype writes new rows beside the old ones, and readers select by ``agent_id``.
        """
        from trace_assets.agent.identity import agent_id, agent_identity
        from trace_assets.agent.rollout import RolloutConfig, logged_progress, rollout_to_record, run_rollouts

        env = get_environment(task_cfg.env)
        tasks = tasks_of(task_splits, "train") + tasks_of(task_splits, "test")
        split_of = {t["task_id"]: name for name in ("train", "test") for t in task_splits[name]}
        from trace_assets.agent.model import load_tokenizer

        tokenizer = load_tokenizer(base_agent["path"])
        backend = models.backend_for(base_agent["path"])
        identity = agent_identity(base_agent, backend)
        agent = agent_id(identity)
        context.log.info(f"generation backend: {models.backend_label(backend)}; agent {agent} {identity}")
        config = RolloutConfig.from_limits(roll_cfg, temperature=roll_cfg.temperature, seed=roll_cfg.seed)
        rollouts = run_rollouts(env, tasks, backend, tokenizer, config,
                                progress=logged_progress(context.log.info, "base rollouts"))
        records = [
            rollout_to_record(r, policy="base", source=PIPELINE_SOURCE, split=split_of[r.task.task_id], agent_id=agent)
            for r in rollouts
        ]
        ids = sorted(r["trajectory_id"] for r in records)
        inserted = store.insert_trajectories(records, batch_name=f"base_rollout_{stable_hash(ids, 12)}")
        table = success_by_family(records)
        sample = next((r for r in records if r["split"] == "train" and not r["success"]), records[0])
        return Output(
            {"trajectory_ids": ids, "n": len(records), "agent_id": agent, "agent": identity},
            data_version=DataVersion(stable_hash(ids)),
            metadata={
                "episodes": len(records), "new_rows": inserted, "generation_backend": models.backend_label(backend),
                "agent_id": agent, "agent": MetadataValue.json(identity),
                "generated_tokens": sum(r.n_generated for r in rollouts),
                "success_by_family": MetadataValue.md(to_markdown(table)),
                "sample_failed_trajectory": MetadataValue.md(render_markdown(sample["messages"])),
            },
        )

    @asset(group_name=GROUP, kinds={"duckdb"})
    def trajectory_splits(context: AssetExecutionContext, store: TraceStore, base_trajectories: dict) -> Output[dict[str, Any]]:
        """D+ and D-: the train-split trajectories of the base agent, split by success.

        The base agent's own rows (its ``agent_id``, never another warm-start's or dtype's), plus
        imported user trajectories (policy ``base``, split ``train``, no agent id). Never reads test.
        """
        if "agent_id" not in base_trajectories:
            raise Failure("trajectory_splits: base_trajectories was materialized before trajectories carried the "
                          "identity of their agent; re-materialize base_trajectories (its stored rows stay in DuckDB, "
                          "new rows are added beside them), then this asset")
        records = store.agent_trajectories(split="train", agent_id=base_trajectories["agent_id"])
        # An episode the environment broke (a crashed or malformed MCP server, a failing user
        # simulator) says nothing about the agent: neither D+ nor D-.
        broken = lambda r: bool((r.get("info") or {}).get("env_error") or (r.get("info") or {}).get("runner_error"))
        env_errors = [r["trajectory_id"] for r in records if broken(r)]
        records = [r for r in records if not broken(r)]
        d_plus = sorted(r["trajectory_id"] for r in records if r["success"])
        d_minus = sorted(r["trajectory_id"] for r in records if not r["success"])
        table = success_by_family(records)
        sample = next((r for r in records if not r["success"]), records[0] if records else None)
        metadata: dict[str, Any] = {
            "n_d_plus": len(d_plus), "n_d_minus": len(d_minus), "n_env_errors": len(env_errors),
            "success_by_family": MetadataValue.md(to_markdown(table)),
        }
        if sample:
            metadata["sample_failure"] = MetadataValue.md(render_markdown(sample["messages"]))
        return Output(
            {"d_plus": d_plus, "d_minus": d_minus, "agent_id": base_trajectories["agent_id"]},
            data_version=DataVersion(stable_hash([d_plus, d_minus])),
            metadata=metadata,
        )

    return [task_splits, base_agent, base_trajectories, trajectory_splits]
