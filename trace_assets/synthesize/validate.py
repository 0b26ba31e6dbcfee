"""Validation of a synthetic environment: fidelity, gold-solvability, calibration and isolation.

* :func:`fidelity` (from ``spec``): problems that make a spec unfaithful to the target; [] = pass.
* :func:`gold_solvable`: plays the target's scripted expert (``expert.demonstrate``, which asks for
  identity, looks up, proposes, asks for confirmation and reports amounts) on tasks of every spec
  family through a :class:`SyntheticEnv`, and reports each task whose rubric reward stays below 1.0
  (an unsatisfiable rubric, a tool subset that lacks a gold tool, ...). [] = pass.
* :func:`calibrate`: rolls out ``seeds`` tasks x ``k`` samples with the caller's ``rollout_fn`` and
  turns the difficulty knobs until mean reward and success rate lie in ``band`` and at least
  ``min_informative`` of the groups have non-constant rewards; every round is recorded.
* :func:`isolation`: labels synthetic rollouts with the Step-1 heuristic rule of the capability and
  compares the mean reward where the capability is PRESENT with where it is LACKING.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from trace_assets.envs.base import Environment, Task, target_hook
from trace_assets.synthesize.env import SyntheticEnv
from trace_assets.synthesize.spec import KNOBS, SpecError, difficulty_of, fidelity, schema_errors

__all__ = ["CalibrationReport", "calibrate", "fidelity", "gold_solvable", "isolation"]


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
    for family in env.families():
        for seed in seed_list:
            where = f"{family}/{seed}"
            try:
                task = env.make_task(family, seed)
                _, result = target_hook(target_env, "expert")(task, via=env)
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


def _step(spec: dict[str, Any], direction: str) -> dict[str, Any] | None:
    """``spec`` one notch easier or harder on every free knob; None when no knob can move."""
    new = copy.deepcopy(spec)
    difficulty = difficulty_of(new)
    frozen = set(difficulty.get("frozen", []))
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


def calibrate(spec: dict[str, Any], target_env: Environment, rollout_fn: RolloutFn, *, seeds: int = 32, k: int = 4,
              temperature: float = 1.0, band: tuple[float, float] = (0.2, 0.6), min_informative: float = 0.5,
              max_rounds: int = 5) -> CalibrationReport:
    """Adjust the difficulty until the environment gives GRPO a learning signal (module docstring).

    Too hard (mean reward or success rate below the band; or too few informative groups with mean
    reward below the band's middle): one notch easier on every free knob (more hints, identity
    volunteered, fewer distractors, weights toward simpler families). Too easy: the reverse.
    """
    low, high = band
    current = copy.deepcopy(spec)
    report = CalibrationReport(passed=False, spec=current)
    for round_index in range(max_rounds):
        env = SyntheticEnv(current, target_env)
        tasks = env.sample_tasks(seeds)
        results = list(rollout_fn(env, tasks, k, temperature))
        if len(results) != len(tasks) * k:
            raise ValueError(f"rollout_fn returned {len(results)} results for {len(tasks)} tasks x k={k}")
        scored = [_reward(r) for r in results]
        rewards = [r for r, _ in scored]
        groups = [rewards[i * k:(i + 1) * k] for i in range(len(tasks))]
        mean = sum(rewards) / len(rewards)
        success = sum(s for _, s in scored) / len(scored)
        informative = sum(1 for g in groups if max(g) - min(g) > 1e-9) / len(groups)
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
        stepped = _step(current, direction)
        if stepped is None:
            report.reason = f"every free difficulty knob is at its {'easiest' if direction == 'easier' else 'hardest'} setting and the environment is still too {'hard' if direction == 'easier' else 'easy'}"
            return report
        current = stepped
    return report


# ---- isolation ---------------------------------------------------------------------------------


def isolation(results_with_info: Iterable[Any], capability_name: str) -> dict[str, Any]:
    """Mean reward where the capability is PRESENT vs LACKING (Step-1 heuristic labels).

    ``passed`` is True when the gap (present - lacking) is > 0, False when <= 0, and None
    ("undetermined") when either side is empty or the capability has no heuristic rule.
    """
    from trace_assets.identify.heuristic import RULES

    rule = RULES.get(capability_name)
    by_label: dict[str, list[float]] = {"PRESENT": [], "LACKING": [], "NA": []}
    if rule is not None:
        for item in results_with_info:
            info = item["info"] if isinstance(item, dict) else item.info
            reward = float(item["reward"] if isinstance(item, dict) else item.reward)
            by_label[rule.judge(info)[0]].append(reward)
    present, lacking = by_label["PRESENT"], by_label["LACKING"]
    mean_present = sum(present) / len(present) if present else None
    mean_lacking = sum(lacking) / len(lacking) if lacking else None
    if rule is None:
        verdict, gap, passed = "undetermined", None, None
        note = f"no heuristic rule for {capability_name!r}"
    elif mean_present is None or mean_lacking is None:
        verdict, gap, passed = "undetermined", None, None
        note = "no rollout where the capability is " + ("PRESENT" if mean_present is None else "LACKING")
    else:
        gap = mean_present - mean_lacking
        passed = gap > 0
        verdict = "pass" if passed else "fail"
        note = f"reward is {gap:+.2f} higher where the capability is present"
    return {"capability": capability_name, "n_present": len(present), "n_lacking": len(lacking),
            "n_na": len(by_label["NA"]), "mean_present": mean_present, "mean_lacking": mean_lacking,
            "gap": gap, "passed": passed, "verdict": verdict, "note": note}


def check_spec(spec: dict[str, Any], target_env: Environment, seeds: int | Iterable[int] = 2) -> list[str]:
    """Schema, then fidelity, then gold-solvability: the first stage with problems reports them."""
    return schema_errors(spec) or fidelity(spec, target_env) or gold_solvable(spec, target_env, seeds)
