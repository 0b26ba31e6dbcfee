"""The rubric: weighted checks over a trajectory and its final state, with partial credit.

Contract:

* :func:`evaluate` scores one episode's :class:`Trace` against a spec's ``rubric`` block. Each
  check gets ``applicable`` (its ``when`` holds for this task), a ``score`` in [0, 1] (0/1, or the
  share of strings said for ``info_communicated`` with ``partial``), ``passed`` (score == 1) and a
  one-line ``detail``.
* ``reward = sum(weight * score) / sum(weight)`` over the applicable checks, in [0, 1]. When no
  check applies the reward is the ``fallback`` (the target's own reward), so a rubric never
  invents credit. ``decision`` is the same sum over the applicable checks that are not
  ``shaping``: what success is judged on (a shaping check moves the reward, never success).
* ``requires``: a check that names other checks scores 0 (detail "needs ...") unless each of them
  passes or does not apply, after its own gates (a check failed by a gate fails the checks that
  require it; checks that require each other pass together or not at all). A check that passes by
  absence (no violation, no forbidden call, no error, no needless question) thus pays only an
  episode that made the decision: an agent that refuses everything or ends at once earns nothing
  for the writes it never made.
* The agent's part: an episode that starts at a decision point opens with an expert prefix. The
  checks judge only what the agent did after it (calls from ``Trace.prefix_calls`` on, ``said``,
  ``violations`` and ``confirmations`` are the agent's own); the prefix's observations still
  ground arguments and its authentication still counts for ``ordering``.
* What the agent *said* is read through :func:`~trace_assets.envs.base.spoken_text`: tool
  output pasted into a message (verbatim, or any JSON object) tells the user nothing.
* Pure: it reads the trace and the task, never changes them, and runs nothing from the spec.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from trace_assets.envs.base import Task, spoken_text
from trace_assets.synthesize.spec import fill_text, selector_tools


@dataclass(frozen=True)
class CallRecord:
    """One tool call the agent made, as the episode saw it (malformed calls have name "")."""

    name: str
    arguments: Any
    ok: bool
    observation: str
    malformed: bool = False


@dataclass
class Trace:
    """What the rubric reads: calls in order (prefix included), the agent's texts to the user, the
    policy violations and confirmations of the agent's part, and the final state."""

    calls: list[CallRecord]
    said: list[str]
    violations: list[dict[str, str]]
    state_match: bool
    prefix_calls: int = 0
    """``calls[:prefix_calls]`` were made by the expert prefix, not by the agent."""
    confirmations: int = 0
    """Confirmation questions the user answered during the agent's part."""
    confirmations_after_write: int = 0
    """Those of them asked after the agent's first successful write."""
    confirmations_repeated: int = 0
    """Those of them asked right after the agent's previous reply, itself a confirmation question,
    was answered, with no successful write in between: asking again instead of acting on the answer."""
    asked: list[bool] = field(default_factory=list)
    """Per entry of ``said``: whether the user answered it as a confirmation question."""

    def agent_calls(self) -> list[tuple[int, CallRecord]]:
        return [(i, c) for i, c in enumerate(self.calls) if i >= self.prefix_calls]

    def spoken(self) -> list[str]:
        observations = [c.observation for c in self.calls]
        return [spoken_text(s, observations) for s in self.said]


@dataclass(frozen=True)
class CheckResult:
    id: str
    kind: str
    weight: float
    applicable: bool
    score: float
    passed: bool
    detail: str
    shaping: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RubricScore:
    reward: float
    checks: list[CheckResult] = field(default_factory=list)
    decision: float | None = None
    """The reward over the applicable checks that are not shaping (success is judged on it);
    None: the same as ``reward``."""

    def to_dicts(self) -> list[dict[str, Any]]:
        return [c.to_dict() for c in self.checks]


Groups = dict[str, frozenset[str]]


def _norm(value: Any) -> Any:
    if isinstance(value, str):
        return value.strip().casefold()
    if isinstance(value, list):
        return sorted((_norm(v) for v in value), key=repr)
    return value


def _grounded(value: Any, earlier: list[CallRecord]) -> bool:
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, (str, int, float)) and str(v) for v in values):
        return False
    observations = [c.observation for c in earlier if c.ok]
    # Match whole JSON values (or a bare id observation), so "W12" is not grounded by "W1234".
    return all(any(obs.strip() == str(v) or json.dumps(v) in obs for obs in observations) for v in values)


def _args_ok(call: CallRecord, constraints: dict[str, Any], index: int, calls: list[CallRecord], task: Task) -> bool:
    args = call.arguments if isinstance(call.arguments, dict) else {}
    for arg, rule in constraints.items():
        if arg not in args:
            return False
        value = args[arg]
        if "equals" in rule and value != rule["equals"]:
            return False
        if rule.get("gold"):
            gold = [a["arguments"].get(arg) for a in task.gold_actions if a["name"] == call.name and arg in a["arguments"]]
            if not any(_norm(value) == _norm(g) for g in gold):
                return False
        if rule.get("grounded") and not _grounded(value, calls[:index]):
            return False
    return True


def _matching(check: dict[str, Any], trace: Trace, task: Task, groups: Groups, ok_only: bool) -> list[int]:
    tools = selector_tools(check["tool"], groups)
    constraints = check.get("args") or {}
    return [i for i, c in trace.agent_calls()
            if c.name in tools and (c.ok or not ok_only) and _args_ok(c, constraints, i, trace.calls, task)]


def applies(check: dict[str, Any], task: Task, groups: Groups) -> bool:
    """Whether ``check``'s ``when`` holds for ``task`` (a start variant's ``when`` reads the same way)."""
    when = check.get("when") or {}
    gold = {a["name"] for a in task.gold_actions}
    if "gold_calls" in when and not gold & selector_tools(when["gold_calls"], groups):
        return False
    if "gold_avoids" in when and gold & selector_tools(when["gold_avoids"], groups):
        return False
    if "families" in when and task.family not in when["families"]:
        return False
    if "start" in when and task.meta.get("start", "main") not in when["start"]:
        return False
    return True


def text_slots(task: Task) -> dict[str, str]:
    intents = task.scenario.get("intents") or [{}]
    return {"first_name": task.scenario.get("first_name", ""), "order_id": intents[0].get("order_id") or "",
            "family": task.family}


def _score(check: dict[str, Any], trace: Trace, task: Task, groups: Groups) -> tuple[float, str]:
    kind = check["kind"]
    if kind == "required_call":
        hits = _matching(check, trace, task, groups, ok_only=check.get("ok_only", True))
        return (1.0, f"call #{hits[0]} matches") if hits else (0.0, f"no matching call of {check['tool']}")
    if kind == "forbidden_call":
        hits = _matching(check, trace, task, groups, ok_only=check.get("ok_only", False))
        return (0.0, f"forbidden call #{hits[0]} {trace.calls[hits[0]].name}") if hits else (1.0, "no forbidden call")
    if kind == "ordering":
        before, after = selector_tools(check["before"], groups), selector_tools(check["after"], groups)
        seen_before = False
        n_after = 0
        for i, call in enumerate(trace.calls):
            if call.name in after:
                n_after += 1
                if not seen_before:
                    return 0.0, f"call #{i} {call.name} came before any successful {check['before']}"
            if call.name in before and call.ok:
                seen_before = True
        if n_after == 0 and check.get("require_after"):
            return 0.0, f"no call of {check['after']}"
        return 1.0, f"{n_after} call(s) of {check['after']} in order"
    if kind == "final_state_match":
        return (1.0, "final state matches the gold replay") if trace.state_match else (0.0, "final state differs")
    if kind == "info_communicated":
        wanted = task.required_info if check.get("info", "required") == "required" else check["info"]
        wanted = [fill_text(w, text_slots(task)) for w in wanted]
        said = [s.lower() for s in trace.spoken()]
        missing = [w for w in wanted if not any(w.lower() in s for s in said)]
        if not wanted:
            return 1.0, "nothing to say"
        share = 1 - len(missing) / len(wanted)
        score = share if check.get("partial") else float(not missing)
        return score, ("said everything" if not missing else f"missing {missing}")
    if kind == "no_policy_violation":
        rules = check.get("rules")
        broken = [v for v in trace.violations if rules is None or v.get("rule") in rules]
        return (0.0, f"violated {broken[0].get('rule')}: {broken[0].get('detail', '')[:80]}") if broken else (1.0, "no violation")
    if kind == "no_tool_error":
        needles = [n.lower() for n in check.get("contains", [])]
        errors = [c.observation for _, c in trace.agent_calls() if c.observation.startswith("Error:")]
        bad = [e for e in errors if not needles or any(n in e.lower() for n in needles)]
        return (0.0, f"tool error: {bad[0][:80]}") if bad else (1.0, "no tool error")
    if kind == "asked_confirmation":
        if check.get("first_reply") and not (trace.asked and trace.asked[0]):
            first = trace.said[0][:80] if trace.said else "(no reply)"
            return 0.0, f"the first reply after the start was not a confirmation question: {first!r}"
        if trace.confirmations:
            return 1.0, f"the user answered {trace.confirmations} confirmation question(s)"
        wrote = [i for i, c in trace.agent_calls() if c.ok and c.name in groups["@write"]]
        if check.get("or_wrote") and wrote:
            return 1.0, f"no confirmation question, but write #{wrote[0]} was made"
        return 0.0, "the user was never asked to confirm"
    if kind == "no_confirmation_question":
        if check.get("repeated"):
            if trace.confirmations_repeated:
                return 0.0, (f"asked the user to confirm again {trace.confirmations_repeated} time(s) right after an answer, "
                             "instead of acting on it")
            return 1.0, "acted on every answer before asking again"
        if check.get("after_write"):
            if trace.confirmations_after_write:
                return 0.0, f"asked the user to confirm {trace.confirmations_after_write} time(s) after the write was made"
            return 1.0, "asked no confirmation question after the write"
        if trace.confirmations:
            return 0.0, f"asked the user to confirm {trace.confirmations} time(s) where there was nothing to confirm"
        return 1.0, "asked no confirmation question"
    if kind == "calls_satisfy":
        tools = selector_tools(check["tool"], groups)
        bad = [i for i, c in trace.agent_calls()
               if c.name in tools and not _args_ok(c, check["args"], i, trace.calls, task)]
        n = sum(1 for _, c in trace.agent_calls() if c.name in tools)
        return (0.0, f"call #{bad[0]} {trace.calls[bad[0]].name} breaks {sorted(check['args'])}") if bad else (
            1.0, f"{n} call(s) of {check['tool']} satisfy {sorted(check['args'])}")
    if kind == "replied":
        own = [s for s in trace.spoken() if s.strip()]
        return (1.0, "answered the user") if own else (0.0, "never told the user anything in its own words")
    raise ValueError(f"unknown check kind {kind!r}")  # fidelity rejects these before any episode


def evaluate(rubric: dict[str, Any], trace: Trace, task: Task, groups: Groups, *, fallback: float = 0.0) -> RubricScore:
    """Score ``trace`` (see the module docstring)."""
    results = []
    for i, check in enumerate(rubric["checks"]):
        cid = check.get("id") or f"{i}_{check['kind']}"
        weight, shaping = float(check["weight"]), bool(check.get("shaping"))
        if not applies(check, task, groups):
            results.append(CheckResult(cid, check["kind"], weight, False, 0.0, False, "not applicable to this task", shaping))
            continue
        score, detail = _score(check, trace, task, groups)
        results.append(CheckResult(cid, check["kind"], weight, True, score, score >= 1.0, detail, shaping))
    index = {r.id: i for i, r in enumerate(results)}
    gated = True
    while gated:  # to the fixed point: each round only turns scores to 0
        gated = False
        for i, check in enumerate(rubric["checks"]):
            unmet = [n for n in check.get("requires", ()) if results[index[n]].applicable and not results[index[n]].passed]
            if unmet and results[i].applicable and results[i].score > 0:
                results[i] = replace(results[i], score=0.0, passed=False,
                                     detail=f"needs {', '.join(unmet)} to pass (alone: {results[i].detail})")
                gated = True
    def weighted(rows: list[CheckResult]) -> float:
        total = sum(r.weight for r in rows)
        return min(1.0, max(0.0, sum(r.weight * r.score for r in rows) / total if total else fallback))

    applicable = [r for r in results if r.applicable]
    return RubricScore(reward=weighted(applicable), checks=results,
                       decision=weighted([r for r in applicable if not r.shaping]))
