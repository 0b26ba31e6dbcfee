"""Greedy evaluation of an adapter against its base and its null control on held-out seeds of a
(synthetic) environment, and the promotion gate.

Contract: ``compare_base_and_adapter(peft_model, tokenizer, env, config)`` plays the same
``config.n_tasks`` tasks (seeds ``config.seed_offset ...`` of the env, far from the training seeds,
which start at ``GRPOConfig.seed_offset = 0``), each without its hint (``synthesize.env.without_hint``:
a hint is a training aid, never part of what is measured), with greedy decoding (T = 0): with the adapter
disabled (the base), enabled, and, given ``null_dir``, with the null control in its place
(``agent.lora.null_adapter``). It returns an :class:`EvalReport` per policy.
Paper settings: T = 0, at most 50 interaction steps, 32k context (``EvalConfig.paper()``).

:func:`promotion` is the gate in front of the MLflow alias ``champion``: an adapter is promoted only
when its held-out success beats both the base and its null by more than the noise, i.e. the exact
one-sided sign test on the tasks where they disagree gives ``p < alpha`` against each, when it
passes none of the rubric's shaping checks less often than the base does (the same test the other
way: :func:`shaping_guards`), and, given the target guard's reports, when on the target's own
train-split tasks it does not succeed less often than the base (:func:`target_guard`: do no harm
on the target). Those tasks are train-side (Step 1 saw them), never the test split. Success is the
target's objective and alone decides; success on the families where the capability was LACKING
(where it is meant to help) and each of the target's checks are measured beside it and reported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from dataclasses import asdict, dataclass, field
from typing import Any

from trace_assets.agent.backends import TransformersBackend
from trace_assets.agent.rollout import Rollout, RolloutConfig, run_rollouts, with_limits
from trace_assets.envs.base import Environment, check_outcomes
from trace_assets.synthesize.env import without_hint

HELD_OUT_OFFSET = 900_000
"""Evaluation seeds start here inside the synthetic seed range (training starts at 0)."""
TRAIN_VALIDATION_OFFSET = 800_000
"""Train-side validation seeds start here: apart from the training seeds (from 0), the router's
index and validation seeds (``route.index_offset`` 500,000 and 100,000 after it) and the held-out
seeds. Hyperparameters (learning rate, iterations, group sizes) are chosen on these, never on
the held-out seeds, which only measure."""


@dataclass(frozen=True)
class EvalConfig:
    n_tasks: int = 16
    seed_offset: int = HELD_OUT_OFFSET
    max_steps: int = 50
    max_new_tokens: int = 96
    max_context_tokens: int = 4096
    batch_size: int = 32

    from_limits = classmethod(with_limits)
    """``EvalConfig.from_limits(grpo_config, n_tasks=...)``: the episode limits a run trained under."""

    @classmethod
    def paper(cls) -> "EvalConfig":
        return cls(max_steps=50, max_context_tokens=32768)

    def rollout_config(self) -> RolloutConfig:
        return RolloutConfig.from_limits(self, temperature=0.0)


@dataclass
class EvalReport:
    policy: str
    n: int
    mean_reward: float
    success_rate: float
    rewards: list[float]
    successes: list[bool] = field(default_factory=list)
    checks: dict[str, list[bool | None]] = field(default_factory=dict)
    """Check id -> per task: passed, or None where it did not apply: a synthetic environment's
    rubric checks, or on a target the target's own (``envs.base.check_outcomes``: state match,
    information told, confirmed writes for retail). What a success rate hides, e.g. whether the
    agent still makes the write."""
    shaping: list[str] = field(default_factory=list)
    """The ids among ``checks`` of the rubric's shaping checks (reward, not success)."""

    def check_counts(self) -> dict[str, list[int]]:
        """Check id -> [tasks it passed, tasks it applied to]."""
        return {cid: [sum(bool(x) for x in row), sum(x is not None for x in row)] for cid, row in self.checks.items()}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _report(policy: str, rollouts: list[Rollout]) -> EvalReport:
    rewards = [float(r.result.reward) for r in rollouts]
    n = len(rollouts)
    successes = [bool(r.result.success) for r in rollouts]
    checks: dict[str, list[bool | None]] = {}
    shaping: list[str] = []
    for i, rollout in enumerate(rollouts):
        rubric = rollout.result.info.get("rubric")
        if not isinstance(rubric, list):  # a target episode: its own per-check breakdown, every check applies
            for cid, passed in check_outcomes(rollout.result.info).items():
                checks.setdefault(cid, [None] * n)[i] = passed
            continue
        for check in rubric:
            row = checks.setdefault(check["id"], [None] * n)
            row[i] = bool(check.get("passed")) if check.get("applicable") else None
            if check.get("shaping") and check["id"] not in shaping:
                shaping.append(check["id"])
    return EvalReport(policy=policy, n=n, mean_reward=sum(rewards) / max(n, 1),
                      success_rate=sum(successes) / max(n, 1), rewards=rewards, successes=successes, checks=checks,
                      shaping=shaping)


def evaluate_policy(model: Any, tokenizer: Any, env: Environment, config: EvalConfig, *, policy: str,
                    backend_factory: Callable[[Any, Any], Any] | None = None) -> EvalReport:
    """Greedy rollouts of ``model`` on the held-out tasks. ``backend_factory(model, tokenizer)``
    (e.g. ``ModelResource.policy_backend_factory``) serves the model as it is when called;
    default: transformers."""
    tasks = [without_hint(t) for t in env.sample_tasks(config.n_tasks, offset=config.seed_offset)]
    model.eval()
    backend = (backend_factory(model, tokenizer) if backend_factory is not None
               else TransformersBackend(model, tokenizer, batch_size=config.batch_size))
    return _report(policy, run_rollouts(env, tasks, backend, tokenizer, config.rollout_config()))


def compare_base_and_adapter(peft_model: Any, tokenizer: Any, env: Environment, config: EvalConfig | None = None,
                             *, backend_factory: Callable[[Any, Any], Any] | None = None,
                             null_dir: str | Path | None = None) -> dict[str, EvalReport]:
    """``{"base", "adapter"[, "null"]}`` on the same held-out tasks (base = adapter disabled; null =
    the adapter folder ``null_dir`` loaded beside the trained one and active in its place)."""
    config = config or EvalConfig()
    disabled = getattr(peft_model, "disable_adapter", None)
    with disabled() if disabled else contextlib.nullcontext():
        base = evaluate_policy(peft_model, tokenizer, env, config, policy="base", backend_factory=backend_factory)
    adapter = evaluate_policy(peft_model, tokenizer, env, config, policy="adapter", backend_factory=backend_factory)
    out = {"base": base, "adapter": adapter}
    if null_dir is not None:
        with null_active(peft_model, null_dir):
            out["null"] = evaluate_policy(peft_model, tokenizer, env, config, policy="null", backend_factory=backend_factory)
    return out


NULL_ADAPTER = "null_control"


@contextlib.contextmanager
def null_active(peft_model: Any, null_dir: str | Path):
    """Within: the adapter folder ``null_dir`` loaded beside the trained adapter and active in its
    place; after: the trained adapter active again and the null unloaded."""
    trained = peft_model.active_adapter
    peft_model.load_adapter(str(null_dir), adapter_name=NULL_ADAPTER, is_trainable=False)
    try:
        peft_model.set_adapter(NULL_ADAPTER)
        yield peft_model
    finally:
        peft_model.set_adapter(trained)
        peft_model.delete_adapter(NULL_ADAPTER)


def promotion(reports: dict[str, EvalReport], *, alpha: float = 0.05,
              target: dict[str, Any] | None = None) -> dict[str, Any]:
    """The promotion gate (module docstring): ``{"promoted", "reason", "vs_base", "vs_null", "alpha",
    "guards", "target_guard"}``. ``target``: ``{"base", "adapter"}`` reports on the target guard's
    tasks, and ``"lacking"``, per task whether its family is one where the capability was LACKING
    (None: not measured, and the reason says so).

    Without a null report the adapter is never promoted (the control is part of the evidence)."""
    from trace_assets.route.report import paired_comparison

    adapter = [float(x) for x in reports["adapter"].successes]
    rows: dict[str, Any] = {"alpha": alpha}
    verdicts = []
    for other in ("base", "null"):
        if other not in reports:
            rows[f"vs_{other}"] = None
            verdicts.append(f"no {other} measured")
            continue
        cmp = paired_comparison(adapter, [float(x) for x in reports[other].successes])
        rows[f"vs_{other}"] = cmp
        ok = cmp["p_greater"] < alpha
        verdicts.append(f"{'beats' if ok else 'does not beat'} {other} ({reports['adapter'].success_rate:.2f} vs "
                        f"{reports[other].success_rate:.2f}: {cmp['wins']} wins, {cmp['losses']} losses, one-sided p "
                        f"{cmp['p_greater']:.3f})")
    rows["guards"] = guards = shaping_guards(reports["adapter"], reports["base"]) if "base" in reports else {}
    broken = [f"it stopped passing {cid} (shaping: {g['adapter']} of {g['applicable']} tasks, base {g['base']}; "
              f"one-sided p {g['p_greater']:.3f})" for cid, g in guards.items() if g["p_greater"] < alpha]
    rows["target_guard"] = harm = (target_guard(target["adapter"], target["base"], target.get("lacking"))
                                   if target else None)
    if harm:
        won, aimed = harm["success"], harm.get(LACKING_SUCCESS) or {"applicable": 0}
        verdicts.append(f"on {won['applicable']} target train tasks it succeeds on {won['adapter']}, base {won['base']}"
                        + (f" (on the {aimed['applicable']} of its LACKING families: {aimed['adapter']}, base "
                           f"{aimed['base']})" if aimed["applicable"] else ""))
        if won["p_greater"] < alpha:
            broken.append(f"there it succeeds less often than the base (one-sided p {won['p_greater']:.3f})")
    promoted = not broken and all(rows[k] is not None and rows[k]["p_greater"] < alpha for k in ("vs_base", "vs_null"))
    n = reports["adapter"].n
    rows["promoted"] = promoted
    guarded = ("no shaping check lost, nor success on the target's train tasks" if harm
               else "no shaping check lost; the target guard measured nothing")
    rows["reason"] = (f"{'promoted' if promoted else 'not promoted'}: on {n} held-out seeds its success "
                      + "; ".join(verdicts + broken) + f" (gate: p < {alpha} against both, and {guarded})")
    return rows


def shaping_guards(adapter: EvalReport, base: EvalReport) -> dict[str, dict[str, Any]]:
    """Per shaping check of the rubric: how often the base and the adapter pass it on the tasks
    where it applies to both, and the one-sided sign test that the base passes it more often
    (``p_greater``). A shaping check guards what another capability decides (e.g. making the
    write once the user said yes): an adapter whose success rose because it stopped doing that
    has learned the environment's loophole, not the capability."""
    return paired_guards(adapter.checks, base.checks, adapter.shaping)


LACKING_SUCCESS = "success_lacking_families"


def target_guard(adapter: EvalReport, base: EvalReport, lacking: list[bool] | None = None) -> dict[str, dict[str, Any]]:
    """:func:`paired_guards` of success, of success on the tasks ``lacking`` marks (its
    :data:`LACKING_SUCCESS` row) and of every check of the target (``state_match``,
    ``info_communicated``, ``confirmed_writes`` for retail), adapter against base on the same target
    tasks; :func:`promotion` decides on ``success``, the rest says where a change comes from. The
    E_confirm_before_writing adapter of the first guided experiment's seed 0 gained on its
    environment and stopped making the writes the target needs (successful writes in 12 of 90 test
    episodes, base 43): an environment that isolates c cannot pay for the other capabilities, so
    the target is where their loss shows."""
    def rows(report: EvalReport) -> dict[str, list[bool | None]]:
        aimed = ({LACKING_SUCCESS: [ok if mark else None for ok, mark in zip(report.successes, lacking)]}
                 if lacking is not None else {})
        return {"success": report.successes, **aimed, **report.checks}

    ids = ["success", *([LACKING_SUCCESS] if lacking is not None else []), *sorted(set(adapter.checks) | set(base.checks))]
    return paired_guards(rows(adapter), rows(base), ids)


def paired_guards(adapter: dict[str, list[bool | None]], base: dict[str, list[bool | None]],
                  ids: list[str]) -> dict[str, dict[str, Any]]:
    """Per id: on the tasks where the outcome applies to both (not None), how often each passed,
    and the exact one-sided sign test that the base passes more often (``p_greater``)."""
    from trace_assets.route.report import paired_comparison

    out = {}
    for cid in ids:
        pairs = [(b, a) for a, b in zip(adapter.get(cid, []), base.get(cid, [])) if a is not None and b is not None]
        cmp = paired_comparison([float(b) for b, _ in pairs], [float(a) for _, a in pairs])
        out[cid] = {"applicable": len(pairs), "base": sum(bool(b) for b, _ in pairs),
                    "adapter": sum(bool(a) for _, a in pairs), "p_greater": cmp["p_greater"]}
    return out


def guard_tasks(tasks: list[Any], first: list[str], limit: int) -> list[Any]:
    """At most ``limit`` of ``tasks`` (objects with ``family``), taken in turn from each family: the
    families ``first`` in that order, then the others sorted, so that every family is in the sample
    while tasks remain, and ``first`` (where the capability was LACKING) first when they do not."""
    families = [*first, *sorted({t.family for t in tasks} - set(first))]
    by_family = {f: [t for t in tasks if t.family == f] for f in families}
    out: list[Any] = []
    while len(out) < limit and any(by_family.values()):
        for family in families:
            if by_family[family] and len(out) < limit:
                out.append(by_family[family].pop(0))
    return out
