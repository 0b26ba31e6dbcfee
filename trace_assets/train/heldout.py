"""Greedy evaluation of an adapter against its base on held-out seeds of a (synthetic) environment.

Contract: ``compare_base_and_adapter(peft_model, tokenizer, env, config)`` plays the same
``config.n_tasks`` tasks (seeds ``config.seed_offset ...`` of the env, far from the training seeds,
which start at ``GRPOConfig.seed_offset = 0``) twice with greedy decoding (T = 0): once with the
adapter disabled (the base) and once with it enabled. It returns an :class:`EvalReport` per policy.
Paper settings: T = 0, at most 50 interaction steps, 32k context (``EvalConfig.paper()``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from trace_assets.agent.backends import TransformersBackend
from trace_assets.agent.rollout import Rollout, RolloutConfig, run_rollouts
from trace_assets.envs.base import Environment

HELD_OUT_OFFSET = 900_000
"""Evaluation seeds start here inside the synthetic seed range (training starts at 0)."""


@dataclass(frozen=True)
class EvalConfig:
    n_tasks: int = 16
    seed_offset: int = HELD_OUT_OFFSET
    max_steps: int = 50
    max_new_tokens: int = 96
    max_context_tokens: int = 4096
    batch_size: int = 32

    @classmethod
    def paper(cls) -> "EvalConfig":
        return cls(max_steps=50, max_context_tokens=32768)

    def rollout_config(self) -> RolloutConfig:
        return RolloutConfig(max_steps=self.max_steps, max_new_tokens=self.max_new_tokens, temperature=0.0,
                             max_context_tokens=self.max_context_tokens)


@dataclass
class EvalReport:
    policy: str
    n: int
    mean_reward: float
    success_rate: float
    rewards: list[float]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _report(policy: str, rollouts: list[Rollout]) -> EvalReport:
    rewards = [float(r.result.reward) for r in rollouts]
    n = len(rollouts)
    return EvalReport(policy=policy, n=n, mean_reward=sum(rewards) / max(n, 1),
                      success_rate=sum(bool(r.result.success) for r in rollouts) / max(n, 1), rewards=rewards)


def evaluate_policy(model: Any, tokenizer: Any, env: Environment, config: EvalConfig, *, policy: str,
                    backend_factory: Callable[[Any, Any], Any] | None = None) -> EvalReport:
    """Greedy rollouts of ``model`` on the held-out tasks. ``backend_factory(model, tokenizer)``
    (e.g. ``ModelResource.policy_backend_factory``) serves the model as it is when called;
    default: transformers."""
    tasks = env.sample_tasks(config.n_tasks, offset=config.seed_offset)
    model.eval()
    backend = (backend_factory(model, tokenizer) if backend_factory is not None
               else TransformersBackend(model, tokenizer, batch_size=config.batch_size))
    return _report(policy, run_rollouts(env, tasks, backend, tokenizer, config.rollout_config()))


def compare_base_and_adapter(peft_model: Any, tokenizer: Any, env: Environment, config: EvalConfig | None = None,
                             *, backend_factory: Callable[[Any, Any], Any] | None = None) -> dict[str, EvalReport]:
    """``{"base": ..., "adapter": ...}`` on the same held-out tasks (base = adapter disabled)."""
    config = config or EvalConfig()
    disabled = getattr(peft_model, "disable_adapter", None)
    with disabled() if disabled else contextlib.nullcontext():
        base = evaluate_policy(peft_model, tokenizer, env, config, policy="base", backend_factory=backend_factory)
    adapter = evaluate_policy(peft_model, tokenizer, env, config, policy="adapter", backend_factory=backend_factory)
    return {"base": base, "adapter": adapter}
