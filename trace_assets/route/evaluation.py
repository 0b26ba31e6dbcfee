"""Held-out evaluation of every system on the same test tasks, and the results report.

Contract of :func:`evaluate_systems`: greedy decoding on the ``test`` split only (never used by
Step 1), at most ``settings.rollout.max_steps`` steps. Systems: ``base`` (the base agent's test
trajectories stored by ``base_trajectories`` under the identity of the agent this evaluation
decodes with, same greedy config; played and stored here when missing), every single adapter on
every task, each adapter's null control (``null:<name>``: random directions with its per-layer
norms), ``trace_routed`` (the configured router's argmax choice among promoted adapters),
``trace_soft`` (top-p composition), ``oracle`` (best adapter per task in hindsight, an upper bound)
and ``grpo_target`` (the equal-rollout baseline). Routed, oracle and routing-accuracy rows reuse the
single-adapter rollouts: greedy decoding makes a routed episode identical to the same adapter's
episode, so only soft compositions that really mix adapters cost new rollouts.

Before an adapter (or a soft composition) is evaluated, a fidelity probe checks that its effect
survives the path it is evaluated through (``agent.fidelity``: log-prob shifts against PEFT fp32 on
the base agent's own train-side conversations); a path that fails stops the evaluation. Every
system runs on the same engine, hence in the same dtype.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl

from trace_assets import paths
from trace_assets.envs import get_environment
from trace_assets.envs.base import check_outcomes
from trace_assets.envs.splits import tasks_of
from trace_assets.figures import to_markdown
from trace_assets.hashing import stable_hash

BASELINE = "grpo_target"
NULL_PREFIX = "null:"
"""Null-control systems are named ``null:<adapter>`` (``:`` is never part of a capability name)."""
PROBE_CONVERSATIONS = 4
EVALUATED_POLICY = "evaluated"
"""The ``policy`` of the test-split episodes an evaluation stored for a system other than the base
(its agent id names the adapter); Step 1 and the router read ``base`` rows only."""


def greedy_rollout_config(settings):
    """The evaluation's episodes: greedy, with the ``[rollout]`` limits (what ``base_trajectories`` plays)."""
    from trace_assets.agent.rollout import RolloutConfig

    return RolloutConfig.from_limits(settings.rollout, temperature=0.0, seed=settings.rollout.seed)


def adapter_checksum(folder: str | Path) -> str:
    """What an adapter folder applies: its weight bytes and its ``adapter_config.json`` (rank,
    scaling, target modules). Raises on a folder without weights: two such folders must never
    share an identity."""
    folder = Path(folder)
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"{folder}: no adapter weights (*.safetensors)")
    config = folder / "adapter_config.json"
    return stable_hash([paths.folder_checksum(folder), config.read_text() if config.exists() else None])


def adapter_rollouts(adapter: dict[str, Any]) -> int:
    """What one TRACE adapter cost in rollouts: its GRPO rollouts plus its environment's calibration."""
    return adapter["rollouts"] + adapter.get("calibration_rollouts", 0)


def build_routers(settings, model, tokenizer, router_value, candidates, first_prompts, log):
    """Decisions of every router we can build here on ``first_prompts``: {router name: [Decision]}.

    Routers: ``logit``; ``retrieval_minilm`` and ``retrieval_hidden`` (the router asset's cached
    index state for the configured embedder, a fresh index for the other); ``hybrid`` (on the
    configured embedder). An embedder that cannot load is logged and skipped.
    """
    from trace_assets.route.retrieval import HybridRouter, RetrievalRouter, make_embedder
    from trace_assets.route.router import LogitRouter, RouterCandidate

    cands = [RouterCandidate(c["name"], c["description"], c["example"]) for c in candidates]
    out: dict[str, list] = {}
    if not cands:
        return out
    out["logit"] = LogitRouter(model, tokenizer, cands).route(first_prompts)
    state = json.loads(Path(router_value["retrieval_state_path"]).read_text()) if router_value.get("retrieval_state_path") else None
    index = None
    if state is not None:
        index = {(None if k == "__base__" else k): v for k, v in state["index"].items()}
    for embedder_name in ("minilm", "hidden"):
        try:
            embedder = make_embedder(embedder_name, model, tokenizer)
        except Exception as exc:  # an embedder that cannot load here is reported, not fatal
            log(f"router {embedder_name}: unavailable ({exc})")
            continue
        if index is None:
            continue
        r = settings.route
        if state is not None and state["embedder_id"] == embedder.id:
            retrieval = RetrievalRouter.from_state(state, embedder, index=index)
        else:
            retrieval = RetrievalRouter(embedder, index, mode=r.mode, k=r.k, threshold=r.threshold)
        out[f"retrieval_{embedder_name}"] = retrieval.route(first_prompts)
        if embedder_name == settings.route.embedder:
            out["hybrid"] = HybridRouter.from_candidates(retrieval, model, tokenizer, cands).route(first_prompts)
    return out


def system_backend(models, path: str, name: str, folder: str, active: Any, tokenizer: Any) -> Any:
    """The backend ``evaluate_systems`` generates system ``name`` (adapter ``folder``) through:
    a LoRA request on a LoRA engine, else ``models.peft_backend`` on ``active`` (the bank's model
    with that adapter active)."""
    engine = models.vllm_engine(path, lora=True)
    if engine is not None:
        from trace_assets.agent.vllm_backend import VLLMBackend

        engine.ensure_adapter(name, folder)
        return VLLMBackend(engine, adapter=name)
    return models.peft_backend(path, active, tokenizer)


def faithful_models(models, path: str, bank, folders: dict[str, str], tokenizer: Any, probe, log: Callable[[str], None]):
    """``(models, fidelity rows)``: the configured generation if every system of ``bank`` keeps its
    adapter's effect through it (``agent.fidelity``), else the same in float32 (``models.exact()``);
    ``FidelityError`` when even float32 loses one (a stale or missing adapter).

    A null control ``null:<c>`` is judged on the scale of its twin ``<c>`` (``FidelityReport.problems``'
    ``scale``): the path must get its shift right to within the error, in nats, that ``<c>`` is
    allowed. Its own shift is usually below bf16's rounding, and relative bounds would send every
    system to float32 for a control that moves nothing."""
    from trace_assets.agent import fidelity

    if probe is None:
        log("no train-side conversations of the base agent to probe fidelity with: not measured")
        return models, []
    names = sorted(bank.names, key=lambda n: n.startswith(NULL_PREFIX))  # twins before their nulls
    candidates = models.fidelity_candidates(path)
    for i, candidate in enumerate(candidates):
        rows, reports, failed = [], {}, None
        for name in names:
            with bank.use(name) as active:
                backend = system_backend(candidate, path, name, folders[name], active, tokenizer)
                report = fidelity.check_backend(candidate.backend_label(backend), active, backend, probe)
            twin = reports.get(name[len(NULL_PREFIX):]) if name.startswith(NULL_PREFIX) else None
            scale = twin.rms_shift_ref if twin is not None else None
            reports[name] = report
            passed = report.passed(scale=scale)
            rows.append({"system": name, **report.to_dict(), "judged_on_scale": scale, "passed": passed})
            log(f"fidelity {name}: {report.line()}" + (f" (a control: judged on its twin's shift rms {scale:.4f})" if scale else ""))
            if not passed:
                failed = (report, scale)
                break
        if failed is None:
            if i:
                log("the configured dtype lost an adapter's effect: every system is evaluated in float32")
            return candidate, rows
        report, scale = failed
        if i == len(candidates) - 1:
            fidelity.require(report, f"router_eval: {rows[-1]['system']}", scale=scale)
        log(f"{rows[-1]['system']}: {'; '.join(report.problems(scale=scale))}: retrying every system in float32")
    raise AssertionError("unreachable")


def evaluate_systems(settings, models, store, *, task_splits: dict, base_agent: dict, router: dict,
                     grpo_baseline: dict | None, adapters: dict[str, dict], log: Callable[[str], None],
                     more_baselines: dict[str, dict] | None = None) -> dict[str, Any]:
    """Evaluate every system (module docstring). ``grpo_baseline=None`` leaves the baseline out,
    e.g. to look at routing before the equal-rollout baseline has been trained. ``more_baselines``:
    further trained adapters evaluated like the baseline, ``{system name: {"adapter_dir", "rollouts"}}``
    (the experiment's ablation). ``per_task`` in the result holds every system's reward per test
    task, in the order of ``task_ids``; ``checks`` the same systems' per-check outcomes per task
    (``envs.base.check_outcomes``), but TRACE's soft composition."""
    from trace_assets.agent.rollout import logged_progress, run_rollouts
    from trace_assets.route.compose import AdapterBank, plan_groups
    from trace_assets.route.report import (
        attribution, confusion_matrix, oracle_choice, oracle_rewards, plot_success_by_system,
        paired_comparison, plot_success_vs_rollouts, routed_rewards, routing_accuracy, success_table,
    )
    from trace_assets.route.router import first_user_prompt

    from trace_assets.agent import fidelity
    from trace_assets.agent.identity import agent_id, agent_identity
    from trace_assets.agent.rollout import rollout_to_record
    from resources.store import PIPELINE_SOURCE

    env = get_environment(settings.tasks.env)
    tasks = tasks_of(task_splits, "test")
    ids = [t.task_id for t in tasks]
    families = [t.family for t in tasks]
    config = greedy_rollout_config(settings)

    model, tokenizer = models.load(base_agent["path"])
    bank_paths = {name: a["adapter_dir"] for name, a in adapters.items()}
    bank_paths.update({f"{NULL_PREFIX}{name}": a["null_dir"] for name, a in adapters.items() if a.get("null_dir")})
    if grpo_baseline is not None:
        bank_paths[BASELINE] = grpo_baseline["adapter_dir"]
    more_baselines = dict(more_baselines or {})
    bank_paths.update({name: b["adapter_dir"] for name, b in more_baselines.items()})
    bank = AdapterBank(model, bank_paths)
    configured_id = agent_id(agent_identity(base_agent, models.backend_for(base_agent["path"], model, tokenizer)))
    conversations = [r["messages"] for r in store.agent_trajectories(split="train", agent_id=configured_id)[:PROBE_CONVERSATIONS]]
    probe = fidelity.make_probe(tokenizer, conversations, env.tool_schemas()) if conversations else None
    # Every system's path is probed before anything is evaluated; one that loses an adapter's effect
    # in the configured dtype moves the WHOLE comparison (base included) to float32.
    models, fidelity_rows = faithful_models(models, base_agent["path"], bank, bank_paths, tokenizer, probe, log)

    base_backend = models.backend_for(base_agent["path"], model, tokenizer)
    identity = agent_identity(base_agent, base_backend)
    base_id = agent_id(identity)
    log(f"base agent {base_id} {identity}")
    stored = {r["task_id"]: r for r in store.agent_trajectories(split="test", agent_id=base_id, imported=False)}
    missing = [t for t in tasks if t.task_id not in stored]
    if missing:  # a test split extended, or another backend or dtype than base_trajectories ran
        log(f"running the base agent {base_id} on {len(missing)} test tasks without its stored trajectories")
        records = [rollout_to_record(r, policy="base", source=PIPELINE_SOURCE, split="test", agent_id=base_id)
                   for r in run_rollouts(env, missing, base_backend, tokenizer, config,
                                           progress=logged_progress(log, "base on the test split"))]
        store.insert_trajectories(records, batch_name=f"base_rollout_{base_id}_{stable_hash(sorted(r['trajectory_id'] for r in records), 12)}")
        stored.update({r["task_id"]: r for r in records})
    per_system: dict[str | None, list[float]] = {None: [float(stored[i]["reward"]) for i in ids]}
    success: dict[str | None, list[bool]] = {None: [bool(stored[i]["success"]) for i in ids]}
    checks: dict[str | None, list[dict[str, bool]]] = {None: [check_outcomes(stored[i]["info"]) for i in ids]}
    engine = models.vllm_engine(base_agent["path"], lora=True)

    def check(name: str, active: Any, backend: Any) -> None:
        """The fidelity probe of a soft composition's path, before it is evaluated."""
        if probe is None:
            return
        report = fidelity.check_backend(models.backend_label(backend), active, backend, probe)
        fidelity_rows.append({"system": name, **report.to_dict(), "passed": report.passed()})
        log(f"fidelity {name}: {report.line()}")
        fidelity.require(report, f"router_eval: {name}")

    eval_rollouts = {"base": 0}
    if engine is not None:  # every adapter on every task in ONE engine: batches mix LoRA requests
        from trace_assets.agent.vllm_backend import VLLMBackend

        names = list(bank_paths)
        for name, folder in bank_paths.items():
            engine.ensure_adapter(name, folder)
        log(f"evaluating {len(names)} adapters on {len(tasks)} test tasks in one vLLM batch (mixed LoRA requests)")
        rollouts = run_rollouts(env, [t for _ in names for t in tasks], VLLMBackend(engine), tokenizer, config,
                                progress=logged_progress(log, f"{len(names)} adapters on the test split"),
                                adapters=[n for n in names for _ in tasks])
        for j, name in enumerate(names):
            chunk = rollouts[j * len(tasks) : (j + 1) * len(tasks)]
            per_system[name] = [r.result.reward for r in chunk]
            success[name] = [r.result.success for r in chunk]
            checks[name] = [check_outcomes(r.result.info) for r in chunk]
            eval_rollouts[name] = len(chunk)
    else:  # one system at a time; with vLLM its merged weights are pushed into the base engine
        # Each system's episodes are stored as they end, keyed by who played them (base, adapter
        # bytes, backend, dtype) and how (the greedy config): a killed evaluation resumes with the
        # systems it had finished, and greedy episodes replay the same, so reuse changes nothing.
        for name in bank_paths:
            with bank.use(name) as active:
                backend = models.peft_backend(base_agent["path"], active, tokenizer)
                played_by = agent_id({**agent_identity(base_agent, backend, adapter=f"{name}@{adapter_checksum(bank_paths[name])}"),
                                      "episodes": stable_hash(dataclasses.asdict(config))})
                kept = {r["task_id"]: r for r in store.agent_trajectories(split="test", agent_id=played_by,
                                                                          policy=EVALUATED_POLICY, imported=False)}
                missing = [t for t in tasks if t.task_id not in kept]
                if missing:
                    log(f"evaluating {name} on {len(missing)} test tasks (agent {played_by})")
                    records = [rollout_to_record(r, policy=EVALUATED_POLICY, source=PIPELINE_SOURCE, split="test",
                                                 agent_id=played_by)
                               for r in run_rollouts(env, missing, backend, tokenizer, config, progress=logged_progress(log, name))]
                    store.insert_trajectories(records, batch_name=f"evaluation_{played_by}_{stable_hash(sorted(r['trajectory_id'] for r in records), 12)}")
                    kept.update({r["task_id"]: r for r in records})
                else:
                    log(f"{name}: its {len(tasks)} test episodes are stored (agent {played_by}): reused")
            per_system[name] = [float(kept[i]["reward"]) for i in ids]
            success[name] = [bool(kept[i]["success"]) for i in ids]
            checks[name] = [check_outcomes(kept[i]["info"]) for i in ids]
            eval_rollouts[name] = len(tasks)
    nulls = {k[len(NULL_PREFIX):]: v for k, v in per_system.items() if k and k.startswith(NULL_PREFIX)}
    singles = {k: v for k, v in per_system.items()
               if k != BASELINE and k not in more_baselines and not (k and k.startswith(NULL_PREFIX))}

    first_prompts = [first_user_prompt(env, t) for t in tasks]
    with bank.use(None) as base_model:
        decisions = build_routers(settings, base_model, tokenizer, router, router["candidates"], first_prompts, log)
    chosen = settings.route.kind if settings.route.kind != "retrieval" else f"retrieval_{settings.route.embedder}"
    main_decisions = decisions.get(chosen) or decisions.get("logit") or []

    target = oracle_choice(singles)
    systems: dict[str | None, list[float]] = {None: per_system[None]}
    if main_decisions:
        systems["trace_routed"] = routed_rewards(main_decisions, singles)
        soft = list(systems["trace_routed"])
        for group in plan_groups(main_decisions, soft_top_p=settings.route.soft_top_p):
            if not group.weights:
                for i in group.indices:
                    soft[i] = singles[group.adapter][i] if group.adapter else per_system[None][i]
                continue
            with bank.composed(group.weights) as mixed:
                backend = models.peft_backend(base_agent["path"], mixed, tokenizer)
                check("soft " + " + ".join(f"{v:.2f} {k}" for k, v in sorted(group.weights.items())), mixed, backend)
                rollouts = run_rollouts(env, [tasks[i] for i in group.indices], backend, tokenizer, config)
            eval_rollouts["trace_soft"] = eval_rollouts.get("trace_soft", 0) + len(rollouts)
            for i, rollout in zip(group.indices, rollouts):
                soft[i] = rollout.result.reward
        systems["trace_soft"] = soft
    elif not router["candidates"]:  # the gate promoted nothing: TRACE serves the base everywhere
        log("no adapter is routable (none promoted): TRACE routed is the base on every task")
        systems["trace_routed"] = list(per_system[None])
    for name in adapters:
        systems[name] = per_system[name]
        if name in nulls:
            systems[f"{NULL_PREFIX}{name}"] = nulls[name]
    systems["oracle"] = oracle_rewards(singles)
    # the checks of the system that played each task, for the systems that pick one per task
    if "trace_routed" in systems:
        routed_choices = [d.choice for d in main_decisions] if main_decisions else [None] * len(ids)
        checks["trace_routed"] = [checks[c][j] for j, c in enumerate(routed_choices)]
    checks["oracle"] = [checks[c][j] for j, c in enumerate(target)]
    if grpo_baseline is not None:
        systems[BASELINE] = per_system[BASELINE]
    for name in more_baselines:
        systems[name] = per_system[name]

    trace_spent = (grpo_baseline or {}).get("budget_rollouts") or sum(map(adapter_rollouts, adapters.values()))
    spent = {"base": 0, "trace_routed": trace_spent, "trace_soft": trace_spent, "oracle": trace_spent,
             **({BASELINE: grpo_baseline["rollouts"]} if grpo_baseline is not None else {}), **{n: adapter_rollouts(a) for n, a in adapters.items()},
             **{n: b["rollouts"] for n, b in more_baselines.items()}}
    table = success_table(systems, rollouts_spent=spent)
    by_family = pl.DataFrame([
        {"system": "base" if s is None else s, "family": f, "reward": r, "success": r >= 1.0}
        for s, rewards in systems.items() for f, r in zip(families, rewards)
    ]).group_by("system", "family").agg(pl.col("success").mean().alias("success_rate"), pl.col("reward").mean().alias("mean_reward"))
    by_family = by_family.pivot(on="family", index="system", values="success_rate").sort("system")

    routing_rows = []
    for name, ds in decisions.items():
        rewards = routed_rewards(ds, singles)
        routing_rows.append({"router": name, "accuracy_vs_oracle": routing_accuracy(ds, target),
                             "success_rate": sum(r >= 1.0 for r in rewards) / len(rewards),
                             "mean_reward": sum(rewards) / len(rewards)})
    routing = pl.DataFrame(routing_rows) if routing_rows else pl.DataFrame({"router": []})
    confusion = confusion_matrix(main_decisions, families) if main_decisions else pl.DataFrame()
    attributed = attribution(per_system[None], {n: per_system[n] for n in adapters}, task_ids=ids)

    pngs = {"success_by_system": plot_success_by_system(table)}
    trace_success = table.filter(pl.col("system") == "trace_routed")["success_rate"].to_list()
    base_success = table.filter(pl.col("system") == "base")["success_rate"].item()
    curves = {"TRACE (routed)": [(0, base_success), (trace_spent, trace_success[0] if trace_success else base_success)]}
    if grpo_baseline is not None:
        baseline_success = table.filter(pl.col("system") == BASELINE)["success_rate"].item()
        curves["GRPO on target"] = [(0, base_success), (grpo_baseline["rollouts"], baseline_success)]
    pngs["success_vs_rollouts"] = plot_success_vs_rollouts(curves)

    # TRACE routed against every other system, task by task: is the difference more than noise?
    paired_rows = [{"vs": "base" if other is None else other, **paired_comparison(systems["trace_routed"], rewards)}
                   for other, rewards in systems.items() if other != "trace_routed"] if "trace_routed" in systems else []
    paired = pl.DataFrame(paired_rows) if paired_rows else pl.DataFrame({"vs": []})
    null_rows = [{"adapter": n, "success": sum(r >= 1.0 for r in per_system[n]) / len(ids),
                  "null_success": sum(r >= 1.0 for r in nulls[n]) / len(ids),
                  **{f"vs_null_{k}": v for k, v in paired_comparison(per_system[n], nulls[n]).items()},
                  "promoted": bool(adapters[n].get("promoted")),
                  "gate (train side)": (adapters[n].get("promotion") or {}).get("reason", "—")}
                 for n in adapters if n in nulls]
    null_table = pl.DataFrame(null_rows) if null_rows else pl.DataFrame({"adapter": []})
    fidelity_table = (pl.DataFrame(fidelity_rows, infer_schema_length=None).select(
                          "system", "path", "n_tokens", "correlation", "rel_rms_error", "rms_error", "judged_on_scale",
                          "max_abs_error", "mean_shift_ref", "mean_shift_path", "passed")
                      if fidelity_rows else pl.DataFrame({"system": []}))

    metrics = {f"success_{r['system']}": r["success_rate"] for r in table.to_dicts()}
    metrics.update({f"p_trace_vs_{r['vs']}": r["p_value"] for r in paired_rows})
    metrics.update({f"reward_{r['system']}": r["mean_reward"] for r in table.to_dicts()})
    metrics.update({f"routing_accuracy_{r['router']}": r["accuracy_vs_oracle"] for r in routing_rows})
    metrics.update({f"p_{r['adapter']}_vs_null": r["vs_null_p_greater"] for r in null_rows})
    metrics.update({f"fidelity_r_{r['system']}": r["correlation"] for r in fidelity_rows if r["system"] in bank_paths})
    markdown = "\n\n".join([
        f"## TRACE results on the held-out test split ({len(tasks)} tasks, greedy, ≤{config.max_steps} steps)",
        to_markdown(table),
        "### TRACE routed against each system, on the same tasks\n\nwins: tasks TRACE solves and the "
        "other does not; losses: the reverse; p_value: exact two-sided McNemar (sign) test on those tasks.",
        to_markdown(paired) if paired_rows else "_no routed system_",
        "### Each adapter against its null control (same per-layer norms, random directions)\n\nwins / losses: "
        "test tasks the adapter solves and its null does not, and the reverse; p_greater: exact one-sided sign test. "
        "The gate column is the promotion decision, made before this evaluation on held-out synthetic seeds and on "
        "the target's train-split tasks (the target guard); "
        "only promoted adapters are routed to.",
        to_markdown(null_table) if null_rows else "_no null controls_",
        f"### Fidelity of each evaluated path (agent {base_id}: {identity['backend']} {identity['dtype']})\n\n"
        "Per-token log-prob shift (adapter minus base) through the path against PEFT fp32, on the base agent's "
        f"train-side conversations; tolerance: correlation >= {fidelity.DEFAULT_TOLERANCE.min_correlation}, "
        f"relative error <= {fidelity.DEFAULT_TOLERANCE.max_rel_rms_error}. A null control is judged on its twin's "
        "scale (`judged_on_scale`, the twin's fp32 shift rms): its `rms_error` may not exceed "
        f"{fidelity.DEFAULT_TOLERANCE.max_rel_rms_error} × that, the error the twin itself is allowed.",
        to_markdown(fidelity_table) if fidelity_rows else "_not measured_",
        "### Success rate by task family", to_markdown(by_family),
        f"### Routing (target = the oracle's choice; configured router: `{chosen}`)", to_markdown(routing) if routing_rows else "_no routers_",
        "### Router selection (how the default was chosen: accuracy on TRAIN-side held-out prompts, never test)",
        to_markdown(pl.DataFrame(router["selection"])) if router.get("selection") else "_not measured_",
        "### Routing confusion (chosen label × task family)", to_markdown(confusion) if main_decisions else
        ("_no routable adapter: the promotion gate promoted none, so every task goes to the base_"
         if not router["candidates"] else "_none_"),
        "### Routing confusion per router (rows: the oracle's target, columns: the router's choice)",
        "\n\n".join(f"**{name}**\n\n" + to_markdown(confusion_matrix(ds, target)) for name, ds in decisions.items()) or "_none_",
        "### Attribution (test tasks each adapter fixed / broke against the base)",
        "\n".join(f"- **{n}**: fixed {len(a['fixed'])} {a['fixed'][:5]}, broke {len(a['broke'])} {a['broke'][:5]}" for n, a in attributed.items()) or "_none_",
        f"### Rollouts spent\nTRACE adapters (GRPO + calibration): {trace_spent}; GRPO on target: "
        + (f"{grpo_baseline['rollouts']} (budget {grpo_baseline.get('budget_rollouts')})" if grpo_baseline is not None else "not evaluated")
        + f"; evaluation rollouts: {json.dumps(eval_rollouts)}",
    ])
    return {"systems": table, "by_family": by_family.to_dicts(), "routing": routing, "confusion": confusion,
            "paired": paired, "nulls": null_table, "fidelity": fidelity_table, "agent_id": base_id, "agent": identity,
            "attribution": attributed, "rollouts_spent": {**spent, "evaluation": eval_rollouts}, "metrics": metrics,
            "markdown": markdown, "pngs": pngs, "task_ids": ids, "families": families,
            "routed": [d.choice for d in main_decisions],
            "per_task": {("base" if k is None else k): [float(x) for x in v] for k, v in systems.items()},
            "checks": {("base" if k is None else k): v for k, v in checks.items() if k in systems},
            "decisions": {k: [d.label for d in v] for k, v in decisions.items()}, "oracle_target": [t or "base" for t in target]}


def sampled_trials(settings, models, *, task_splits: dict, base_agent: dict, choices: dict[str, list[str | None]],
                   folders: dict[str, str], trials: int, temperature: float, seed: int,
                   log: Callable[[str], None]) -> dict[str, list[list[bool]]]:
    """Repeated sampled episodes on the test split, for pass^k (``experiment.stats.pass_hat_k``):
    ``{system: [per test task: [success of each of ``trials`` episodes]]}``.

    ``choices[system]`` names, per test task (in ``task_splits`` order), the adapter the system
    generates through (None: the base), e.g. the router's choice per task for TRACE routed;
    ``folders`` maps adapter names to their folders. Episodes sample at ``temperature`` with seeds
    derived from ``seed``, with the ``[rollout]`` limits."""
    from dataclasses import replace

    from trace_assets.agent.rollout import derive_seed, logged_progress, run_rollouts
    from trace_assets.route.compose import AdapterBank

    env = get_environment(settings.tasks.env)
    tasks = tasks_of(task_splits, "test")
    if any(len(c) != len(tasks) for c in choices.values()):
        raise ValueError(f"every system needs one choice per test task ({len(tasks)})")
    model, tokenizer = models.load(base_agent["path"])
    used = sorted({c for per_task in choices.values() for c in per_task if c is not None})
    bank = AdapterBank(model, {name: folders[name] for name in used}) if used else None
    out: dict[str, list[list[bool]]] = {name: [[] for _ in tasks] for name in choices}
    for round_index, adapter in enumerate([None, *used]):
        jobs = [(name, i) for name, per_task in choices.items() for i, c in enumerate(per_task) if c == adapter]
        if not jobs:
            continue
        config = replace(greedy_rollout_config(settings), temperature=temperature, seed=derive_seed(seed, 3_000_000 + round_index))
        batch = [tasks[i] for _, i in jobs for _ in range(trials)]
        log(f"pass^k: {len(batch)} sampled episodes through {adapter or 'the base'} at T={temperature}")
        if bank is None:
            backend = models.backend_for(base_agent["path"], model, tokenizer)
            rollouts = run_rollouts(env, batch, backend, tokenizer, config, progress=logged_progress(log, "pass^k"))
        else:
            with bank.use(adapter) as active:
                rollouts = run_rollouts(env, batch, models.peft_backend(base_agent["path"], active, tokenizer), tokenizer,
                                        config, progress=logged_progress(log, "pass^k"))
        for j, (name, i) in enumerate(jobs):
            out[name][i] = [bool(r.result.success) for r in rollouts[j * trials:(j + 1) * trials]]
    return out
