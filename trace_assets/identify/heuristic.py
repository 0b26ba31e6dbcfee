"""The offline, deterministic analyst: capabilities and labels from what the environment recorded.

It reads only a trajectory's ``info`` (the fields ``EpisodeResult`` documents: actions with ok
flags, tool errors, policy violations, authentication, confirmations, writes made and gold writes,
missing required info), never its success flag, so the contrast between D+ and D- is earned.

Each catalogue entry is a rule that returns NA, PRESENT or LACKING with a one-line rationale.
``induce`` keeps only what actually occurs in the data: a candidate enters the dictionary when it
is LACKING in at least one failed trajectory.

A LACKING label also names its step (``Label.step``, :func:`lacking_step`): the assistant turn of
the call that the evidence cites (the unconfirmed write, the failed call, the blocked call), found
in ``messages`` by its tool name, arguments and observation; for a detail never told, the first
reply after the tool result that held it; for a write never made or a transaction left
unfinished, the agent's last turn, where it ended instead; for "never authenticated" its first
turn. Where the evidence is not in the messages the step is None, and the trajectory gives no
decision point. Tested: on every ablated retail expert's LACKING trajectory, the full expert
taking over at the step solves the task (the cut is before the decisive mistake).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trace_assets.identify.capabilities import Capability, Label

Verdict = tuple[str, str]  # (label, rationale)

GROUNDING_ERRORS = ("not found", "not in order", "not a variant", "not the user's", "not available", "same item", "same length")
FORMAT_ERRORS = ("malformed tool call", "unknown tool", "missing argument", "unexpected argument", "must be a")


def _violations(info: dict[str, Any], rule: str) -> list[str]:
    return [v.get("detail", "") for v in info.get("policy_violations", []) if v.get("rule") == rule]


def _errors(info: dict[str, Any], needles: tuple[str, ...]) -> list[str]:
    return [e for e in info.get("tool_errors", []) if any(n in e.lower() for n in needles)]


def authenticate_before_acting(info: dict[str, Any]) -> Verdict:
    blocked = _violations(info, "auth_before_action")
    if blocked:
        return "LACKING", f"tried {blocked[0]} before authenticating the user"
    if not info.get("authenticated"):
        return "LACKING", "never authenticated the user"
    return "PRESENT", "authenticated the user before account actions"


def confirm_before_writing(info: dict[str, Any]) -> Verdict:
    unconfirmed = _violations(info, "confirm_before_write")
    if unconfirmed:
        return "LACKING", f"wrote without explicit confirmation: {unconfirmed[0][:80]}"
    if info.get("gold_writes") and not info.get("confirmations"):
        return "LACKING", "a write was needed but the user was never asked to confirm"
    if not info.get("n_writes") and not info.get("confirmations"):
        return "NA", "no write was made or discussed"
    return "PRESENT", "asked for explicit confirmation before writing"


def ground_arguments(info: dict[str, Any]) -> Verdict:
    if not info.get("actions"):
        return "NA", "made no tool calls"
    bad = _errors(info, GROUNDING_ERRORS)
    if bad:
        return "LACKING", f"used an argument not grounded in retrieved data: {bad[0][:80]}"
    return "PRESENT", "tool arguments matched retrieved data"


def complete_multistep_transactions(info: dict[str, Any]) -> Verdict:
    gold = Counter(info.get("gold_writes", []))
    if sum(gold.values()) < 2:
        return "NA", "the task needs fewer than two writes"
    done = Counter(a["name"] for a in info.get("actions", []) if a.get("ok") and a["name"] in gold)
    missing = gold - done
    if missing:
        return "LACKING", f"left the transaction unfinished: missing {', '.join(sorted(missing))}"
    return "PRESENT", "completed every write of the multi-step request"


def execute_requested_action(info: dict[str, Any]) -> Verdict:
    gold = info.get("gold_writes", [])
    if len(gold) != 1:
        return "NA", "the task does not need exactly one write"
    if any(a.get("ok") and a["name"] == gold[0] for a in info.get("actions", [])):
        return "PRESENT", f"performed the requested {gold[0]}"
    return "LACKING", f"never performed the requested {gold[0]}"


def communicate_results(info: dict[str, Any]) -> Verdict:
    missing = info.get("missing_info", [])
    if missing:
        return "LACKING", f"did not tell the user: {', '.join(missing)[:80]}"
    return "PRESENT", "told the user every required detail"


def refuse_forbidden_actions(info: dict[str, Any]) -> Verdict:
    refused = _violations(info, "status") + _violations(info, "refund_method") + _violations(info, "exchange")
    if refused:
        return "LACKING", f"attempted an action the policy forbids: {refused[0][:80]}"
    if info.get("gold_writes"):
        return "NA", "the request was allowed"
    if info.get("n_writes"):
        return "LACKING", "made a write although none was allowed or wanted"
    return "PRESENT", "made no write where none was allowed"


def well_formed_tool_calls(info: dict[str, Any]) -> Verdict:
    bad = _errors(info, FORMAT_ERRORS)
    if bad:
        return "LACKING", f"emitted an invalid tool call: {bad[0][:80]}"
    if not info.get("actions"):
        return "NA", "made no tool calls"
    return "PRESENT", "every tool call was well formed"


def _calls(messages: list[dict[str, Any]]) -> list[tuple[int, str | None, Any, str]]:
    """``(assistant turn, tool name, arguments, observation)`` of every call, in order; an unparseable
    call (a tool message that answers none of the turn's parsed calls) has name None."""
    out: list[tuple[int, str | None, Any, str]] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        calls = [c.get("function", c) for c in message.get("tool_calls") or []]
        j = i + 1
        while j < len(messages) and messages[j].get("role") == "tool":
            call = calls[j - i - 1] if j - i - 1 < len(calls) else None
            arguments = call.get("arguments") if call else None
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    pass
            out.append((i, call.get("name") if call else None, arguments, str(messages[j].get("content", ""))))
            j += 1
    return out


@dataclass(frozen=True)
class Evidence:
    """What a step locator reads: the trajectory's messages, its ``info``, every call
    (:func:`_calls`) and the indices of the assistant turns."""

    messages: list[dict[str, Any]]
    info: dict[str, Any]
    calls: list[tuple[int, str | None, Any, str]]
    turns: list[int]

    def observed(self, text: str) -> int | None:
        """The turn of the first call whose observation is ``text``."""
        return next((turn for turn, _, _, observation in self.calls if observation == text), None)

    def called(self, tool: str, ok: bool, arguments: Any = None) -> int | None:
        """The turn of the first call of ``tool`` that succeeded (``ok``) or failed, with ``arguments`` if given."""
        return next((turn for turn, t, a, observation in self.calls if t == tool and observation.startswith("Error") != ok
                     and (arguments is None or a == arguments)), None)


def _ended(e: Evidence) -> int | None:
    return e.turns[-1]  # an omission: the turn where the agent ended instead


def _step_authenticate(e: Evidence) -> int | None:
    blocked = _violations(e.info, "auth_before_action")
    return e.called(blocked[0], ok=False) if blocked else e.turns[0]


def _step_confirm(e: Evidence) -> int | None:
    unconfirmed = _violations(e.info, "confirm_before_write")
    if not unconfirmed:
        return _ended(e)  # the write was due and never proposed
    tool, _, arguments = unconfirmed[0].partition(" ")
    try:
        return e.called(tool, ok=True, arguments=json.loads(arguments))
    except json.JSONDecodeError:
        return e.called(tool, ok=True)


def _step_ground(e: Evidence) -> int | None:
    return e.observed(_errors(e.info, GROUNDING_ERRORS)[0])


def _step_communicate(e: Evidence) -> int | None:
    """The first reply after the result that held an untold detail."""
    missing = [m.lower() for m in e.info.get("missing_info", [])]
    seen = next((j for j, m in enumerate(e.messages) if m.get("role") == "tool"
                 and any(x in str(m.get("content", "")).lower() for x in missing)), None)
    if seen is None:
        return _ended(e)
    return next((i for i in e.turns if i > seen and not e.messages[i].get("tool_calls")), e.turns[-1])


def _step_refuse(e: Evidence) -> int | None:
    refused = _violations(e.info, "status") + _violations(e.info, "refund_method") + _violations(e.info, "exchange")
    if not refused:
        return None  # a write none was allowed; which call wrote is not recorded
    tool, _, message = refused[0].partition(": ")
    return e.observed(f"Error: {message}") if tool else None


def _step_well_formed(e: Evidence) -> int | None:
    return e.observed(_errors(e.info, FORMAT_ERRORS)[0])


def lacking_step(name: str, trajectory: dict[str, Any]) -> int | None:
    """The step of rule ``name``'s LACKING verdict on ``trajectory`` (module docstring), or None."""
    messages = trajectory.get("messages") or []
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns:
        return None
    return RULES[name].step(Evidence(messages, trajectory["info"], _calls(messages), turns))


@dataclass(frozen=True)
class Rule:
    name: str
    description: str
    judge: Callable[[dict[str, Any]], Verdict]
    step: Callable[[Evidence], int | None]
    """Where a LACKING verdict's evidence is (:func:`lacking_step`)."""


CATALOGUE: tuple[Rule, ...] = (
    Rule("authenticate_before_acting", "Verify the user's identity with an authentication tool before reading or changing any account data. The policy requires it and the tools refuse account actions until it is done.", authenticate_before_acting, _step_authenticate),
    Rule("confirm_before_writing", "Before any write, state the action and its details and obtain an explicit yes from the user. A 'no' means the write must not happen.", confirm_before_writing, _step_confirm),
    Rule("ground_arguments", "Use ids, items and payment methods exactly as retrieved from earlier tool results instead of guessing them. Wrong arguments make tools fail or change the wrong record.", ground_arguments, _step_ground),
    Rule("complete_multistep_transactions", "Carry a request that needs several dependent writes through to the last write. Each write must use the results of the previous steps.", complete_multistep_transactions, _ended),
    Rule("execute_requested_action", "Once the user has confirmed, actually perform the requested write with the right tool instead of only talking about it.", execute_requested_action, _ended),
    Rule("communicate_results", "Tell the user the concrete outcome: amounts, statuses and other details the task requires. An action the user never hears about does not solve the task.", communicate_results, _step_communicate),
    Rule("refuse_forbidden_actions", "Recognise requests the policy forbids (wrong order status, wrong refund method) and refuse with the reason instead of attempting them.", refuse_forbidden_actions, _step_refuse),
    Rule("well_formed_tool_calls", "Emit tool calls as valid JSON with a known tool name and exactly the schema's arguments. Malformed calls waste turns and derail the conversation.", well_formed_tool_calls, _step_well_formed),
)
RULES = {rule.name: rule for rule in CATALOGUE}


class HeuristicAnalyst:
    """Deterministic analyst: one labelling run (N = K = 1), no LLM."""

    name = "heuristic"
    deterministic = True

    def __init__(self) -> None:
        self.calls = 0

    def induce(self, d_plus: list[dict[str, Any]], d_minus: list[dict[str, Any]]) -> list[Capability]:
        """Candidates that are LACKING in at least one failure, with observed failure modes."""
        self.calls += 1
        out = []
        for rule in CATALOGUE:
            lacking = [(t["trajectory_id"], rule.judge(t["info"])) for t in d_minus]
            lacking = [(tid, why) for tid, (label, why) in lacking if label == "LACKING"]
            if not lacking:
                continue
            modes = [why for why, _ in Counter(why.split(":")[0] for _, why in lacking).most_common(3)]
            out.append(Capability(
                name=rule.name, description=rule.description, failure_modes=modes,
                example_trajectory_ids=sorted(tid for tid, _ in lacking)[:5],
            ))
        return out

    def label(self, trajectory: dict[str, Any], capabilities: list[Capability], run: int) -> list[Label]:
        """Labels of one trajectory for every capability (unknown capabilities get NA)."""
        self.calls += 1
        labels = []
        for cap in capabilities:
            rule = RULES.get(cap.name)
            label, why = rule.judge(trajectory["info"]) if rule else ("NA", "no heuristic rule for this capability")
            step = lacking_step(cap.name, trajectory) if label == "LACKING" else None
            labels.append(Label(trajectory["trajectory_id"], cap.name, run, label, why, step))
        return labels
