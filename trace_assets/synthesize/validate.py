"""Validation of a synthetic environment: fidelity, gold-solvability, calibration and isolation.

* :func:`fidelity` (from ``spec``): problems that make a spec unfaithful to the target; [] = pass.
* :func:`gold_solvable`: plays the target's scripted expert (its ``expert`` hook: retail's asks for
  identity, looks up, proposes, asks for confirmation and reports amounts; tau2's replays the gold) on tasks of every spec
  family through a :class:`SyntheticEnv`, and reports each task whose rubric reward stays below 1.0
  (an unsatisfiable rubric, a tool subset that lacks a gold tool, ...). [] = pass.
* :func:`calibrate`: rolls out ``seeds`` tasks x ``k`` samples with the caller's ``rollout_fn`` and
  turns the difficulty knobs until mean reward and success rate lie in ``band`` and at least
  ``min_informative`` of the groups have non-constant rewards; every round is recorded. Its tasks
  sit at ``CALIBRATION_OFFSET`` of the spec's seed range, apart from GRPO's training tasks (which
  start at ``GRPOConfig.seed_offset = 0``), so training never starts on the very tasks the
  difficulty was tuned on; its sampling seeds come from the training seed
  (:func:`calibration_rollout_seed`).
* :func:`isolation_matrix`: plays the target's expert with each capability it can be ablated of
  (its ``ablations`` hook; ``expert(..., lacking=c')``) and each of its adversarial scripted agents on the environment's
  tasks. The environment of c isolates c when the expert lacking c fails it (success at most
  ``bounds[0]`` on the tasks where the ablation changes what the expert does) and the full expert and
  every expert lacking another capability pass it (success at least ``bounds[1]``). This is measured
  against behaviour, not against an analyst's labels (the earlier measure, reward where the Step-1
  heuristic says PRESENT minus where it says LACKING, was circular: the rubric rewards exactly what
  the heuristic checks). A capability with no ablated expert on this target (retail has one for every
  heuristic capability; tau2_airline's gold replay only for some, see ``envs.mcp.NO_ABLATION``) gets a
  weaker measure: the full expert must pass and every adversary must score at most
  ``WEAK_ADVERSARY_BOUND``; ``method`` says which, and the markdown marks it "(weaker)".
  Either way, no adversary may be paid for failing: its mean reward over the episodes it fails must
  stay at most ``GAMING_BOUND`` (a rubric whose checks pass by absence paid an agent that refused
  everything 0.69 on E_confirm_before_writing without one success).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from trace_assets.envs.base import Environment, Task, target_hook
from trace_assets.synthesize.env import SyntheticEnv
from trace_assets.synthesize.spec import KNOBS, SpecError, difficulty_of, fidelity, fixed_knobs, schema_errors

__all__ = ["CALIBRATION_OFFSET", "CalibrationReport", "calibrate", "calibration_rollout_seed", "fidelity", "gold_solvable", "isolation_heatmap", "isolation_markdown",
           "isolation_matrix"]


# ---- gold-solvability ------------------------------------------------------------------------


def gold_solvable(spec: dict[str, Any], target_env: Environment, seeds: int | Iterable[int] = 2) -> list[str]:
    """Tasks (every spec family x ``seeds``) on which the expert's gold play scores below 1.0.

    ``seeds``: synthetic seeds, or a count of seeds from the start of the spec's range.
    """
    try:
        env = SyntheticEnv(spec, target_env)
    except SpecError as exc:
        return exc.problems
    start, end = env.seed_range
    seed_list = list(range(start, min(end, start + seeds))) if isinstance(seeds, int) else list(seeds)
    problems = []
    expert = target_hook(target_env, "expert")
    played: set[str] = set()
    for family in env.families():
        for seed in seed_list:
            where = f"{family}/{seed}"
            try:
                task = env.make_task(family, seed)
                if play_key(task) in played:
                    continue  # a fixed task list draws one task for several seeds: played already
                played.add(play_key(task))
                _, result = expert(task, via=env)
            except Exception as exc:  # a gold step the spec makes impossible (e.g. a tool outside the subset)
                problems.append(f"{where}: the gold solution cannot be played: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            if result.reward < 1.0 - 1e-9:
                failed = [f"{c['id']} ({c['detail']})" for c in result.info["rubric"] if c["applicable"] and not c["passed"]]
                problems.append(f"{where}: the gold solution scores {result.reward:.2f}; unsatisfiable checks: {failed}")
            elif not result.success:
                problems.append(f"{where}: the gold solution scores 1.0 but is not a success")
    return problems


# ---- calibration -------------------------------------------------------------------------------

RolloutFn = Callable[[SyntheticEnv, list[Task], int, float], Sequence[Any]]
"""``rollout_fn(env, tasks, k, temperature)`` -> results grouped by task (k per task, task order)."""

# knob -> (step toward harder, lower bound, upper bound)
_STEPS: dict[str, tuple[float, float, float]] = {
    "hint_share": (-0.25, 0.0, 1.0),
    "volunteer_identity": (-0.25, 0.0, 1.0),
    "distractor_orders": (1, 0, 4),
    "family_bias": (0.5, -2.0, 2.0),
}


@dataclass
class CalibrationReport:
    passed: bool
    spec: dict[str, Any]
    """The final spec (difficulty possibly adjusted)."""
    rounds: list[dict[str, Any]] = field(default_factory=list)
    """One dict per round: round, difficulty, mean_reward, success_rate, informative_share, passed,
    n_tasks, k, and the direction taken next (easier / harder / none)."""
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _reward(result: Any) -> tuple[float, bool]:
    if isinstance(result, dict):
        return float(result["reward"]), bool(result.get("success", result["reward"] >= 1.0))
    return float(result.reward), bool(result.success)


def round_figures(results: Sequence[Any], k: int) -> tuple[float, float, float]:
    """``(mean reward, success rate, informative share)`` of a calibration round: ``results`` are
    groups of ``k`` episodes of one task each, in order; a group is informative when its rewards
    differ (GRPO's advantage is then not zero)."""
    scored = [_reward(r) for r in results]
    rewards = [r for r, _ in scored]
    groups = [rewards[i:i + k] for i in range(0, len(rewards), k)]
    return (sum(rewards) / len(rewards), sum(s for _, s in scored) / len(scored),
            sum(1 for g in groups if max(g) - min(g) > 1e-9) / len(groups))


def _step(spec: dict[str, Any], direction: str, fixed: frozenset[str] = frozenset()) -> dict[str, Any] | None:
    """``spec`` one notch easier or harder on every free knob; None when no knob can move. ``fixed``
    knobs (those the target does not interpret) never move."""
    new = copy.deepcopy(spec)
    difficulty = difficulty_of(new)
    frozen = set(difficulty.get("frozen", [])) | set(fixed)
    if not new.get("hint"):
        frozen.add("hint_share")  # no hint text: the share has no effect
    moved = False
    for knob in KNOBS:
        if knob in frozen:
            continue
        delta, low, high = _STEPS[knob]
        value = difficulty[knob] + (delta if direction == "harder" else -delta)
        value = min(high, max(low, value))
        if knob == "distractor_orders":
            value = int(value)
        if value != difficulty[knob]:
            difficulty[knob] = round(value, 4) if isinstance(value, float) else value
            moved = True
    if not moved:
        return None
    new["difficulty"] = difficulty
    return new


CALIBRATION_OFFSET = 700_000
"""Calibration tasks are seeds ``start + CALIBRATION_OFFSET ...`` of a spec's seed range. The layout of
that range: GRPO training from 0 (``GRPOConfig.seed_offset``; the paper's 40 iterations x G 4 use
160), GRPO's re-sampled groups from 200,000 (``train.grpo.RESAMPLE_OFFSET``), the router's index from 500,000 and its validation from 600,000 (``route.index_offset``),
calibration from 700,000, the held-out evaluation from 900,000 (``train.heldout.HELD_OUT_OFFSET``)."""
CALIBRATION_STREAM = 2_000_000
"""Calibration's sampling seeds are ``derive_seed(training seed, CALIBRATION_STREAM + round)``;
GRPO's iteration ``i`` samples with ``derive_seed(seed, 1_000_000 + i)`` (``GRPOConfig.rollout_config``)."""


def calibration_rollout_seed(train_seed: int, round_index: int) -> int:
    """The sampling seed of calibration round ``round_index`` for training seed ``train_seed``."""
    from trace_assets.agent.rollout import derive_seed

    return derive_seed(train_seed, CALIBRATION_STREAM + round_index)


def calibrate(spec: dict[str, Any], target_env: Environment, rollout_fn: RolloutFn, *, seeds: int = 32, k: int = 4,
              temperature: float = 1.0, band: tuple[float, float] = (0.2, 0.6), min_informative: float = 0.5,
              max_rounds: int = 5, offset: int = CALIBRATION_OFFSET) -> CalibrationReport:
    """Adjust the difficulty until the environment gives GRPO a learning signal (module docstring).

    Every round plays the same ``seeds`` tasks, at ``offset`` of the spec's seed range.

    Too hard (mean reward or success rate below the band; or too few informative groups with mean
    reward below the band's middle): one notch easier on every free knob (more hints, identity
    volunteered, fewer distractors, weights toward simpler families). Too easy: the reverse.
    """
    low, high = band
    fixed = fixed_knobs(target_env)
    current = copy.deepcopy(spec)
    report = CalibrationReport(passed=False, spec=current)
    for round_index in range(max_rounds):
        env = SyntheticEnv(current, target_env)
        tasks = env.sample_tasks(seeds, offset=offset)
        results = list(rollout_fn(env, tasks, k, temperature))
        if len(results) != len(tasks) * k:
            raise ValueError(f"rollout_fn returned {len(results)} results for {len(tasks)} tasks x k={k}")
        mean, success, informative = round_figures(results, k)
        in_band = low <= mean <= high and low <= success <= high
        passed = in_band and informative >= min_informative
        if passed:
            direction = "none"
        elif mean < low or success < low:
            direction = "easier"
        elif mean > high or success > high:
            direction = "harder"
        else:  # in the band but groups are constant: move toward the middle of the band
            direction = "easier" if mean < (low + high) / 2 else "harder"
        report.rounds.append({
            "round": round_index, "difficulty": difficulty_of(current), "mean_reward": round(mean, 4),
            "success_rate": round(success, 4), "informative_share": round(informative, 4), "passed": passed,
            "n_tasks": len(tasks), "k": k, "direction": direction,
        })
        report.spec = current
        if passed:
            report.passed = True
            report.reason = f"passed in round {round_index}"
            return report
        if round_index == max_rounds - 1:
            report.reason = f"not calibrated after {max_rounds} rounds (last: mean {mean:.2f}, success {success:.2f}, informative {informative:.2f})"
            return report
        stepped = _step(current, direction, fixed)
        if stepped is None:
            report.reason = f"every free difficulty knob is at its {'easiest' if direction == 'easier' else 'hardest'} setting and the environment is still too {'hard' if direction == 'easier' else 'easy'}"
            return report
        current = stepped
    return report


# ---- isolation ---------------------------------------------------------------------------------

ISOLATION_BOUNDS = (0.2, 0.8)
"""(most success of the expert lacking c, least success of every other expert) for a pass."""
WEAK_ADVERSARY_BOUND = 0.5
GAMING_BOUND = 0.5
"""Most mean reward an adversarial scripted agent may earn on the episodes it fails."""
ABLATED = "ablated experts"
WEAKER = ("weaker: no ablated expert for this capability; measured instead: the full expert passes and "
          "every adversarial scripted agent scores low")


def play_key(task: Task) -> str:
    """What a scripted agent's play of ``task`` depends on: the target task, its scenario, gold and
    expected state (scripted agents never read the system prompt, so a hint changes nothing for
    them). On a target with a task generator every seed has its own key; on a fixed task list
    (tau2) several synthetic seeds draw one task and share it."""
    return json.dumps([task.meta.get("target_task_id", task.task_id), task.scenario, task.gold_actions,
                       task.required_info, task.expected_state_hash], sort_keys=True, default=str)


def distinct_plays(tasks: list[Task]) -> list[Task]:
    """``tasks`` without those that would be played exactly like an earlier one (:func:`play_key`)."""
    seen: set[str] = set()
    out = []
    for task in tasks:
        key = play_key(task)
        if key not in seen:
            seen.add(key)
            out.append(task)
    return out


def _play_all(env: SyntheticEnv, tasks: list[Task], **how: Any) -> list[tuple[list[dict[str, Any]], Any]]:
    expert = target_hook(env.target, "expert")
    return [expert(task, via=env, **how) for task in tasks]


def matrix_row(name: str, kind: str, results: Sequence[Any], acting: Sequence[Any]) -> dict[str, Any]:
    """One row of the isolation matrix (fields in :func:`isolation_matrix`) from an agent's episode
    ``results`` and those of them where it ``acting`` differently from the full expert."""
    failed = [r.reward for r in results if not r.success]
    return {
        "agent": name, "kind": kind, "n": len(results),
        "mean_reward": round(sum(r.reward for r in results) / len(results), 4),
        "success": round(sum(r.success for r in results) / len(results), 4),
        "n_acts": len(acting),
        "success_where_acts": round(sum(r.success for r in acting) / len(acting), 4) if acting else None,
        "n_failed": len(failed), "reward_when_failed": round(sum(failed) / len(failed), 4) if failed else None,
    }


def _row(name: str, kind: str, played: list[tuple[list[dict[str, Any]], Any]], full: list[tuple[list[dict[str, Any]], Any]]) -> dict[str, Any]:
    acts = [messages != full_messages for (messages, _), (full_messages, _) in zip(played, full)]
    results = [result for _, result in played]
    return matrix_row(name, kind, results, [r for r, a in zip(results, acts) if a])


def isolation_matrix(spec: dict[str, Any], target_env: Environment, *, seeds: int | Iterable[int] = 3,
                     bounds: tuple[float, float] = ISOLATION_BOUNDS) -> dict[str, Any]:
    """This environment's row of the isolation matrix and its verdict (see the module docstring).

    The tasks: every spec family on ``seeds`` (synthetic seeds, or a count from the start of the
    range), whatever the family weights, so that a family the calibrator tilts away from still counts.

    Returns ``{"capability", "method", "passed", "reason", "bounds", "rows"}``; each row is
    ``{"agent", "kind" (full / lacking / adversary), "n", "mean_reward", "success", "n_acts",
    "success_where_acts", "n_failed", "reward_when_failed"}`` where ``n_acts`` counts the tasks on
    which that agent's conversation differs from the full expert's, and ``reward_when_failed`` is
    the mean reward of the episodes it failed (None when it failed none).
    """
    ablations = target_hook(target_env, "ablations")()
    adversaries = target_hook(target_env, "adversaries")()
    env = SyntheticEnv(spec, target_env)
    start, end = env.seed_range
    seed_list = list(range(start, min(end, start + seeds))) if isinstance(seeds, int) else list(seeds)
    tasks = distinct_plays([env.make_task(family, seed) for family in env.families() for seed in seed_list])
    full = _play_all(env, tasks)
    rows = [_row("full", "full", full, full)]
    rows += [_row(c, "lacking", _play_all(env, tasks, lacking=c), full) for c in ablations]
    rows += [_row(a, "adversary", _play_all(env, tasks, policy=p), full) for a, p in adversaries.items()]
    low, high = bounds
    name = env.capability
    by = {r["agent"]: r for r in rows}
    problems = []
    if by["full"]["success"] < high:
        problems.append(f"the full expert succeeds on only {by['full']['success']:.2f} < {high}")
    if name in ablations:
        method = ABLATED
        own = by[name]
        if not own["n_acts"]:
            problems.append(f"the expert lacking {name} behaves like the full expert on every task")
        elif own["success_where_acts"] > low:
            problems.append(f"the expert lacking {name} still succeeds on {own['success_where_acts']:.2f} > {low} "
                            f"of the {own['n_acts']} tasks where it acts differently")
        for other in ablations:
            if other != name and by[other]["success"] < high:
                problems.append(f"the expert lacking only {other} fails it (success {by[other]['success']:.2f} < {high})")
    else:
        method = WEAKER
        for adversary in adversaries:
            if by[adversary]["success"] > WEAK_ADVERSARY_BOUND:
                problems.append(f"adversary {adversary} succeeds on {by[adversary]['success']:.2f} > {WEAK_ADVERSARY_BOUND}")
    for adversary in adversaries:
        paid = by[adversary]["reward_when_failed"]
        if paid is not None and paid > GAMING_BOUND:
            problems.append(f"the rubric pays adversary {adversary} a mean reward of {paid:.2f} > {GAMING_BOUND} "
                            f"on the {by[adversary]['n_failed']} episode(s) it fails")
    return {"capability": name, "method": method, "passed": not problems,
            "reason": "; ".join(problems) if problems else f"isolates {name} ({method})",
            "bounds": list(bounds), "n_tasks": len(tasks), "rows": rows}


def isolation_markdown(reports: Sequence[dict[str, Any]]) -> str:
    """The isolation matrix as a markdown table: one row per environment, one column per agent
    (success; where the agent is the ablation of the row's own capability, its success on the tasks
    where the ablation acts), and the verdict; then, per environment, the mean reward its rubric
    pays each adversary on the episodes that adversary fails (at most ``GAMING_BOUND`` to pass)."""
    agents = [r["agent"] for r in reports[0]["rows"]] if reports else []
    head = "| environment | " + " | ".join(agents) + " | isolates |\n|" + "---|" * (len(agents) + 2)
    lines = [head]
    for report in reports:
        cells = []
        for row in report["rows"]:
            own = row["agent"] == report["capability"]
            value = row["success_where_acts"] if own and row["success_where_acts"] is not None else row["success"]
            cells.append(f"**{value:.2f}**" if own else f"{value:.2f}")
        verdict = ("yes" if report["passed"] else "NO") + ("" if report["method"] == ABLATED else " (weaker)")
        lines.append(f"| E_{report['capability']} | " + " | ".join(cells) + f" | {verdict} |")
    for report in reports:
        paid = [f"{r['agent']} {r['reward_when_failed']:.2f} ({r['n_failed']}/{r['n']} failed)"
                for r in report["rows"] if r["kind"] == "adversary" and r.get("reward_when_failed") is not None]
        if paid:
            lines.append(f"\nE_{report['capability']} pays on failed episodes (at most {GAMING_BOUND}): " + "; ".join(paid))
    return "\n".join(lines)


def isolation_heatmap(reports: Sequence[dict[str, Any]], *, title: str = "") -> bytes:
    """PNG heatmap of success per (environment, agent), the cells of :func:`isolation_markdown`."""
    from trace_assets.figures import heatmap

    agents = [r["agent"] for r in reports[0]["rows"]]
    values = []
    for report in reports:
        values.append([(r["success_where_acts"] if r["agent"] == report["capability"] and r["success_where_acts"] is not None
                        else r["success"]) for r in report["rows"]])
    return heatmap(values, [f"E_{r['capability']}" for r in reports], agents,
                   title=title or "isolation: success of each agent in each environment")


def check_spec(spec: dict[str, Any], target_env: Environment, seeds: int | Iterable[int] = 2) -> list[str]:
    """Schema, then fidelity, then gold-solvability: the first stage with problems reports them."""
    return schema_errors(spec) or fidelity(spec, target_env) or gold_solvable(spec, target_env, seeds)
