"""An agent's greedy success on a target environment's split (measured, not asserted).

The base_trajectories asset's rollouts, outside the pipeline: the same runner, the same
``[rollout]`` limits and generation path (``ModelResource.backend_for``: vLLM where it runs), on
the tasks of one split of a registered target (``tau2_airline``: its official split; ``retail``:
the pipeline's ``task_splits`` draw). Nothing is stored: it prints a rich table per family and
the total (success, mean reward, turns, generated tokens, wall time, episodes per second, and the
episodes that failed one check alone: what a single capability would have to fix) and
writes ``<out>.json`` with every episode's task id, reward, success and the per-check breakdown.
Which split it reads is the caller's choice and is printed; choosing anything by the ``test``
split is what the pipeline never does.

    .venv/bin/python benchmarks/target_success.py --env tau2_airline --split train \\
        --agent data/models/base_agent/<key>
    .venv/bin/python benchmarks/target_success.py --env retail --split train \\
        --agent data/models/base_agent/<key> --adapter <saved LoRA adapter folder> --families cancel_pending

``--adapter`` plays the agent with a saved LoRA adapter applied the way ``lora_adapter`` evaluates
one (``ModelResource.peft_backend``: its effective weights pushed into the base engine under vLLM;
``--vllm-dtype float32`` applies it exactly).

``--spec`` plays a stored synthetic environment over ``--env`` instead (an EnvSpec, e.g. one under
``<data>/envs/<capability>/``) on its own seeds, as ``lora_adapter`` evaluates an adapter there
(greedy, GRPO's turn and token limits, the hint left out): ``--split validation`` on the train-side
validation seeds that settings are chosen by, ``held-out`` on the seeds that only measure; ``--limit``
seeds (default ``[train] eval_tasks``). The per-check figures are then the rubric's: what an adapter
changed in behaviour where its success does not move.

    .venv/bin/python benchmarks/target_success.py --env retail --spec data/envs/confirm_before_writing/<hash>.json \
        --split validation --limit 48 --agent data/models/base_agent/<key> --adapter <dir> --vllm-dtype float32

``--decision-point CAPABILITY`` asks what the agent does where that capability decides, on the
target's own tasks: the target's expert opens each episode up to the template synthesizer's
``start`` for CAPABILITY (the move where its synthetic environment starts too), and the agent plays
one turn. Each episode records ``first_turn``: ``write`` / ``read`` (a tool call of that class),
``question`` (a reply the simulated user answered as a confirmation question), ``reply`` (any other
text) or ``none``; the table counts them per family. A minute and a half for 42 retail tasks here,
against ten for whole episodes. ``--before KINDS`` opens each episode before the expert's first
move of those kinds instead (same request): ``--before write`` after the user's yes, where the agent
is to act on it (tasks where the expert never writes, a declined change, are left out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", default=None,
                    help="a registered target environment (default: the --spec's target.env, else the settings' target)")
    ap.add_argument("--split", default="train", choices=("demo", "train", "test", *SYNTHETIC_SPLITS),
                    help="a split of the target; with --spec: validation or held-out seeds of the synthetic environment")
    ap.add_argument("--agent", required=True, help="the agent's model folder (e.g. data/models/base_agent/<key>)")
    ap.add_argument("--adapter", default=None, help="a saved LoRA adapter folder to apply to the agent")
    ap.add_argument("--spec", default=None, help="play this stored EnvSpec (a synthetic environment over --env) instead")
    ap.add_argument("--vllm-dtype", default=None, help="auto | float32 | bfloat16 (default: [generation] vllm_dtype)")
    ap.add_argument("--families", default=None, help="only these families, comma-separated")
    ap.add_argument("--transcripts", action="store_true", help="also write every episode's messages to the JSON")
    ap.add_argument("--decision-point", default=None, metavar="CAPABILITY",
                    help="open each episode at CAPABILITY's decision point (the expert plays up to it) "
                         "and record the agent's first turn there")
    ap.add_argument("--before", default=None, metavar="KINDS",
                    help="with --decision-point: open before the expert's first move of these kinds "
                         "(comma-separated, e.g. write: after the user's yes) instead of the template's start")
    ap.add_argument("--profile", default=None, help="settings profile (default $TRACE_PROFILE or demo)")
    ap.add_argument("--limit", type=int, default=0, help="at most this many tasks (0: all)")
    ap.add_argument("--max-steps", type=int, default=None, help="assistant turns per episode (default [rollout])")
    ap.add_argument("--out", default=None, help="output path without extension (default <data>/reports/target_success_<env>_<split>)")
    return ap.parse_args(argv)


SYNTHETIC_SPLITS = ("validation", "held-out")


def task_list(env: Any, settings: Any, split: str) -> list[Any]:
    """The split's tasks as the pipeline's ``task_splits`` makes them (official where the target has one)."""
    from trace_assets.envs.splits import configured_splits

    official = getattr(env, "official_splits", None)
    if official is not None:
        return list(official()[split])
    return configured_splits(env, settings.tasks)[split]


def spec_target(path: Path) -> str | None:
    """The target environment a stored EnvSpec names (``target.env``), or None where it names none
    readably (loading the spec then says what is wrong with it)."""
    try:
        target = json.loads(path.read_text())["target"]["env"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return target if isinstance(target, str) else None


def parse_families(text: str, known: Sequence[str], where: str) -> list[str]:
    """``--families``: comma-separated names, in the order given, each one of ``known``
    (``SystemExit`` naming the unknown ones and ``where`` they were looked for)."""
    families = list(dict.fromkeys(f.strip() for f in text.split(",") if f.strip()))
    unknown = sorted(set(families) - set(known))
    if unknown:
        raise SystemExit(f"--families: {unknown} are not families of {where}: {sorted(set(known))}")
    return families


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from dataclasses import replace

    from rich.console import Console
    from rich.table import Table

    from resources.models import ModelResource
    from trace_assets import paths
    from trace_assets.agent.model import load_tokenizer, resolve_model
    from trace_assets.agent.rollout import RolloutConfig, run_rollouts
    from trace_assets.definitions import build_resources
    from trace_assets.envs import get_environment
    from trace_assets.envs.base import check_outcomes
    from trace_assets.settings import load_settings

    args = parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    console = Console(width=140)
    settings = load_settings(args.profile)
    agent = resolve_model(args.agent)
    pipeline = build_resources(settings)["models"]
    models = ModelResource(**{**{k: getattr(pipeline, k) for k in ModelResource.model_fields}, "base_model": agent,
                              "vllm_dtype": args.vllm_dtype or pipeline.vllm_dtype})
    args.env = args.env or (spec_target(Path(args.spec)) if args.spec else None) or settings.tasks.env
    env = get_environment(args.env)
    synthetic = None
    if args.spec:
        if args.decision_point:
            raise SystemExit("--decision-point opens the target's own tasks: leave out --spec")
        synthetic = env = synthetic_env(env, Path(args.spec))
        tasks = synthetic_tasks(synthetic, args.split, args.limit or settings.train.eval_tasks)
    elif args.split in SYNTHETIC_SPLITS:
        raise SystemExit(f"--split {args.split}: the seeds of a synthetic environment, given by --spec")
    else:
        tasks = task_list(env, settings, args.split)
    if args.families:
        wanted = parse_families(args.families, [t.family for t in tasks], f"the {args.split} split of {args.env}")
        tasks = [t for t in tasks if t.family in wanted]
    if args.decision_point:  # after the family filter: a family may have no such move (a declined change)
        env = DecisionPointTarget(env, args.decision_point, before=args.before.split(",") if args.before else None)
        opened = [t for t in tasks if env.has_decision_point(t)]
        console.print(f"{len(opened)} of {len(tasks)} tasks reach the decision point {env.start_at}")
        tasks = opened
    tasks = tasks[: args.limit or None]
    if synthetic is not None:  # as lora_adapter evaluates on it: greedy, GRPO's limits
        from trace_assets.train.heldout import EvalConfig

        limits = EvalConfig.from_limits(settings.train.grpo, n_tasks=len(tasks))
        config = replace(limits, max_steps=args.max_steps or limits.max_steps).rollout_config()
    else:
        max_steps = 1 if args.decision_point else args.max_steps
        roll = settings.rollout if max_steps is None else replace(settings.rollout, max_steps=max_steps)
        config = RolloutConfig.from_limits(roll, temperature=roll.temperature, seed=roll.seed)
    label = f"E_{synthetic.capability} ({args.spec}) over {args.env}" if synthetic is not None else args.env
    tokenizer = load_tokenizer(agent)
    if args.adapter:
        from peft import PeftModel

        from trace_assets.agent.model import load_model

        base, _ = load_model(agent, device=models.device)
        backend = models.peft_backend(agent, PeftModel.from_pretrained(base, args.adapter, is_trainable=False), tokenizer)
    else:
        backend = models.backend_for(agent)
    console.print(f"{label} / {args.split}: {len(tasks)} tasks, agent {agent}"
                  f"{f' + adapter {args.adapter}' if args.adapter else ''}, {models.backend_label(backend)}, "
                  f"<= {config.max_steps} turns, T {config.temperature}")
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        console.print(f"  {done}/{total} episodes finished ({time.perf_counter() - started:.0f} s)")

    rollouts = run_rollouts(env, tasks, backend, tokenizer, config, progress=progress)
    wall = time.perf_counter() - started
    close = getattr(env, "close", None)
    if close is not None:
        close()

    episodes = [{
        "task_id": r.task.task_id, "family": r.task.family, "reward": float(r.result.reward),
        "success": bool(r.result.success), "turns": r.steps, "generated_tokens": r.n_generated,
        "truncated": r.truncated, "stop_reason": r.stop_reason,
        "error": r.error or r.result.info.get("error"),
        "checks": [{"id": k, "passed": v} for k, v in check_outcomes(r.result.info).items()],
        **({"first_turn": first_turn(r, env.writes)} if args.decision_point else {}),
        **({"messages": r.messages} if args.transcripts else {}),
    } for r in rollouts]
    by_family: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in episodes:
        by_family[e["family"]].append(e)
    table = Table(title=f"{label} {args.split} split, greedy{', with ' + args.adapter if args.adapter else ''}")
    for col in ("family", "tasks", "success", "mean reward", "mean turns", "errors", "failed checks", "failing one check alone"):
        table.add_column(col, justify="right" if col != "family" else "left")

    def row(name: str, es: list[dict[str, Any]]) -> list[str]:
        n = max(len(es), 1)
        alone = ", ".join(f"{check} {count}" for check, count in sorted(sole_failures(es).items()))
        failed = ", ".join(f"{check} {count}" for check, count in check_failures(es).most_common())
        return [name, str(len(es)), f"{sum(e['success'] for e in es)}/{len(es)}",
                f"{sum(e['reward'] for e in es) / n:.3f}", f"{sum(e['turns'] for e in es) / n:.1f}",
                str(sum(bool(e["error"]) for e in es)), failed or "-", alone or "-"]

    if args.decision_point:  # one turn each: what it does is the figure, not the outcome
        where = f"before the expert's {'/'.join(env.start_at['before'])}" if args.before else "decision point"
        table = Table(title=f"{args.env} {args.split} split, first turn at {args.decision_point}'s {where}, "
                            f"greedy{', with ' + args.adapter if args.adapter else ''}")
        for col in ("family", "tasks", *FIRST_TURNS):
            table.add_column(col, justify="right" if col != "family" else "left")

        def row(name: str, es: list[dict[str, Any]]) -> list[str]:
            counts = Counter(e["first_turn"] for e in es)
            return [name, str(len(es)), *(str(counts[k]) for k in FIRST_TURNS)]

    for family in sorted(by_family):
        table.add_row(*row(family, by_family[family]))
    table.add_row(*row("all", episodes), style="bold")
    console.print(table)
    tokens = sum(e["generated_tokens"] for e in episodes)
    summary = {
        "env": args.env, "spec": args.spec, "split": args.split, "agent": agent, "adapter": args.adapter,
        "backend": models.backend_label(backend), "check_failures": dict(check_failures(episodes).most_common()),
        "max_steps": config.max_steps, "tasks": len(episodes), "successes": sum(e["success"] for e in episodes),
        "success_rate": sum(e["success"] for e in episodes) / max(len(episodes), 1),
        "mean_reward": sum(e["reward"] for e in episodes) / max(len(episodes), 1),
        "errors": sum(bool(e["error"]) for e in episodes), "generated_tokens": tokens, "wall_s": round(wall, 1),
        "episodes_per_s": round(len(episodes) / wall, 4) if wall else None,
        "tokens_per_s": round(tokens / wall, 1) if wall else None,
        **({"decision_point": {"capability": args.decision_point, "start": env.start_at,
                               "first_turns": dict(Counter(e["first_turn"] for e in episodes))}}
           if args.decision_point else {}),
    }
    console.print(f"success {summary['successes']}/{summary['tasks']} ({100 * summary['success_rate']:.1f} %), "
                  f"mean reward {summary['mean_reward']:.3f}; {wall:.0f} s, {summary['episodes_per_s']} episodes/s, "
                  f"{summary['tokens_per_s']} generated tokens/s")
    out = Path(args.out) if args.out else paths.sub("reports") / (
        f"{'synthetic_' + synthetic.capability if synthetic is not None else 'target'}_success_{args.env}_{args.split}")
    out.parent.mkdir(parents=True, exist_ok=True)
    paths.atomic_write(out.with_suffix(".json"), json.dumps({**summary, "episodes": episodes}, indent=1, default=str))
    console.print(f"wrote {out.with_suffix('.json')}")
    return summary


FIRST_TURNS = ("write", "read", "question", "reply", "none")


class DecisionPointTarget:
    """``target`` with each episode opened by its expert at ``capability``'s decision point (the
    template synthesizer's ``start`` for it, or before the expert's first move of a kind in
    ``before`` for the same request); everything else is the target's."""

    def __init__(self, target: Any, capability: str, *, before: list[str] | None = None) -> None:
        from trace_assets.envs.base import target_hook
        from trace_assets.synthesize import template_spec

        spec = template_spec({"name": capability, "description": capability}, target)
        if not spec.get("start"):
            raise SystemExit(f"--decision-point: the template has no decision point for {capability!r}")
        from trace_assets.envs.expert import MOVE_KINDS

        unknown = sorted(set(before or ()) - set(MOVE_KINDS))
        if unknown:
            raise SystemExit(f"--before: unknown move kind(s) {unknown}; known: {list(MOVE_KINDS)}")
        self.target, self.start_at = target, {**spec["start"], **({"before": before} if before else {})}
        self.writes = target_hook(target, "tool_classes")()["write"]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)

    def has_decision_point(self, task: Any) -> bool:
        try:
            self.start(task)
        except ValueError:
            return False
        return True

    def start(self, task: Any) -> "OpenedEpisode":
        from trace_assets.synthesize.env import play_to_decision_point

        episode = self.target.start(task)
        messages = episode.initial_messages()
        play_to_decision_point(self.target, task, episode, messages, self.start_at)
        return OpenedEpisode(episode, messages)


class OpenedEpisode:
    """A target episode the expert has played up to a decision point: ``initial_messages()`` is the
    conversation so far; ``result().info["decision_point"]`` says where the agent's part starts."""

    def __init__(self, inner: Any, messages: list[dict[str, Any]]) -> None:
        self.inner, self.messages = inner, messages
        self.confirmations = getattr(inner, "confirmations", 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def initial_messages(self) -> list[dict[str, Any]]:
        return [dict(m) for m in self.messages]

    def result(self) -> Any:
        result = self.inner.result()
        result.info["decision_point"] = {"messages": len(self.messages), "confirmations": self.confirmations}
        return result


def first_turn(rollout: Any, writes: frozenset[str]) -> str:
    """What the agent did first after the decision point (``FIRST_TURNS``)."""
    opened = rollout.result.info["decision_point"]
    first = next((m for m in rollout.messages[opened["messages"]:] if m["role"] == "assistant"), None)
    if first is None:
        return "none"
    if first.get("tool_calls"):
        return "write" if first["tool_calls"][0]["function"]["name"] in writes else "read"
    return "question" if rollout.result.info.get("confirmations", 0) > opened["confirmations"] else "reply"


def synthetic_env(target: Any, spec: Path) -> Any:
    """The synthetic environment of the EnvSpec file ``spec`` over ``target``."""
    from trace_assets.synthesize import SyntheticEnv, load_spec

    return SyntheticEnv(load_spec(spec, target), target)


def synthetic_tasks(env: Any, split: str, n: int) -> list[Any]:
    """``n`` seeds of ``split`` of the synthetic environment ``env``, hints left out, as
    ``lora_adapter`` evaluates adapters there."""
    from trace_assets.synthesize.env import without_hint
    from trace_assets.train.heldout import HELD_OUT_OFFSET, TRAIN_VALIDATION_OFFSET

    if split not in SYNTHETIC_SPLITS:
        raise SystemExit(f"--spec plays a synthetic environment's seeds: --split must be one of {list(SYNTHETIC_SPLITS)}")
    offset = TRAIN_VALIDATION_OFFSET if split == "validation" else HELD_OUT_OFFSET
    return [without_hint(t) for t in env.sample_tasks(n, offset=offset)]


def check_failures(episodes: Sequence[dict[str, Any]]) -> Counter:
    """Per check id, the episodes that failed it (``checks``: ``envs.base.check_outcomes``)."""
    return Counter(c["id"] for e in episodes for c in e.get("checks") or [] if not c["passed"])


def sole_failures(episodes: Sequence[dict[str, Any]]) -> Counter:
    """Per check id, the episodes that failed that check and no other (``info["checks"]``): the
    failures that one capability alone would have to fix."""
    alone: Counter = Counter()
    for e in episodes:
        failed = [c["id"] for c in e.get("checks") or [] if not c["passed"]]
        if len(failed) == 1:
            alone[failed[0]] += 1
    return alone


if __name__ == "__main__":
    main()
