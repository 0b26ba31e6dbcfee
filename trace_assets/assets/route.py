"""Step 4 assets: grpo_baseline (equal-rollout GRPO on the target), router, router_eval (the report).

* ``grpo_baseline`` trains one LoRA with the same GRPO code on the target's train tasks, with a
  rollout budget equal to the sum of every current TRACE adapter's rollouts, calibration included
  (the paper's equal-rollout comparison); the budget is recorded.
* ``router`` reads every adapter partition (AllPartitionMapping), keeps the current C*, and builds
  the configured router (``logit``: the paper's label-logit router; ``retrieval``; ``hybrid``).
  Retrieval embeddings of the indexed prompts are computed once and stored with the asset; they
  are recomputed only when the indexed prompts (the synthetic environments) change.
* ``router_eval`` measures on the held-out test split only, greedy, at most ``rollout.max_steps``
  steps: base, TRACE routed, TRACE soft composition, each single adapter on every task, oracle
  routing, and the GRPO-on-target baseline; plus routing accuracy of every router against the
  oracle's choice. Routed and oracle rows reuse the single-adapter rollouts (greedy decoding makes
  them identical), so they cost no extra rollouts.
"""

import json
import math
from dataclasses import replace
from typing import Any

from dagster import AllPartitionMapping, AssetExecutionContext, AssetIn, DataVersion, Failure, MetadataValue, Output, asset

from resources.mlflow_registry import DEFAULT_ALIASES, MlflowRegistry
from resources.models import ModelResource
from resources.store import TraceStore
from trace_assets import paths
from trace_assets.envs import get_environment
from trace_assets.envs.splits import tasks_of
from trace_assets.paths import folder_checksum
from trace_assets.figures import png_metadata, to_markdown
from trace_assets.hashing import stable_hash
from trace_assets.settings import Settings

GROUP = "route"
ALL = AllPartitionMapping()
EVERY_TRAINED = {"allow_missing_partitions": True}
"""A capability whose environment failed its blocking check has no adapter partition; Step 4 goes on
with the capabilities that have one and names the others in its report."""


def by_partition(context: AssetExecutionContext, name: str, loaded: Any) -> dict[str, Any]:
    """The ``ALL``-mapped input ``name`` as ``{partition key: value}``, however many partitions exist.

    Dagster's filesystem IO manager (``UPathIOManager.load_partitions``) returns a dict only for two
    or more upstream partitions: the bare value for exactly one, and None for none (or for a single
    missing one under ``allow_missing_partitions``). A C* of one capability is the demo's case.
    """
    if loaded is None:
        return {}
    keys = list(context.asset_partition_keys_for_input(name))
    return {keys[0]: loaded} if len(keys) == 1 else dict(loaded)


def current_adapters(selected: dict, adapters: dict[str, dict]) -> dict[str, dict]:
    """The adapters of capabilities still in C* (a departed one keeps its history, not its route)."""
    return {name: adapters[name] for name in selected["names"] if name in adapters}


def routable_adapters(adapters: dict[str, dict], *, include_unpromoted: bool = False) -> dict[str, dict]:
    """The adapters the router may choose: those the promotion gate promoted (``lora_adapter``), or
    all with ``route.include_unpromoted``. Every adapter is still evaluated alone in the report."""
    return {n: a for n, a in adapters.items() if include_unpromoted or a.get("promoted")}


BASELINE_VERSION = "task-pool-shuffled-per-epoch"
"""Bumped when the baseline's recipe changes outside ``GRPOConfig`` (it was trained on the pool in
family order until 2026-11-30: whole iterations on one family)."""


def build_route_assets(settings: Settings) -> list:
    from trace_assets.agent.identity import planned_generation

    route_cfg, roll_cfg = settings.route, settings.rollout
    grpo_config = settings.train.grpo
    generation = planned_generation(settings.generation)  # a backend or dtype switch re-evaluates

    @asset(
        group_name=GROUP, pool="train", kinds={"pytorch", "mlflow"},
        code_version=stable_hash([grpo_config.identity(), BASELINE_VERSION]),
        ins={"lora_adapter": AssetIn(partition_mapping=ALL, metadata=EVERY_TRAINED),
             "synthetic_env": AssetIn(partition_mapping=ALL, metadata=EVERY_TRAINED)},
    )
    def grpo_baseline(
        context: AssetExecutionContext, models: ModelResource, mlflow: MlflowRegistry,
        task_splits: dict, base_agent: dict, selected_capabilities: dict, lora_adapter: Any, synthetic_env: Any,
    ) -> Output[dict[str, Any]]:
        """One LoRA trained by the same GRPO directly on the target's train tasks, at equal rollouts."""
        from sensors import record_worker

        record_worker(context)  # it holds the `train` slot: a killed worker must be reapable
        from trace_assets.route.evaluation import adapter_rollouts

        lora_adapter = by_partition(context, "lora_adapter", lora_adapter)
        synthetic_env = by_partition(context, "synthetic_env", synthetic_env)
        adapters = current_adapters(selected_capabilities, lora_adapter)
        # TRACE's whole spend: every adapter's GRPO and calibration rollouts, plus the calibration
        # rollouts of C* capabilities whose environment failed its check (spent, but no adapter).
        budget = sum(map(adapter_rollouts, adapters.values())) + sum(
            synthetic_env[n].get("calibration_rollouts", 0) for n in selected_capabilities["names"]
            if n not in adapters and n in synthetic_env)
        if not adapters:
            raise Failure("grpo_baseline: no capability of the current C* has an adapter (did every synthetic "
                          "environment fail its check?), so there is no TRACE to compare with")
        value = train_grpo_on_target(context, settings, models=models, mlflow=mlflow, base_agent=base_agent,
                                     tasks=tasks_of(task_splits, "train") + tasks_of(task_splits, "demo"),
                                     budget=budget, trace_adapters=sorted(adapters))
        return Output(value, data_version=DataVersion(value["adapter_checksum"][:16]), metadata={
            "budget_rollouts": value["budget_rollouts"], "rollouts": value["rollouts"],
            "iterations": value["iterations"], "mlflow_run_id": value["mlflow_run_id"],
            "model_version": value["model_version"], "trace_adapters": MetadataValue.json(value["trace_adapters"]),
        })

    @asset(
        group_name=GROUP, kinds={"python"}, code_version=stable_hash([route_cfg.__dict__, "router-selection-v1"]),
        ins={"lora_adapter": AssetIn(partition_mapping=ALL, metadata=EVERY_TRAINED),
             "synthetic_env": AssetIn(partition_mapping=ALL, metadata=EVERY_TRAINED)},
    )
    def router(
        context: AssetExecutionContext, models: ModelResource, store: TraceStore,
        selected_capabilities: dict, lora_adapter: Any, synthetic_env: Any, trajectory_splits: dict, base_agent: dict,
    ) -> Output[dict[str, Any]]:
        """The router over the current C*: candidates, their adapters, and the retrieval index cache."""
        lora_adapter = by_partition(context, "lora_adapter", lora_adapter)
        synthetic_env = by_partition(context, "synthetic_env", synthetic_env)
        value, metadata, version = build_router(context, settings, models=models, store=store,
                                                selected_capabilities=selected_capabilities,
                                                trained=current_adapters(selected_capabilities, lora_adapter),
                                                synthetic_env=synthetic_env, trajectory_splits=trajectory_splits,
                                                base_agent=base_agent)
        return Output(value, data_version=version, metadata=metadata)

    @asset(group_name=GROUP, kinds={"mlflow", "python"},
           code_version=stable_hash([route_cfg.__dict__, roll_cfg.__dict__, generation, "report-v4-nulls-on-twin-scale"]),
           ins={"lora_adapter": AssetIn(partition_mapping=ALL, metadata=EVERY_TRAINED)})
    def router_eval(
        context: AssetExecutionContext, models: ModelResource, store: TraceStore, mlflow: MlflowRegistry,
        task_splits: dict, base_agent: dict, router: dict, grpo_baseline: dict, lora_adapter: Any,
        selected_capabilities: dict,
    ) -> Output[dict[str, Any]]:
        """Held-out test evaluation of every system on the same tasks, and the results report."""
        from trace_assets.route.evaluation import evaluate_systems

        lora_adapter = by_partition(context, "lora_adapter", lora_adapter)
        report = evaluate_systems(
            settings, models, store, task_splits=task_splits, base_agent=base_agent, router=router,
            grpo_baseline=grpo_baseline, adapters=current_adapters(selected_capabilities, lora_adapter),
            log=context.log.info,
        )
        untrained = [n for n in selected_capabilities["names"] if n not in lora_adapter]
        if untrained:
            context.log.warning(f"capabilities of C* without an adapter (their environment failed its check): {untrained}")
            report["markdown"] += (f"\n\n### Not trained\nIn C* but without an adapter (the synthetic environment "
                                   f"failed its blocking check; see `synthetic_env`): {', '.join(untrained)}")
        run_id = mlflow.log_report(report["markdown"], report["pngs"], report["metrics"])
        metadata: dict[str, Any] = {
            "report": MetadataValue.md(report["markdown"]), "mlflow_run_id": run_id,
            "systems": MetadataValue.md(to_markdown(report["systems"])),
            "routing": MetadataValue.md(to_markdown(report["routing"])),
            "confusion": MetadataValue.md(to_markdown(report["confusion"])),
            "paired": MetadataValue.md(to_markdown(report["paired"])),
            "null_controls": MetadataValue.md(to_markdown(report["nulls"])),
            "fidelity": MetadataValue.md(to_markdown(report["fidelity"])),
            "agent_id": report["agent_id"], "agent": MetadataValue.json(report["agent"]),
            "attribution": MetadataValue.json(report["attribution"]),
            "rollouts_spent": MetadataValue.json(report["rollouts_spent"]),
        }
        for name, png in report["pngs"].items():
            metadata.update(png_metadata(png, name))
        paths.atomic_write(paths.sub("reports") / "latest_report.md", report["markdown"])
        frames = ("pngs", "systems", "routing", "confusion", "paired", "nulls", "fidelity")
        value = {k: v for k, v in report.items() if k not in frames}
        value["nulls"] = report["nulls"].to_dicts()
        value["fidelity"] = report["fidelity"].to_dicts()
        value["systems"] = report["systems"].to_dicts()
        value["paired"] = report["paired"].to_dicts()
        return Output(value, data_version=DataVersion(stable_hash(value["metrics"])), metadata=metadata)

    return [grpo_baseline, router, router_eval]


ROUTER_VALIDATION_SHIFT = 100_000
"""Synthetic seeds that measure the routers start this far after the index's (``route.index_offset``)."""


def _jsonable_state(state: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in state.items()}


BINARY_REWARD = "target-binary-success"
"""``reward`` of :func:`train_grpo_on_target` for the ablation: 1 for a successful episode, else 0."""


def train_grpo_on_target(context: AssetExecutionContext, settings: Settings, *, models: ModelResource,
                         mlflow: MlflowRegistry, base_agent: dict, tasks: list, budget: int, trace_adapters: list[str],
                         name: str = "grpo_target", reward: str = "target", aliases=DEFAULT_ALIASES) -> dict[str, Any]:
    """One LoRA trained by GRPO (``settings.train.grpo``, whose seed drives sampling and
    initialization) on the target's ``tasks`` for ``ceil(budget / (G K))`` iterations, the
    equal-rollout baseline. ``reward``: ``"target"`` (the episode's own reward) or
    :data:`BINARY_REWARD`. Its folder is keyed by base, config, tasks and reward, so a finished
    run is reused and a killed one resumes from its checkpoint; registered in MLflow as ``name``
    with ``aliases``. Returns its manifest."""
    from trace_assets.assets.train import train_grpo
    from trace_assets.envs.splits import TaskPoolEnv
    from trace_assets.train.runs import train_or_reuse

    if reward not in ("target", BINARY_REWARD):
        raise ValueError(f"reward {reward!r} is neither 'target' nor {BINARY_REWARD!r}")
    grpo_config = settings.train.grpo
    per_iteration = grpo_config.groups * grpo_config.samples_per_group
    iterations = max(1, math.ceil(budget / per_iteration))
    config = replace(grpo_config, iterations=iterations)
    env = TaskPoolEnv(get_environment(settings.tasks.env), tasks, seed=grpo_config.seed)
    identity = [base_agent.get("checksum") or base_agent["path"], config.identity(), [t.task_id for t in env.tasks], BASELINE_VERSION]
    key = stable_hash(identity if reward == "target" else [*identity, reward])  # the baseline's folder as it was
    out_dir = paths.sub("adapters", "_grpo_target", key)

    def train() -> dict[str, Any]:
        context.log.info(f"{name}: GRPO on {len(env.tasks)} target tasks, reward {reward}, budget {budget} rollouts = "
                         f"{iterations} iterations x {per_iteration}")
        reward_fn = (lambda rollout: float(bool(rollout.result.success))) if reward == BINARY_REWARD else None
        _, result = train_grpo(models, base_agent, env, config, out_dir, what=name, tag=name, log=context.log.info,
                               reward_fn=reward_fn)
        registered = mlflow.log_training(
            name, adapter_dir=result.adapter_dir, history=result.history, aliases=tuple(aliases),
            params={**config.to_dict(), "budget_rollouts": budget, "reward": reward},
            lineage={"capability": name, "base_model": models.base_model, "dagster_run_id": context.run_id},
        )
        return {
            "adapter_dir": str(result.adapter_dir), "adapter_checksum": folder_checksum(result.adapter_dir),
            "budget_rollouts": budget, "rollouts": result.rollouts_played,
            "tokens": sum(m.loss_tokens for m in result.history), "reward": reward,
            "families": sorted({t.family for t in env.tasks}),
            "iterations": len(result.history), "mlflow_run_id": registered.run_id,
            "model_version": registered.version, "trace_adapters": trace_adapters,
        }

    return train_or_reuse(out_dir, train)[0]


def build_router(context: AssetExecutionContext, settings: Settings, *, models: ModelResource, store: TraceStore,
                 selected_capabilities: dict, trained: dict[str, dict], synthetic_env: dict[str, dict],
                 trajectory_splits: dict, base_agent: dict):
    """``(value, metadata, data version)`` of the router over the ``trained`` adapters of C* (what
    ``router`` materializes; the experiment builds one per training seed): the routable candidates,
    the retrieval index (its embeddings cached by content) and the router selection on train-side
    held-out prompts."""
    from trace_assets.route.router import example_text, first_user_prompt
    from trace_assets.synthesize import environment_of, example_conversations

    route_cfg = settings.route
    adapters = routable_adapters(trained, include_unpromoted=route_cfg.include_unpromoted)
    refused = {n: (a.get("promotion") or {}).get("reason", "not evaluated by the promotion gate")
               for n, a in trained.items() if n not in adapters}
    for n, reason in refused.items():
        context.log.warning(f"router: {n} is not routed to: {reason}")
    target = get_environment(settings.tasks.env)
    candidates, index = [], {}
    for name in adapters:
        env = environment_of(json.loads(open(synthetic_env[name]["spec_path"]).read()), target)
        tasks = env.sample_tasks(route_cfg.index_prompts, offset=route_cfg.index_offset)
        index[name] = [first_user_prompt(env, t) for t in tasks]
        [messages] = example_conversations(env, tasks[:1])  # one conversation of its environment
        description = next(c["description"] for c in selected_capabilities["capabilities"] if c["name"] == name)
        candidates.append({"name": name, "description": description, "example": example_text(messages)})
    wanted = set(trajectory_splits["d_plus"])
    succeeded = [t["messages"][1]["content"] for t in store.trajectories(split="train", policy="base")
                 if t["trajectory_id"] in wanted]  # D+ ids are the base agent's own (trajectory_splits)
    # Every 4th successful train prompt is held out to measure the routers; the rest is indexed.
    base_prompts = [p for i, p in enumerate(succeeded) if i % 4 != 3][: route_cfg.index_prompts * 2]
    held_out_base = succeeded[3::4]
    index_key = stable_hash([route_cfg.embedder, index, base_prompts])
    state = None
    if route_cfg.kind in ("retrieval", "hybrid") and adapters:
        from trace_assets.route.retrieval import RetrievalRouter, make_embedder

        cache = paths.sub("router") / f"{index_key}.json"
        if cache.exists():
            state = json.loads(cache.read_text())
            context.log.info("retrieval index embeddings reused (indexed prompts unchanged)")
        else:
            model, tokenizer = models.load(base_agent["path"]) if route_cfg.embedder == "hidden" else (None, None)
            embedder = make_embedder(route_cfg.embedder, model, tokenizer)
            full_index = {**index, None: base_prompts}
            state = _jsonable_state(RetrievalRouter(embedder, full_index, mode=route_cfg.mode, k=route_cfg.k,
                                                    threshold=route_cfg.threshold).state())
            paths.atomic_write(cache, json.dumps(state))
    value = {
        "kind": route_cfg.kind, "candidates": candidates, "index_key": index_key,
        "adapters": {n: {"adapter_dir": a["adapter_dir"], "model_version": a["model_version"]} for n, a in adapters.items()},
        "retrieval_state_path": str(paths.sub("router") / f"{index_key}.json") if state else None,
        "not_routed": refused,
    }
    metadata: dict[str, Any] = {
        "kind": route_cfg.kind, "embedder": route_cfg.embedder, "candidates": MetadataValue.json([c["name"] for c in candidates]),
        "index_key": index_key, "adapters": MetadataValue.json(value["adapters"]),
        "not_routed": MetadataValue.json(refused),
    }
    if candidates:
        selection = _router_selection(context, settings, models, base_agent, value, target, adapters, synthetic_env, held_out_base)
        value["selection"] = selection.to_dicts()
        metadata["router_selection"] = MetadataValue.md(
            "Routing accuracy on held-out prompts of the TRAIN side (synthetic seeds apart from the index, "
            f"and {len(held_out_base)} held-out successful train prompts labelled base); never the test split.\n\n"
            + to_markdown(selection))
    return value, metadata, DataVersion(stable_hash([value["adapters"], index_key, route_cfg.__dict__, value.get("selection"), refused]))


def _router_selection(context, settings, models, base_agent, value, target, adapters, synthetic_env, held_out_base):
    """Accuracy of every router on train-side held-out prompts: how the configured default is chosen."""
    import polars as pl

    from trace_assets.route.evaluation import build_routers
    from trace_assets.route.report import routing_accuracy
    from trace_assets.route.router import first_user_prompt
    from trace_assets.synthesize import environment_of

    route_cfg = settings.route
    prompts, labels = [], []
    for name in adapters:
        env = environment_of(json.loads(open(synthetic_env[name]["spec_path"]).read()), target)
        for task in env.sample_tasks(route_cfg.index_prompts, offset=route_cfg.index_offset + ROUTER_VALIDATION_SHIFT):
            prompts.append(first_user_prompt(env, task))
            labels.append(name)
    prompts += held_out_base
    labels += [None] * len(held_out_base)
    model, tokenizer = models.load(base_agent["path"])
    decisions = build_routers(settings, model, tokenizer, value, value["candidates"], prompts, context.log.info)
    n_capability = len(prompts) - len(held_out_base)
    rows = [{"router": name, "accuracy": routing_accuracy(ds, labels),
             "accuracy_capability_prompts": routing_accuracy(ds[:n_capability], labels[:n_capability]),
             "accuracy_base_prompts": routing_accuracy(ds[n_capability:], labels[n_capability:])
             if held_out_base else None, "prompts": len(prompts)}
            for name, ds in decisions.items()]
    table = pl.DataFrame(rows).sort("accuracy", descending=True)
    context.log.info(f"router selection (train-side held-out prompts):\n{to_markdown(table)}")
    return table
