"""One capability's synthetic environment, built the way the ``synthetic_env`` asset builds it.

Contract, in the asset's order: :func:`checked_spec` has ``synthesize(capability, target, failed)``
write a spec (``SynthesizerResource.synthesize``: the template or the LLM synthesizer) and runs
:func:`check_spec` (schema, fidelity, gold-solvability on 2 seeds), raising :class:`SpecRejected`
with every problem, before any model is loaded; then :func:`build_environment` runs
:func:`calibrate` with the Step-2 settings (``SynthesisSettings``), which turns the difficulty knobs
on base-agent rollouts, and :func:`isolation_matrix` on the calibrated spec. Nothing is written to disk and nothing is logged to Dagster: the asset
stores and reports the result, a benchmark uses it as it is.

A target without an expert (no ``expert`` hook: a user environment) has no template to synthesize
from and no expert to ablate. :func:`build_logged_environment` builds its environment from Step 1's
logs instead (``synthesize.prefix``): every train trajectory with a LACKING step for the capability
opens an episode at that step; a log that does not replay on the target is quarantined (listed,
not used, nothing deleted). There are no difficulty knobs to turn, so calibration is one measured
round on train-side prefixes, passed when it gives GRPO a signal (at least ``min_informative`` of
the groups informative) and leaves something to learn (success at most the band's top). Isolation
is the weaker measure ``LOGGED_WEAKER``: the logged agent, replayed whole from its logs, must fail
(success at most the lower isolation bound) where its labels say the capability was lacking, and
both sides (train, held-out) must hold a prefix.

:class:`CalibrationRollouts` is the rollout function both give :func:`calibrate`: the batched
runner at the calibration temperature, ``syn.max_steps`` turns, sampling seeds from the training
seed and the round index, so a benchmark calibrates exactly as the asset does on the same agent.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trace_assets.envs.base import Environment, EpisodeResult, Task
from trace_assets.identify.capabilities import Label
from trace_assets.synthesize.env import SyntheticEnv
from trace_assets.synthesize.prefix import (
    LoggedPrefixEnv,
    PrefixError,
    logged_prefixes,
    logged_spec,
    replayed_outcome,
)
from trace_assets.synthesize.validate import (
    CALIBRATION_OFFSET,
    ISOLATION_BOUNDS,
    CalibrationReport,
    calibrate,
    calibration_rollout_seed,
    check_spec,
    isolation_matrix,
    matrix_row,
    round_figures,
)

LOGGED_WEAKER = ("weaker: no expert to ablate; measured instead: the logged agent, replayed from its logs, fails "
                 "where its labels say the capability was lacking")

Synthesize = Callable[[dict[str, Any], Environment, list[dict[str, Any]]], tuple[dict[str, Any], list[str]]]
"""``(capability, target, failed trajectories) -> (spec, rejection reasons of earlier attempts)``."""


class SpecRejected(ValueError):
    """The synthesized spec fails the schema, fidelity or gold-solvability; ``problems`` says why."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("spec rejected: " + "; ".join(problems[:5]))
        self.problems = list(problems)


@dataclass
class CalibrationRollouts:
    """``rollout_fn(env, tasks, k, temperature)`` for :func:`calibrate` (see the module docstring).

    ``rounds`` holds the number of rollouts of each round; ``last`` the last round's rollouts (the
    asset's reward histogram and sample episode)."""

    backend: Any
    tokenizer: Any
    max_steps: int
    max_new_tokens: int
    max_context_tokens: int
    train_seed: int = 0
    """The training seed (``GRPOConfig.seed``): round r samples with ``calibration_rollout_seed(train_seed, r)``."""
    log: Callable[[str], None] | None = None
    rounds: list[int] = field(default_factory=list)
    last: list[Any] = field(default_factory=list)

    def __call__(self, env: SyntheticEnv, tasks: Sequence[Task], k: int, temperature: float) -> list[EpisodeResult]:
        from trace_assets.agent.rollout import RolloutConfig, run_rollouts

        index = len(self.rounds)
        config = RolloutConfig(max_steps=self.max_steps, max_new_tokens=self.max_new_tokens,
                               max_context_tokens=self.max_context_tokens, temperature=temperature,
                               seed=calibration_rollout_seed(self.train_seed, index))
        repeated = [t for t in tasks for _ in range(k)]
        self._log(f"calibration round {index}: {len(repeated)} episodes at T={temperature}, "
                  f"difficulty {json.dumps((getattr(env, 'spec', None) or {}).get('difficulty', {}))}")
        rollouts = run_rollouts(env, repeated, self.backend, self.tokenizer, config)
        n = max(len(rollouts), 1)
        self._log(f"calibration round {index}: mean reward {sum(r.result.reward for r in rollouts) / n:.3f}, "
                  f"success {sum(r.result.success for r in rollouts) / n:.3f}")
        self.rounds.append(len(rollouts))
        self.last = rollouts
        return [r.result for r in rollouts]

    def _log(self, line: str) -> None:
        if self.log is not None:
            self.log(line)


@dataclass
class BuiltEnvironment:
    spec: dict[str, Any]
    """The calibrated spec (the one to train on)."""
    calibration: CalibrationReport
    isolation: dict[str, Any]
    """:func:`isolation_matrix` of the calibrated spec."""
    rejected: list[str]
    """Rejection reasons of the synthesizer's earlier attempts (LLM repairs)."""
    calibration_rollouts: int

    @property
    def passed(self) -> bool:
        """The blocking check's verdict: calibrated and isolating."""
        return bool(self.calibration.passed and self.isolation["passed"])


def checked_spec(capability: dict[str, Any], target: Environment, synthesize: Synthesize,
                 failed: Iterable[dict[str, Any]] = ()) -> tuple[dict[str, Any], list[str]]:
    """``(spec, rejection reasons of earlier attempts)`` from ``synthesize``, or :class:`SpecRejected`
    when it fails the schema, fidelity or gold-solvability. ``capability`` is ``{name, description,
    failure_modes}``; ``failed`` are the target trajectories that exhibit its failure."""
    spec, rejected = synthesize(capability, target, list(failed))
    problems = check_spec(spec, target, seeds=2)
    if problems:
        raise SpecRejected(problems)
    return spec, list(rejected)


def build_environment(spec: dict[str, Any], target: Environment, rollouts: CalibrationRollouts, syn: Any, *,
                      rejected: Sequence[str] = ()) -> BuiltEnvironment:
    """Calibrate a checked spec (:func:`checked_spec`) on the agent behind ``rollouts`` with the
    ``SynthesisSettings`` ``syn``, then measure its isolation against the ablated experts."""
    report = calibrate(spec, target, rollouts, seeds=syn.calibration_seeds, k=syn.calibration_k,
                       temperature=syn.temperature, band=tuple(syn.band), min_informative=syn.min_informative,
                       max_rounds=syn.max_rounds)
    return BuiltEnvironment(spec=report.spec, calibration=report, isolation=isolation_matrix(report.spec, target),
                            rejected=list(rejected), calibration_rollouts=sum(rollouts.rounds))


def build_logged_environment(capability: dict[str, Any], trajectories: Iterable[dict[str, Any]], labels: Iterable[Label],
                             target: Environment, rollouts: CalibrationRollouts, syn: Any) -> BuiltEnvironment:
    """The logged-decision-point environment of ``capability`` (module docstring) from the train
    ``trajectories`` and their Step-1 ``labels``; ``rejected`` lists the quarantined logs."""
    name = capability["name"]
    by_trajectory: dict[str, list[Label]] = {}
    for label in labels:
        by_trajectory.setdefault(label.trajectory_id, []).append(label)
    kept, quarantined = [], []
    for trajectory in trajectories:
        try:
            prefixes = logged_prefixes([trajectory], by_trajectory.get(trajectory["trajectory_id"], []), name, target)
            if not prefixes:
                continue
            outcome = replayed_outcome(target, trajectory)  # the whole log, so its prefix replays too
        except PrefixError as exc:
            quarantined.append(f"quarantined {trajectory['trajectory_id']}: {exc}")
            continue
        kept.append((prefixes[0], outcome))
    if not kept:
        raise PrefixError(f"{name}: no train trajectory with a LACKING step replays on {target.name!r}"
                          + (f" ({len(quarantined)} quarantined: {quarantined[0]})" if quarantined else ""))
    spec = logged_spec(capability, [p for p, _ in kept], target)
    env = LoggedPrefixEnv.from_spec(spec, target)
    high = syn.band[1]
    k = syn.calibration_k
    tasks = env.sample_tasks(syn.calibration_seeds, offset=CALIBRATION_OFFSET)
    mean, success, informative = round_figures(list(rollouts(env, tasks, k, syn.temperature)), k)
    passed = informative >= syn.min_informative and success <= high
    reason = ("measured once (no difficulty knobs on logged prefixes): " +
              ("it gives GRPO a signal" if passed else
               f"success {success:.2f} > {high}: little left to learn" if success > high else
               f"only {informative:.2f} < {syn.min_informative} of the groups are informative"))
    calibration = CalibrationReport(passed=passed, spec=spec, reason=reason, rounds=[{
        "round": 0, "difficulty": {}, "mean_reward": round(mean, 4), "success_rate": round(success, 4),
        "informative_share": round(informative, 4), "passed": passed, "n_tasks": len(tasks), "k": k, "direction": "none"}])
    outcomes = [outcome for _, outcome in kept]
    row = matrix_row(name, "lacking", outcomes, outcomes)  # the logged agent differs from no expert: it acts everywhere
    problems = [f"the logged agent still succeeds on {row['success']:.2f} > {ISOLATION_BOUNDS[0]} of the logs whose "
                f"labels say {name} was lacking"] if row["success"] > ISOLATION_BOUNDS[0] else []
    problems += [f"no {side.replace('_', '-')} prefix among {len(kept)} (log more failures of {name})"
                 for side in ("train", "held_out") if not env.sides[side]]
    isolation = {"capability": name, "method": LOGGED_WEAKER, "passed": not problems,
                 "reason": "; ".join(problems) if problems else f"isolates {name} ({LOGGED_WEAKER})",
                 "bounds": list(ISOLATION_BOUNDS), "n_tasks": len(kept), "rows": [row],
                 "sides": {side: len(ix) for side, ix in env.sides.items()}, "quarantined": quarantined}
    return BuiltEnvironment(spec=spec, calibration=calibration, isolation=isolation, rejected=quarantined,
                            calibration_rollouts=sum(rollouts.rounds))
