"""One capability's synthetic environment, built the way the ``synthetic_env`` asset builds it.

Contract, in the asset's order: :func:`checked_spec` has ``synthesize(capability, target, failed)``
write a spec (``SynthesizerResource.synthesize``: the template or the LLM synthesizer) and runs
:func:`check_spec` (schema, fidelity, gold-solvability on 2 seeds), raising :class:`SpecRejected`
with every problem, before any model is loaded; then :func:`build_environment` runs
:func:`calibrate` with the Step-2 settings (``SynthesisSettings``), which turns the difficulty knobs
on base-agent rollouts, and :func:`isolation_matrix` on the calibrated spec. Nothing is written to disk and nothing is logged to Dagster: the asset
stores and reports the result, a benchmark uses it as it is.

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
from trace_assets.synthesize.env import SyntheticEnv
from trace_assets.synthesize.validate import (
    CalibrationReport,
    calibrate,
    calibration_rollout_seed,
    check_spec,
    isolation_matrix,
)

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
                  f"difficulty {json.dumps(env.spec.get('difficulty', {}))}")
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
