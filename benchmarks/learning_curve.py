"""Learning curve of GRPO on one capability's synthetic environment (measured, not asserted).

The environment is built the way the ``synthetic_env`` asset builds it (``synthesize.build``): the
template synthesizer's spec for a heuristic capability on the built-in retail target, checked,
then calibrated on the base agent with the pipeline's Step-2 settings (``--no-calibrate`` skips
the calibration; ``--spec`` trains on a stored spec instead, e.g. a materialized one under
``<data>/envs/<capability>/``). Training is the pipeline's own ``GRPOTrainer`` with the pipeline's
GRPO settings (``[train]`` of the settings profile, ``TRACE_CONFIG`` included), any of which the
options below override. The generation path is the one ``lora_adapter`` uses
(``ModelResource.policy_backend_factory``: vLLM with weight sync where vLLM runs, transformers
otherwise), for the training samples and the evaluations alike.

For every training seed (``--seeds``; a seed sets ``GRPOConfig.seed``, i.e. the sampling seeds,
and the LoRA initialisation; the training tasks are the pipeline's, from ``seed_offset``), the
adapter is evaluated greedily before training and every ``--eval-every`` iterations, by the
pipeline's evaluation (``train.heldout.evaluate_policy``):

* default: on the held-out synthetic seeds ``lora_adapter`` measures on (``HELD_OUT_OFFSET``);
  this is the curve to report, never the one to choose settings by;
* ``--select``: on train-side validation seeds (``TRAIN_VALIDATION_OFFSET``), to choose the
  learning rate, iterations and group sizes.

``--target-test`` adds the measurement that says whether the adapter helps where the agent fails:
after training, each seed's adapter and its null control (``agent.lora.null_adapter``, seeded by the
training seed), and once the base, play the target's ``test`` split (the pipeline's ``task_splits``
draw of the profile: ``--profile experiment`` holds 10 tasks per family) greedily, with the
``[rollout]`` limits ``base_trajectories`` plays, on the families where the Step-1 labels in the data
folder's store call the capability LACKING on train-side trajectories (``--families`` names them
instead). Reported: each seed's successes, and the mean over seeds with a paired bootstrap interval
over tasks x seeds (``experiment.stats``) for adapter, null, adapter - base and adapter - null. The
test split only measures here: nothing above is chosen by it. With ``--select`` the same measurement
plays the target's ``train`` split instead (``--target-split``; the test split is refused there), so
that a choice can weigh what an adapter does to the target's train-side tasks: an adapter can gain on
its environment and lose on the target, where the other capabilities it stopped using are needed.

Recorded per evaluation point: training wall time so far (the trainer's iterations, checkpoints
included; evaluations excluded and timed apart), training rollouts and tokens so far (tokens the
policy generated, and whole sequences, prompts included), greedy success and mean reward; the
summary adds each family's success at the first and last point (the held-out seeds spread over the
environment's families unevenly, and a read-only family's gain is not the capability's). Output:
a rich table (each seed and the mean), ``<out>.json`` and ``<out>.png`` (success against training
wall time and against training rollouts), and with ``--target-test`` ``<out>.target_test.png`` (a
forest plot of the target test's systems and paired differences). All are rewritten atomically
after every seed (the JSON's ``complete`` is false until the last), so a killed run keeps the
seeds it finished; ``--resume`` reuses them when the stored run measured the same thing (agent,
environment spec, GRPO settings but the seed, evaluation and target-test tasks) and refuses,
naming the file and the fields that differ, when it did not. ``--resume --target-test`` on a run
measured without the target test adds it to the stored seeds, from the adapters that run saved
(``--save-adapters``), without retraining them.

``--groups-out PATH`` also writes what each iteration trained on: one record per sample (iteration,
task, family, start, reward, advantage, kept, the expert's demonstration or not, the agent's tool
calls and tool errors, its first reply) and, per iteration, the advantage summed over the kept
samples with and without an agent tool call: where it is negative for tool calls, GRPO is teaching
the agent to stop calling tools.

    .venv/bin/python benchmarks/learning_curve.py --capability confirm_before_writing \\
        --agent data/models/base_agent/<key> --iterations 8 --eval-every 2 --seeds 0,1,2
    .venv/bin/python benchmarks/learning_curve.py --select --lr 3e-4 --iterations 8   # choose settings
    .venv/bin/python benchmarks/learning_curve.py --profile experiment --target-test --vllm-dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from statistics import mean
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trace_assets.train.config import GRPOConfig  # noqa: E402
from trace_assets.train.grpo import GRPOTrainer  # noqa: E402

HELD_OUT = "held-out"
VALIDATION = "train-side validation"


class CountingTrainer(GRPOTrainer):
    """The pipeline's trainer, unchanged, counting what its sampling spends (and, with ``groups``
    a list, recording what each iteration trained on: :func:`group_records`)."""

    def __init__(self, *args: Any, groups: list[dict[str, Any]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rollouts = 0
        self.generated_tokens = 0
        self.sequence_tokens = 0
        self.groups = groups

    def collect(self, iteration: int):
        rollouts, samples = super().collect(iteration)
        self.rollouts += len(rollouts)
        self.generated_tokens += sum(r.n_generated for r in rollouts)
        self.sequence_tokens += sum(len(r.token_ids) for r in rollouts)
        if self.groups is not None:
            self.groups.extend(group_records(iteration, rollouts, samples))
        return rollouts, samples


def group_records(iteration: int, rollouts: Sequence[Any], samples: Sequence[Any]) -> list[dict[str, Any]]:
    """One record per sample of an iteration (the expert's demonstrations have no rollout)."""
    played = iter(rollouts)
    out = []
    for sample in samples:
        record = {"iteration": iteration, "task": sample.task_id, "reward": sample.reward,
                  "advantage": round(sample.advantage, 4), "kept": sample.kept, "demo": sample.demo}
        if not sample.demo:
            rollout = next(played)
            opening = (rollout.result.info.get("decision_point") or {}).get("prefix_messages", 0) + 2
            own = rollout.messages[opening:]
            calls = [c["function"]["name"] for m in own if m.get("role") == "assistant" for c in m.get("tool_calls") or []]
            replies = [m.get("content") or "" for m in own if m.get("role") == "assistant" and not m.get("tool_calls")]
            record.update(family=rollout.task.family, start=rollout.task.meta.get("start"), tool_calls=calls,
                          tool_errors=sum(1 for m in own if m.get("role") == "tool"
                                          and str(m.get("content", "")).startswith("Error:")),
                          first_reply=replies[0][:200] if replies else None)
        out.append(record)
    return out


def advantage_by_tool_use(records: Sequence[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per iteration: the advantage summed over the kept policy samples with an agent tool call and
    over those without one."""
    out: dict[int, dict[str, float]] = {}
    for r in records:
        if r["kept"] and not r["demo"]:
            row = out.setdefault(r["iteration"], {"with_tool_calls": 0.0, "without": 0.0})
            row["with_tool_calls" if r["tool_calls"] else "without"] += r["advantage"]
    return {i: {k: round(v, 3) for k, v in row.items()} for i, row in out.items()}


def default_agent(settings: Any) -> str:
    """The agent the pipeline trains adapters on: the Dagster instance's latest ``base_agent``
    (``DAGSTER_HOME``), else the newest intact warm-started agent of ``settings.base_model`` in
    the model cache, else (warm-start disabled) the base model itself."""
    from trace_assets.agent.model import resolve_model
    from trace_assets.agent.warmstart import cached_agents
    from trace_assets.paths import models_dir

    if not settings.warmstart.enabled:
        return resolve_model(settings.base_model)
    if os.environ.get("DAGSTER_HOME"):
        from trace_assets.cli import materialized_base_agent

        found = materialized_base_agent()
        if found:
            return found
    cached = cached_agents(models_dir() / "base_agent", settings.base_model)
    if cached:
        return str(cached[0])
    raise SystemExit(f"no warm-started {settings.base_model!r} agent under {models_dir() / 'base_agent'} and no "
                     "base_agent materialization in $DAGSTER_HOME: materialize base_agent or pass --agent")


def synthetic_environment(args: argparse.Namespace, settings: Any, target: Any, models: Any, agent: str,
                          tokenizer: Any, log: Any) -> tuple[Any, dict[str, Any]]:
    """``(SyntheticEnv, what was built)``, as the ``synthetic_env`` asset builds it (module docstring)."""
    from resources.llm import SynthesizerResource
    from trace_assets.identify.heuristic import RULES
    from trace_assets.synthesize import SyntheticEnv, load_spec, spec_hash
    from trace_assets.synthesize.build import CalibrationRollouts, build_environment, checked_spec

    if args.spec:
        spec = load_spec(Path(args.spec), target)
        return SyntheticEnv(spec, target), {"source": str(args.spec), "spec_hash": spec_hash(spec)}
    rule = RULES.get(args.capability)
    if rule is None:
        raise SystemExit(f"{args.capability!r} is not a heuristic capability; known: {sorted(RULES)} (or pass --spec)")
    capability = {"name": rule.name, "description": rule.description, "failure_modes": []}
    spec, _ = checked_spec(capability, target, SynthesizerResource(kind="template").synthesize)
    info: dict[str, Any] = {"source": "template synthesizer"}
    if args.calibrate:
        syn = settings.synthesis
        rollouts = CalibrationRollouts(models.backend_for(agent), tokenizer, max_steps=syn.max_steps,
                                       max_new_tokens=settings.rollout.max_new_tokens,
                                       max_context_tokens=settings.rollout.max_context_tokens,
                                       train_seed=settings.train.grpo.seed, log=log)
        built = build_environment(spec, target, rollouts, syn)
        spec = built.spec
        info.update(calibration=built.calibration.to_dict(), calibrated=built.calibration.passed,
                    calibration_rollouts=built.calibration_rollouts, isolation_passed=built.isolation["passed"],
                    isolation_reason=built.isolation["reason"])
        info["calibration"].pop("spec", None)  # the spec itself is saved once, below
    info.update(spec_hash=spec_hash(spec), spec=spec)
    return SyntheticEnv(spec, target), info


def target_test(model: Any, tokenizer: Any, pool: Any, eval_config: Any, *, out: Path, seed: int, base: bool,
                backend_factory: Any, log: Any) -> dict[str, Any]:
    """The trained adapter of ``model`` (active), its null control and, when ``base``, the base
    (adapter disabled), each greedy on every task of ``pool`` (module docstring)."""
    from trace_assets.agent.lora import null_adapter
    from trace_assets.train.heldout import NULL_ADAPTER, evaluate_policy

    results: dict[str, Any] = {}

    def run(policy: str) -> None:
        start = time.perf_counter()
        report = evaluate_policy(model, tokenizer, pool, eval_config, policy=policy, backend_factory=backend_factory)
        results[policy] = {"successes": [bool(x) for x in report.successes], "rewards": report.rewards,
                           "checks": report.checks,  # the target's per-check outcome of every task
                           "success": report.success_rate, "mean_reward": round(report.mean_reward, 4),
                           "eval_s": round(time.perf_counter() - start, 1)}
        log(f"seed {seed} target test, {policy}: {sum(report.successes)}/{report.n} "
            f"({results[policy]['eval_s']:.0f} s)")

    if base:
        with model.disable_adapter():
            run("base")
    run("adapter")
    trained = model.active_adapter
    model.save_pretrained(str(out / "final"))  # the trained adapter only: the null is loaded after
    model.load_adapter(str(null_adapter(out / "final", out / "null", seed=seed)), adapter_name=NULL_ADAPTER,
                       is_trainable=False)
    try:
        model.set_adapter(NULL_ADAPTER)
        run("null")
    finally:
        model.set_adapter(trained)
        model.delete_adapter(NULL_ADAPTER)
    return results


def saved_target_test(agent: str, tokenizer: Any, adapter_dir: Path, target: tuple[Any, Any], *, seed: int, base: bool,
                      backend_factory: Any, device: str, log: Any) -> dict[str, Any]:
    """:func:`target_test` of the adapter that an earlier run of seed ``seed`` saved to
    ``adapter_dir`` (``--save-adapters``): a stored seed gains its target test without retraining."""
    from peft import PeftModel

    from trace_assets.agent.model import load_model

    model, _ = load_model(agent, device=device)
    model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False)
    log(f"seed {seed}: target test of its saved adapter {adapter_dir}")
    with tempfile.TemporaryDirectory(prefix=f"target-test-{seed}-") as out:
        return target_test(model, tokenizer, *target, out=Path(out), seed=seed, base=base,
                           backend_factory=backend_factory, log=log)


def learning_curve(agent: str, tokenizer: Any, env: Any, config: Any, eval_config: Any, *, seed: int,
                   eval_every: int, backend_factory: Any, device: str, log: Any,
                   target: tuple[Any, Any] | None = None, target_base: bool = False,
                   save_to: Path | None = None, groups: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One training seed: GRPO from a fresh adapter on ``agent``, evaluated before training and
    every ``eval_every`` iterations (and after the last); then, given ``target = (pool, config)``,
    :func:`target_test` (the base too when ``target_base``). The trained adapter is saved to
    ``save_to`` when given. See the module docstring."""
    import torch

    from trace_assets.agent.model import load_model
    from trace_assets.train.heldout import evaluate_policy

    torch.manual_seed(seed)
    model, _ = load_model(agent, device=device)
    points: list[dict[str, Any]] = []
    train_s = 0.0
    with tempfile.TemporaryDirectory(prefix=f"learning-curve-{seed}-") as out:
        trainer = CountingTrainer(model, tokenizer, env, replace(config, seed=seed), out, backend_factory=backend_factory,
                                  groups=groups)

        def evaluate() -> None:
            start = time.perf_counter()
            report = evaluate_policy(trainer.model, tokenizer, env, eval_config, policy=f"iteration {trainer.iteration}",
                                     backend_factory=backend_factory)
            points.append({
                "iteration": trainer.iteration, "rollouts": trainer.rollouts,
                "generated_tokens": trainer.generated_tokens, "sequence_tokens": trainer.sequence_tokens,
                "train_wall_s": round(train_s, 2), "success": report.success_rate,
                "mean_reward": round(report.mean_reward, 4), "eval_s": round(time.perf_counter() - start, 2),
                "successes": report.successes, "checks": report.check_counts(),
            })
            log(f"seed {seed} iteration {trainer.iteration}: held {eval_config.n_tasks} seeds, success "
                f"{report.success_rate:.3f}, reward {report.mean_reward:.3f} ({trainer.rollouts} rollouts, {train_s:.0f} s)")

        evaluate()
        while trainer.iteration < config.iterations:
            start = time.perf_counter()
            metrics = trainer.step()
            train_s += time.perf_counter() - start
            log(f"seed {seed} {metrics.line()}")
            if trainer.iteration % eval_every == 0 or trainer.iteration == config.iterations:
                evaluate()
        generation = getattr(trainer.backend, "name", type(trainer.backend).__name__)
        if save_to is not None:
            trainer.model.save_pretrained(str(save_to))
            log(f"seed {seed}: adapter saved to {save_to}")
        tested = (target_test(trainer.model, tokenizer, *target, out=Path(out), seed=seed, base=target_base,
                              backend_factory=backend_factory, log=log) if target else None)
    return {"seed": seed, "points": points, "history": [m.to_dict() for m in trainer.history],
            "generation_backend": generation, **({"adapter_dir": str(save_to)} if save_to is not None else {}),
            **({"target_test": tested} if tested else {})}


def summarize(seeds: Sequence[dict[str, Any]], families: Sequence[str] | None = None) -> dict[str, Any]:
    """The mean curve over seeds (points matched by iteration), each seed's gain from its first
    to its last point with the mean gain's 95 % paired bootstrap interval over evaluation tasks x
    seeds (every seed plays the same evaluation tasks), and, given the evaluation tasks' ``families``
    (in task order), the success per family at the first and the last point, over tasks x seeds:
    where the gain comes from."""
    iterations = [p["iteration"] for p in seeds[0]["points"]]
    curve = []
    for i, iteration in enumerate(iterations):
        at = [s["points"][i] for s in seeds]
        curve.append({"iteration": iteration, **{k: round(mean(p[k] for p in at), 4) for k in (
            "rollouts", "generated_tokens", "sequence_tokens", "train_wall_s", "success", "mean_reward")}})
    gains = {s["seed"]: round(s["points"][-1]["success"] - s["points"][0]["success"], 4) for s in seeds}
    out = {"mean_curve": curve, "success_gain_per_seed": gains, "mean_success_gain": round(mean(gains.values()), 4),
           "mean_reward_gain": round(curve[-1]["mean_reward"] - curve[0]["mean_reward"], 4)}
    if len(iterations) > 1:  # the gain's 95 % paired bootstrap over evaluation tasks x training seeds
        from trace_assets.experiment.stats import paired_bootstrap

        outcomes = {when: [s["points"][i]["successes"] for s in seeds] for when, i in (("first", 0), ("last", -1))}
        _, differences = paired_bootstrap(outcomes, contrasts=[("last", "first")])
        out["success_gain_interval"] = differences[("last", "first")].to_dict()
    if families:
        out["per_family"] = {}
        for family in dict.fromkeys(families):
            at = [j for j, f in enumerate(families) if f == family]
            cells = len(at) * len(seeds)
            out["per_family"][family] = {"tasks": len(at), **{
                when: round(sum(s["points"][i]["successes"][j] for s in seeds for j in at) / cells, 4)
                for when, i in (("before", 0), ("after", -1))}}
    return out


def family_table(result: dict[str, Any]) -> Any:
    from rich.table import Table

    out = Table(title=f"E_{result['capability']}: greedy success per family, first and last point "
                      f"(over {result['mode']} tasks x seeds)")
    for column in ("family", "tasks", "before", "after"):
        out.add_column(column, justify="left" if column == "family" else "right")
    for family, row in result["summary"].get("per_family", {}).items():
        out.add_row(family, str(row["tasks"]), f"{row['before']:.3f}", f"{row['after']:.3f}")
    return out


def target_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per seed and over seeds (paired bootstrap over tasks x seeds; the base, which does not train,
    repeats its row) of the ``target_test`` results of :func:`learning_curve` runs."""
    from trace_assets.experiment.stats import paired_bootstrap

    # the base does not train: one seed measured it, and it stands for every seed
    recorded = {"base": [next(r["target_test"]["base"] for r in runs if "base" in r["target_test"])],
                "adapter": [r["target_test"]["adapter"] for r in runs], "null": [r["target_test"]["null"] for r in runs]}
    base = recorded["base"][0]["successes"]
    outcomes = {"base": [base] * len(runs), **{k: [res["successes"] for res in recorded[k]] for k in ("adapter", "null")}}
    contrasts = [("adapter", "base"), ("adapter", "null"), ("null", "base")]
    systems, differences = paired_bootstrap(outcomes, contrasts=contrasts)
    checks: dict[str, dict[str, list[int]]] = {}  # system -> check -> [passed, applied], over the seeds that recorded them
    for system, results in recorded.items():
        for res in results:
            for cid, row in (res.get("checks") or {}).items():
                counts = checks.setdefault(system, {}).setdefault(cid, [0, 0])
                counts[0] += sum(bool(x) for x in row)
                counts[1] += sum(x is not None for x in row)
    return {
        "n_tasks": len(base), "base_successes": sum(base), "checks": checks,
        "per_seed": {r["seed"]: {k: sum(r["target_test"][k]["successes"]) for k in ("adapter", "null")} for r in runs},
        "systems": {k: v.to_dict() for k, v in systems.items()},
        "differences": {f"{a} - {b}": v.to_dict() for (a, b), v in differences.items()},
        "outcomes": outcomes,
    }


def target_table(result: dict[str, Any]) -> Any:
    from rich.table import Table

    from trace_assets.experiment.stats import Interval

    t = result["target_test"]
    out = Table(title=f"target {t.get('split', 'test')} split, greedy: {t['n_tasks']} tasks of {', '.join(t['families'])} "
                      f"(mean over seeds, 95 % paired bootstrap over tasks x seeds)")
    for column in ("system", *[f"seed {s}" for s in t["per_seed"]], "success % [95 % CI]"):
        out.add_column(column, justify="right" if column != "system" else "left")
    for name in ("base", "adapter", "null"):
        counts = [str(t["base_successes"]) if name == "base" else str(v[name]) for v in t["per_seed"].values()]
        out.add_row(name, *[f"{c}/{t['n_tasks']}" for c in counts], Interval(**t["systems"][name]).text())
    for name, interval in t["differences"].items():
        out.add_row(name, *[""] * len(t["per_seed"]), Interval(**interval).text(), style="bold")
    return out


def figure(result: dict[str, Any]) -> bytes:
    """PNG: success against training wall time (left) and against training rollouts (right); one
    thin line per seed, the mean in bold."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=100, sharey=True)
    for ax, key, label in ((axes[0], "train_wall_s", "training wall time (s)"), (axes[1], "rollouts", "training rollouts")):
        for s in result["seeds"]:
            ax.plot([p[key] for p in s["points"]], [p["success"] for p in s["points"]], marker=".", alpha=0.45,
                    linewidth=1, label=f"seed {s['seed']}")
        curve = result["summary"]["mean_curve"]
        ax.plot([p[key] for p in curve], [p["success"] for p in curve], marker="o", color="black", linewidth=2,
                label="mean")
        ax.set_xlabel(label)
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"greedy success ({result['mode']}, {result['eval']['n_tasks']} seeds)")
    axes[1].legend(fontsize=8, loc="best")
    g = result["grpo"]
    fig.suptitle(f"E_{result['capability']}: lr {g['learning_rate']:g}, G {g['groups']} x K {g['samples_per_group']}, "
                 f"{g['max_steps']} turns x {g['max_new_tokens']} tokens"
                 + (f", warmup {g['warmup_iterations']} it." if g.get("warmup_iterations") else "")
                 + (f", tied groups re-sampled up to {g['resample_rounds']}x" if g.get("resample_rounds") else "")
                 + (", expert guidance" if g.get("expert_guidance") else ""), fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def target_figure(result: dict[str, Any]) -> bytes:
    """PNG forest plot of the ``target_test`` block: base, adapter and null, and their paired
    differences against a zero line (:func:`trace_assets.figures.forest_plot`, as the experiment's)."""
    from trace_assets.figures import forest_plot

    t = result["target_test"]
    panels = {"success per system": [{"label": k, **t["systems"][k]} for k in ("base", "adapter", "null")],
              "paired differences": [{"label": k, **v} for k, v in t["differences"].items()]}
    n = len(t["per_seed"])
    return forest_plot(panels, reference={"paired differences": 0.0}, xlabels={"success per system": "success, %"},
                       title=f"E_{result['capability']} adapters on the target {t.get('split', 'test')} split: "
                             f"{t['n_tasks']} tasks of "
                             f"{len(t['families'])} families x {n} seed{'s' if n != 1 else ''}, 95 % paired "
                             "bootstrap over tasks x seeds")


def table(result: dict[str, Any]) -> Any:
    from rich.table import Table

    seeds = result["seeds"]
    out = Table(title=f"E_{result['capability']}: greedy success on {result['eval']['n_tasks']} {result['mode']} seeds "
                      f"(mean reward in the last column)")
    for column in ("iteration", "rollouts", "generated tokens", "train s", *[f"seed {s['seed']}" for s in seeds],
                   "mean success", "mean reward"):
        out.add_column(column, justify="right")
    for i, point in enumerate(result["summary"]["mean_curve"]):
        out.add_row(str(point["iteration"]), f"{point['rollouts']:.0f}", f"{point['generated_tokens']:.0f}",
                    f"{point['train_wall_s']:.0f}", *[f"{s['points'][i]['success']:.3f}" for s in seeds],
                    f"{point['success']:.3f}", f"{point['mean_reward']:.3f}")
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capability", default="confirm_before_writing", help="a heuristic capability (template spec)")
    ap.add_argument("--spec", default=None, help="train on this stored EnvSpec instead of the template's")
    ap.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                    help="train on the template spec as written, without the asset's calibration")
    ap.add_argument("--agent", default=None, help="base agent folder (default: the pipeline's base_agent)")
    ap.add_argument("--profile", default=None, help="settings profile (default $TRACE_PROFILE or demo)")
    ap.add_argument("--lr", type=float, default=None, help="GRPO learning rate")
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--groups", type=int, default=None, help="G: tasks per iteration")
    ap.add_argument("--samples", type=int, default=None, help="K: rollouts per task (one advantage group)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="per assistant turn")
    ap.add_argument("--max-steps", type=int, default=None, help="assistant turns per episode")
    ap.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    ap.add_argument("--beta", type=float, default=None, help="KL coefficient against the base (0: no reference forward)")
    ap.add_argument("--warmup-iterations", type=int, default=None,
                    help="iterations that ramp the learning rate up linearly before the full rate")
    ap.add_argument("--expert-guidance", action="store_true", default=None,
                    help="add the expert's play of each group's task to the group (GRPOConfig.expert_guidance)")
    ap.add_argument("--resample-rounds", type=int, default=None,
                    help="re-sample tied groups on fresh tasks, at most this many rounds per iteration")
    ap.add_argument("--seeds", default="0,1,2", help="training seeds, comma-separated")
    ap.add_argument("--eval-every", type=int, default=2, help="evaluate every this many iterations")
    ap.add_argument("--eval-tasks", type=int, default=None, help="evaluation seeds (default [train] eval_tasks)")
    ap.add_argument("--select", action="store_true",
                    help="evaluate on train-side validation seeds (to choose settings), not on the held-out ones")
    ap.add_argument("--backend", default=None, help="auto | vllm | transformers (default: [generation] backend)")
    ap.add_argument("--vllm-dtype", default=None, help="auto | float32 | bfloat16 (default: [generation] vllm_dtype)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--target-test", action="store_true",
                    help="after training, play the target's tasks (--target-split) with each adapter, its null and the base")
    ap.add_argument("--target-split", choices=("train", "test"), default=None,
                    help="the target split --target-test plays: test for a held-out measurement (the default), "
                         "train with --select (the default there; test is refused: choices are never made on it)")
    ap.add_argument("--families", default=None,
                    help="--target-test on these families, comma-separated, or 'all' (default: where the store's "
                         "Step-1 labels call the capability LACKING on the train side)")
    ap.add_argument("--out", default=None, help="output path without extension (default <data>/reports/learning_curve/...)")
    ap.add_argument("--save-adapters", default=None,
                    help="save each seed's trained adapter to <this folder>/seed<N> (e.g. for target_success.py --adapter)")
    ap.add_argument("--groups-out", default=None,
                    help="also write every trained sample's record and the advantage by tool use (JSON) here")
    ap.add_argument("--resume", action="store_true",
                    help="reuse the seeds that <out>.json already holds, when it measured the same thing")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from rich.console import Console

    from resources.models import ModelResource
    from trace_assets import paths, reports
    from trace_assets.agent.lora import bf16_supported
    from trace_assets.agent.model import load_tokenizer, resolve_model
    from trace_assets.definitions import build_resources
    from trace_assets.envs import get_environment
    from trace_assets.settings import load_settings
    from trace_assets.train.heldout import HELD_OUT_OFFSET, TRAIN_VALIDATION_OFFSET, EvalConfig

    args = parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):  # progress lines show up at once when stdout is a file
        sys.stdout.reconfigure(line_buffering=True)
    console = Console(width=160)
    log = console.print
    settings = load_settings(args.profile)
    agent = resolve_model(args.agent) if args.agent else default_agent(settings)
    pipeline = build_resources(settings)["models"]  # the pipeline's generation settings, then the options
    models = ModelResource(**{**{k: getattr(pipeline, k) for k in ModelResource.model_fields}, "base_model": agent,
                              "device": args.device, "generation_backend": args.backend or pipeline.generation_backend,
                              "vllm_dtype": args.vllm_dtype or pipeline.vllm_dtype})
    tokenizer = load_tokenizer(agent)
    target = get_environment("retail")
    target_split = args.target_split or ("train" if args.select else "test")
    if args.select and target_split == "test":
        raise SystemExit("--select chooses settings, and the target's test split is for measuring only: "
                         "use --target-split train (the default with --select)")
    families = None  # --families given: checked before the environment is built and calibrated
    if args.target_test and args.families == "all":
        families = list(target.families())
    elif args.target_test and args.families:
        from benchmarks.target_success import parse_families

        families = parse_families(args.families, list(target.families()), target.name)
    started = time.perf_counter()
    env, env_info = synthetic_environment(args, settings, target, models, agent, tokenizer, log)
    build_s = time.perf_counter() - started

    overrides = {"learning_rate": args.lr, "iterations": args.iterations, "groups": args.groups,
                 "samples_per_group": args.samples, "max_new_tokens": args.max_new_tokens, "max_steps": args.max_steps,
                 "temperature": args.temperature, "beta": args.beta, "resample_rounds": args.resample_rounds,
                 "warmup_iterations": args.warmup_iterations, "expert_guidance": args.expert_guidance}
    config = replace(settings.train.grpo, **{k: v for k, v in overrides.items() if v is not None})
    mode = VALIDATION if args.select else HELD_OUT
    eval_config = EvalConfig(n_tasks=args.eval_tasks or settings.train.eval_tasks,
                             seed_offset=TRAIN_VALIDATION_OFFSET if args.select else HELD_OUT_OFFSET,
                             max_steps=config.max_steps, max_new_tokens=config.max_new_tokens,
                             max_context_tokens=config.max_context_tokens)
    last_training = config.seed_offset + config.iterations * config.groups
    if config.seed_offset < eval_config.seed_offset + eval_config.n_tasks and eval_config.seed_offset < last_training:
        raise SystemExit(f"training seeds [{config.seed_offset}, {last_training}) overlap the evaluation seeds "
                         f"[{eval_config.seed_offset}, {eval_config.seed_offset + eval_config.n_tasks})")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    factory = models.policy_backend_factory(agent)
    log(f"agent {agent}; E_{env.capability} ({env_info['source']}, spec {env_info['spec_hash']}); {mode} evaluation on "
        f"{eval_config.n_tasks} seeds from offset {eval_config.seed_offset}; lr {config.learning_rate:g}, "
        f"{config.iterations} iterations of G {config.groups} x K {config.samples_per_group}")
    target_eval, target_info = None, None
    if args.target_test:
        from benchmarks.target_success import task_list
        from resources.store import TraceStore
        from trace_assets.envs.splits import TaskPoolEnv

        if families is None:
            families = TraceStore().lacking_families(env.capability, task_list(target, settings, "train"))
            if not families:
                raise SystemExit(f"the store {paths.duckdb_path()} has no train-side trajectory labelled "
                                 f"{env.capability} LACKING: run Step 1 there, or pass --families")
        tasks = [t for t in task_list(target, settings, target_split) if t.family in families]
        pool = TaskPoolEnv(target, tasks)
        test_config = EvalConfig.from_limits(settings.rollout, n_tasks=len(tasks), seed_offset=0)
        target_eval = (pool, test_config)
        target_info = {"split": target_split, "families": families,
                       "family_source": args.families or "LACKING in the store's Step-1 labels",
                       "task_ids": [t.task_id for t in pool.sample_tasks(len(tasks))], "max_steps": test_config.max_steps,
                       "max_new_tokens": test_config.max_new_tokens, "greedy": True}
        log(f"target {target_split} split: {len(tasks)} tasks of {families} ({target_info['family_source']})")
    out = Path(args.out) if args.out else paths.sub("reports", "learning_curve") / (
        f"{env.capability}_{'validation' if args.select else 'heldout'}")
    files = {suffix: out.with_name(out.name + suffix)
             for suffix in (".json", ".png", ".envspec.json", *((".target_test.png",) if target_info else ()))}
    result = {
        "benchmark": "learning_curve", "capability": env.capability, "mode": mode, "agent": agent,
        "environment": {k: v for k, v in env_info.items() if k != "spec"}, "environment_build_s": round(build_s, 1),
        "grpo": config.to_dict(),
        "eval": {"n_tasks": eval_config.n_tasks, "seed_offset": eval_config.seed_offset, "greedy": True,
                 "families": [t.family for t in env.sample_tasks(eval_config.n_tasks, offset=eval_config.seed_offset)],
                 "max_steps": eval_config.max_steps, "max_new_tokens": eval_config.max_new_tokens},
        "generation": {"backend": models.generation_backend, "vllm_dtype": models.resolved_vllm_dtype()},
        "machine": {**reports.machine(), "cpus": os.cpu_count(), "bf16_native": bf16_supported(), "device": args.device,
                    "train_bf16": bf16_supported() if config.bf16 is None else config.bf16},
        **({"target_test": target_info} if target_info else {}),
    }
    done = resumed_seeds(files[".json"], result) if args.resume else {}
    if done:
        log(f"resuming {files['.json']}: seeds {sorted(done)} are measured already")
    if "spec" in env_info:
        paths.atomic_write(files[".envspec.json"], json.dumps(env_info["spec"], indent=1, sort_keys=True))
    runs: dict[int, dict[str, Any]] = dict(done)  # every stored seed is kept, asked for or not

    def ordered() -> list[dict[str, Any]]:
        return [runs[s] for s in seeds if s in runs] + [r for s, r in sorted(runs.items()) if s not in seeds]

    if target_eval:  # stored seeds measured without the target test gain it from their saved adapters
        for seed in [s for s, r in runs.items() if "target_test" not in r]:
            saved = runs[seed].get("adapter_dir") or (args.save_adapters and str(Path(args.save_adapters) / f"seed{seed}"))
            folder = Path(saved or "")
            if not saved or not (folder / "adapter_config.json").exists():
                raise SystemExit(f"--resume --target-test: seed {seed} in {files['.json']} has no target test and no "
                                 f"saved adapter{f' at {folder}' if saved else ''}: pass the --save-adapters folder of "
                                 "the run that trained it, or another --out")
            base_done = any("base" in r.get("target_test", {}) for r in runs.values())
            runs[seed] = {**runs[seed], "adapter_dir": str(folder), "target_test": saved_target_test(
                agent, tokenizer, folder, target_eval, seed=seed, base=not base_done, backend_factory=factory,
                device=args.device, log=log)}
            write_result(files, assemble(result, ordered(), complete=all(s in runs for s in seeds)))
            log(f"wrote seed {seed}'s target test to {files['.json']}")
    groups: dict[int, list[dict[str, Any]]] = {}
    for seed in seeds:
        if seed in runs:
            continue
        base_done = any("base" in r.get("target_test", {}) for r in runs.values())
        groups[seed] = [] if args.groups_out else None
        runs[seed] = learning_curve(agent, tokenizer, env, config, eval_config, seed=seed,
                                    eval_every=max(args.eval_every, 1), backend_factory=factory, device=args.device,
                                    log=log, target=target_eval, target_base=not base_done,
                                    save_to=Path(args.save_adapters) / f"seed{seed}" if args.save_adapters else None,
                                    groups=groups[seed])
        write_result(files, assemble(result, ordered(), complete=all(s in runs for s in seeds)))
        log(f"wrote seed {seed} to {files['.json']}")
        if args.groups_out:
            by_tool = {s: advantage_by_tool_use(g) for s, g in groups.items()}
            paths.atomic_write(Path(args.groups_out), json.dumps(
                {"advantage_by_tool_use": by_tool, "samples": groups}, indent=1))
            log(f"seed {seed}: advantage summed by tool use per iteration {by_tool[seed]} -> {args.groups_out}")
    result = assemble(result, ordered(), complete=True)
    console.print(table(result))
    console.print(family_table(result))
    if target_info:
        console.print(target_table(result))
    gains = ", ".join(f"seed {k} {v:+.3f}" for k, v in result["summary"]["success_gain_per_seed"].items())
    last = result["summary"]["mean_curve"][-1]
    ci = result["summary"].get("success_gain_interval")
    ci = f" [{ci['low']:+.3f}, {ci['high']:+.3f}]" if ci else ""
    log(f"success gain per seed: {gains}; mean {result['summary']['mean_success_gain']:+.3f}{ci} (reward "
        f"{result['summary']['mean_reward_gain']:+.3f}) after {last['rollouts']:.0f} rollouts, "
        f"{last['generated_tokens']:.0f} generated tokens ({last['sequence_tokens']:.0f} sequence tokens), "
        f"{last['train_wall_s']:.0f} s of training per seed")
    log(f"results in {', '.join(str(f) for k, f in files.items() if k != '.envspec.json')}")
    return result


# What a stored run must share with this one for its seeds to be reused: everything it measured but
# the seeds themselves and when and where they ran.
_NOT_COMPARED = ("seeds", "summary", "complete", "created_at", "environment_build_s", "machine")


def _comparable(result: dict[str, Any]) -> dict[str, Any]:
    # Through JSON first: a stored run has been, and a tuple in memory must equal its stored list.
    kept = {k: v for k, v in json.loads(json.dumps(result, default=str)).items() if k not in _NOT_COMPARED}
    # a field added since, at the value that reproduces the stored run (execution fields included:
    # runs stored before packing ran unpacked)
    later = {**GRPOConfig.LATER_FIELDS, "pack_suffixes": False}
    kept["grpo"] = {k: v for k, v in kept.get("grpo", {}).items() if k != "seed" and not (k in later and v == later[k])}
    kept["environment"] = {"spec_hash": kept.get("environment", {}).get("spec_hash")}
    if kept.get("agent"):  # one folder however it was spelled: relative, or with a trailing slash
        kept["agent"] = str(Path(kept["agent"]).resolve())
    kept["generation"] = {k: v for k, v in kept.get("generation", {}).items() if k != "used"}
    if "target_test" in kept:
        kept["target_test"] = {k: kept["target_test"].get(k) for k in ("families", "task_ids", "max_steps",
                                                                       "max_new_tokens", "greedy")}
    return kept


def resumed_seeds(path: Path, result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The runs stored in ``path`` by seed, if it measured what ``result`` will (``_comparable``);
    ``{}`` when there is no such file. A stored run that measured something else is an error that
    names the file and the differing fields: mixing the two would report neither."""
    if not path.exists():
        return {}
    try:
        stored = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--resume: {path} is not valid JSON (line {exc.lineno}): {exc.msg}") from exc
    theirs, ours = _comparable(stored), _comparable(result)
    if "target_test" in ours and "target_test" not in theirs:
        ours.pop("target_test")  # measured without it: main adds it to the stored seeds from their saved adapters
    differ = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
    if differ:
        detail = "; ".join(f"{k}: stored {theirs.get(k)!r} != now {ours.get(k)!r}" for k in differ)
        raise SystemExit(f"--resume: {path} measured something else ({detail[:600]}); pass another --out")
    return {int(r["seed"]): r for r in stored.get("seeds", [])}


def assemble(result: dict[str, Any], runs: list[dict[str, Any]], *, complete: bool) -> dict[str, Any]:
    """``result`` with ``runs`` (the seeds measured so far), their summaries and ``complete``."""
    data = {**result, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "complete": complete,
            "generation": {**result["generation"], "used": sorted({r["generation_backend"] for r in runs})},
            "seeds": runs, "summary": summarize(runs, result["eval"].get("families"))}
    tested = [r for r in runs if "target_test" in r]  # a resumed run adds it to stored seeds one by one
    if "target_test" in result and tested:
        data["target_test"] = {**result["target_test"], **target_summary(tested)}
    return data


def write_result(files: dict[str, Path], data: dict[str, Any]) -> None:
    """``<out>.json``, ``<out>.png`` and, with a target test, ``<out>.target_test.png`` of
    :func:`assemble`'s ``data``, each replaced atomically."""
    from trace_assets.paths import atomic_write

    atomic_write(files[".json"], json.dumps(data, indent=1, default=str))
    atomic_write(files[".png"], figure(data))
    if ".target_test.png" in files:
        atomic_write(files[".target_test.png"], target_figure(data))


if __name__ == "__main__":
    main()
