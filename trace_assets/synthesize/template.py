"""The offline default synthesizer: a deterministic EnvSpec per capability, no LLM.

``template_spec(capability, target_env, failed_trajectories=())`` returns a spec that is schema-valid,
fidelity-clean and gold-solvable for every capability of the Step-1 heuristic CATALOGUE; any other
name gets a generic spec (all families, whole episodes, an all-or-nothing rubric). Choices:

* start and end (schema v2): each catalogue capability's episodes start at its decision point (the
  target's expert plays the conversation up to the move where the capability decides the outcome:
  authenticate, propose, look up variants, carry on with the second request, write, report) and end
  right after that decision, so an episode is a few agent turns and its reward is attributable
  (confirm_before_writing's end one reply later, so that asking again once the write is made fails).

* tools: all of the target's tools. The agent then sees exactly the target's tool list, so what it
  learns transfers; the capability is isolated by the families and the rubric, not by hiding tools.
* families: those where the capability is exercised, with base weights; failed trajectories that
  exhibit the capability (``info.family``, filtered by the capability's heuristic rule when there is
  one) raise their families' weights by up to 3x; only the generic spec gains families from them (a
  plan's families are the ones where its decision point exists and isolation holds).
* contrast episodes: confirm_before_writing also starts where an answer is due and nothing is to be
  confirmed (order_status), so a policy that asks before everything is not rewarded.
* rubric: checks that judge only the decision (an expert lacking another capability passes them),
  guarded by ``when`` so each one applies only to tasks where it is satisfiable (the expert reaches
  reward 1 on every family). A check that passes by absence (no violation, no forbidden write, no
  needless question, no tool error, every call well formed) ``requires`` the check that the episode
  made the decision (asked, answered, wrote, looked up, called): otherwise an agent that refuses
  everything or ends at once scored 0.69 on E_confirm_before_writing without one success.
* difficulty: a middle start for the calibrator.

Those plans are the retail target's. A target whose tasks are a fixed list (``official_splits``,
e.g. ``tau2_airline``) gets plans derived from its official train tasks instead (see
:func:`_task_list_plans`: confirm, execute, carry on to the next write, communicate); every other
capability there gets the generic spec, whose isolation can only be measured the weaker way (the
gold-replay expert has no ablation for it: ``envs.tau2.NO_ABLATION``).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from trace_assets.envs.base import Environment, target_hook
from trace_assets.envs.splits import SYNTHETIC_SEED_BASE
from trace_assets.synthesize.spec import DEFAULT_DIFFICULTY, SCHEMA_VERSION, fixed_knobs, tool_groups

TEMPLATE_VERSION = "v12"
"""Bump when the plans below change: part of the synthesizer's code version."""
SEED_RANGE = [SYNTHETIC_SEED_BASE, SYNTHETIC_SEED_BASE + 1_000_000]
FORMAT_ERRORS = ["malformed tool call", "unknown tool", "missing argument", "unexpected argument", "must be"]
GROUNDING_ERRORS = ["not found", "not in order", "not a variant", "not the user's", "not available", "same item"]


def _check(cid: str, kind: str, weight: float, **fields: Any) -> dict[str, Any]:
    return {"id": cid, "kind": kind, "weight": weight, **fields}


def _write_call(cid: str, tool: str, weight: float, args: dict[str, Any]) -> dict[str, Any]:
    return _check(cid, "required_call", weight, tool=tool, args=args, when={"gold_calls": tool})


STATE = _check("final_state", "final_state_match", 2)
INFO = _check("told_user", "info_communicated", 1, info="required")
AUTH_FIRST = _check("auth_first", "ordering", 2, before="@auth", after="@account")
MIDDLE = {"hint_share": 0.25, "volunteer_identity": 0.5, "distractor_orders": 0, "family_bias": 0.0, "frozen": []}
TARGET_SCENARIO = {"name_zip_share": None, "decline_share": 0.0}
CONFIRMING_FAMILIES = ("cancel_pending", "cancel_declined", "modify_address", "return_delivered", "exchange_delivered",
                       "update_address_everywhere", "cancel_and_return")
"""Retail families whose first request the expert proposes and has confirmed (a write, or a declined one)."""
ANSWERED_SHARE = 0.4
"""confirm_before_writing: the share of the tasks with a write that open right after the user's yes."""


@dataclass(frozen=True)
class Plan:
    """One capability's environment: where episodes start and end, what is scored, and the knobs."""

    families: dict[str, float]
    start: dict[str, Any]
    end: dict[str, Any]
    checks: list[dict[str, Any]]
    hint: str
    difficulty: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(MIDDLE))
    scenario: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(TARGET_SCENARIO))


# Every plan starts at the move where its capability decides the outcome (the expert played the
# conversation so far), ends soon after it, and scores only that decision: an expert lacking only
# another capability passes it (validate.isolation_matrix measures exactly that).
_PLANS: dict[str, Plan] = {
    "authenticate_before_acting": Plan(
        {"order_status": 1, "cancel_pending": 1, "return_delivered": 1, "modify_address": 1, "update_address_everywhere": 1},
        {"before": ["authenticate"]},
        {"after_call": "@account", "max_actions": 3},
        [_check("auth_first", "ordering", 3, before="@auth", after="@account", require_after=True),
         _check("authenticated", "required_call", 2, tool="@auth")],
        "Verify the user's identity with an authentication tool before you look up or change anything.",
        {**MIDDLE, "volunteer_identity": 0.0, "frozen": ["volunteer_identity"]},
        {"name_zip_share": 0.5, "decline_share": 0.0},
    ),
    # Contrast episodes: order_status starts where the answer is due and nothing is to be
    # confirmed, so asking there fails, and so does refusing or answering without the status;
    # without them the rubric rewarded asking at every decision point it showed, and an adapter
    # learned "ask" rather than "ask before writing". The answer check is communicate_results'
    # too: its ablated expert fails these episodes (isolation success 7/8 families, bound 0.8).
    # The two-request families start at their first request: on the retail train split, 8 of the
    # 13 base-agent failures that confirmed_writes alone explains are there, and their first write
    # (modify_user_address, a cancel) is one no other family shows. Episodes end after the reply
    # that follows the write, and a question there fails: an adapter trained on episodes that ended
    # at the write asked "Do you confirm?" after every write on the target, the simulated user said
    # yes, and it wrote again (retail train split, state_match 20/42 -> 13/42 on the LACKING families).
    # "asked" wants the agent's first reply to be the question: paid for a question anywhere, an
    # adapter first reported changes it never made ("Order W4618 will be cancelled... Anything
    # else?"), asked only when the user restated, and lost the write (retail train split, v6 seed 0:
    # state_match 20/42 -> 12/42).
    # An answer is to be acted on (acted_on_answer): trained only through its first reply
    # (train_through, v8), an adapter asked "Do you confirm?" again after 222 of its 258 replies
    # that followed a yes on the target (retail train split, seed 0 at lr 1e-4: state_match 20/42
    # -> 11/42), and this rubric had paid that fully: the ask_without_acting adversary, which does
    # only that, scored 1.0 on every family. Now it fails, and the expert lacking
    # execute_requested_action ("noted", no write) still passes. The turns after the yes are judged,
    # so they are trained again: only their loss can teach the contrast.
    # Answered episodes (v10): a share of the tasks with a write open right after the user's yes.
    # At lr 3e-4 an adapter learned to ask first on the target (39/42 of the retail train tasks of
    # the LACKING families, base 8) and asked again right after the yes on 15/36 (base 0): it saw the
    # turn after a yes only in the episodes where it had asked, few at the start, so "ask" spread
    # past the decision faster than acted_on_answer pulled it back. There, a question is asked twice
    # and the write is due (acted), so acting is trained from the first iteration; refusing, "noted"
    # and asking again earn nothing.
    # Asking pays only with the answer acted on (v11: asked requires acted_on_answer). Before, asking
    # and then asking again after the yes earned 2/9 and not asking 0, so every group where one
    # sample asked twice and another not at all pushed "ask" on the turn after the yes too: the
    # three v10 adapters (lr 1e-3) asked first in 15-20 of the 25 main-start episodes of 48
    # train-side validation seeds (base 2), and wrote in 0-1 of the 11 answered ones (base 9). Now
    # asking twice earns what not asking does; only asking once and acting on the answer is paid.
    # It closes that gaming, but it did not make the adapters learn (3 seeds, 48 held-out seeds:
    # mean gain +0.028, v10 +0.014): they still stop calling tools on the target
    # (docs/transfer/train_target_v11_*_transcripts.json).
    # Why they stop (v12): on a main start nothing paid the write itself, so asking and then only
    # saying "done" earned 1.0, and a direct write (the base's move) earned what silence did, 0,
    # so every group taught "no tool call". On 48 train-side validation seeds the v11 seed-0
    # adapter succeeded on 7 of the 15 main-start tasks with a write and wrote on none of them
    # (docs/transfer/validation_v11_lr1e-3_seed0_transcripts.json). "wrote" now pays that write as
    # shaping: in the reward (ask and write 1.0 > ask only 0.82 > write only 0.18 > neither 0), not
    # in success, since making the write is execute_requested_action's decision and the expert
    # lacking it must still pass here (isolation).
    "confirm_before_writing": Plan(
        {"cancel_pending": 1, "cancel_declined": 2, "modify_address": 1, "return_delivered": 1, "exchange_delivered": 1,
         "update_address_everywhere": 1, "cancel_and_return": 1, "order_status": 2},
        {"before": ["propose", "write", "report"], "intent": 0,
         "variants": [{"id": "answered", "before": ["write"], "intent": 0, "share": ANSWERED_SHARE,
                       "when": {"families": list(CONFIRMING_FAMILIES), "gold_calls": "@write"}}]},
        {"after_call": "@write", "then_reply": True, "max_actions": 5},
        [_check("confirmed_writes", "no_policy_violation", 3, rules=["confirm_before_write"],
                requires=["asked", "answered", "acted_on_answer", "acted"]),
         _check("asked", "asked_confirmation", 2, first_reply=True,
                when={"families": list(CONFIRMING_FAMILIES), "start": ["main"]}, requires=["acted_on_answer"]),
         _check("done_asking", "no_confirmation_question", 2, after_write=True, when={"gold_calls": "@write"},
                requires=["asked", "acted_on_answer", "acted"]),
         _check("acted_on_answer", "no_confirmation_question", 2, repeated=True,
                when={"families": list(CONFIRMING_FAMILIES)}, requires=["asked", "acted"]),
         _check("acted", "required_call", 3, tool="@write", when={"start": ["answered"]}),
         _check("wrote", "required_call", 2, tool="@write", shaping=True,
                when={"gold_calls": "@write", "start": ["main"]}),
         _check("respected_no", "forbidden_call", 2, tool="@write", when={"gold_avoids": "@write"},
                requires=["asked", "answered"]),
         _check("nothing_to_confirm", "no_confirmation_question", 2, when={"families": ["order_status"]},
                requires=["answered"]),
         _check("answered", "info_communicated", 1, info="required", when={"families": ["order_status"]})],
        "Before any change, state exactly what you will do and ask the user for an explicit yes.",
        scenario={"name_zip_share": None, "decline_share": 0.25},
    ),
    "ground_arguments": Plan(
        {"exchange_delivered": 1},
        {"before": ["lookup"], "intent": 0, "tool": "get_product_details"},
        {"after_call": "@write", "max_actions": 5},
        [_check("variants_looked_up", "required_call", 2, tool="get_product_details",
                args={"product_id": {"grounded": True, "gold": True}}),
         _check("exchange_grounded", "calls_satisfy", 2, tool="exchange_delivered_order_items",
                args={"item_ids": {"grounded": True, "gold": True}, "new_item_ids": {"grounded": True, "gold": True},
                      "payment_method_id": {"grounded": True}}, requires=["variants_looked_up"]),
         _check("no_grounding_errors", "no_tool_error", 1, contains=GROUNDING_ERRORS, requires=["variants_looked_up"])],
        "Copy ids, item ids and payment methods exactly from earlier tool results; look them up when unsure.",
        {**MIDDLE, "distractor_orders": 1},
    ),
    "complete_multistep_transactions": Plan(
        {"update_address_everywhere": 1, "cancel_and_return": 1},
        {"before": ["lookup", "propose", "write", "report"], "intent": 1},
        {"after_call": "@write", "max_actions": 5},
        [_check("continued", "required_call", 2, tool="get_order_details", args={"order_id": {"gold": True}}),
         _check("second_write_right", "calls_satisfy", 1, tool="@write", args={"order_id": {"gold": True}},
                requires=["continued"])],
        "When a request has several parts, carry on with the next part until every write is done.",
    ),
    "execute_requested_action": Plan(
        {"cancel_pending": 1, "modify_address": 1, "return_delivered": 1},
        {"before": ["write"], "intent": 0},
        {"after_call": "@write", "ok_only": True, "max_actions": 3},
        [_check("performed", "required_call", 3, tool="@write", args={"order_id": {"gold": True}}),
         _check("confirmed_writes", "no_policy_violation", 1, rules=["confirm_before_write"], requires=["performed"])],
        "After the user confirms, call the tool that performs the change; do not only describe it.",
    ),
    "communicate_results": Plan(
        {"order_status": 2, "cancel_pending": 1, "return_delivered": 1, "exchange_delivered": 1},
        {"before": ["report"], "intent": 0},
        {"after_reply": True, "max_actions": 3},
        [_check("told_user", "info_communicated", 3, info="required", partial=True)],
        "Tell the user the concrete outcome in your own words: statuses, totals, refunds and price differences.",
    ),
    "refuse_forbidden_actions": Plan(
        # Allowed cancels stay in the mix, so that refusing everything is not the optimum.
        {"cancel_forbidden": 1, "cancel_pending": 1},
        {"before": ["propose", "write", "report"], "intent": 0},
        {"after_call": "@write", "max_actions": 3},
        [_check("no_forbidden_attempt", "no_policy_violation", 3, rules=["status", "refund_method", "exchange"],
                requires=["allowed_handled", "replied"]),
         _check("no_forbidden_write", "forbidden_call", 2, tool="@write", when={"gold_avoids": "@write"},
                requires=["replied"]),
         _check("allowed_handled", "asked_confirmation", 2, or_wrote=True, when={"gold_calls": "@write"}),
         _check("replied", "replied", 1, when={"gold_avoids": "@write"})],
        "Check the order's status against the policy before acting, and refuse with the reason if it is not allowed.",
    ),
    "well_formed_tool_calls": Plan(
        {"order_status": 1, "cancel_pending": 1, "return_delivered": 1, "exchange_delivered": 1,
         "modify_address": 1, "update_address_everywhere": 1},
        {"before": ["lookup"], "intent": 0},
        {"after_call": "@any", "ok_only": True, "max_actions": 2},
        [_check("well_formed", "no_tool_error", 3, contains=FORMAT_ERRORS, requires=["called"]),
         _check("called", "required_call", 1, tool="@read", ok_only=False)],
        "Emit each tool call as one JSON object with a known tool name and exactly its schema's arguments.",
    ),
}

# A target whose tasks are a fixed list (``official_splits``: tau2-bench's airline) has no task
# generator to aim at a decision point, so its plans are derived from its official train tasks: a
# plan lists the families where its decision point exists in every train task (a gold write; a
# second gold write), and the communicate plan weights families by their share of tasks with
# something to tell (the others score "nothing to say"; isolation counts only where the ablation
# acts). Knobs the target does not interpret (``synthesis_knobs``) are frozen at their defaults.
_TASK_LIST_HINTS = {
    "confirm_before_writing": _PLANS["confirm_before_writing"].hint,
    "execute_requested_action": _PLANS["execute_requested_action"].hint,
    "complete_multistep_transactions": "When the user wants several changes, propose and make the next one "
                                       "instead of closing the conversation.",
    "communicate_results": "Tell the user the concrete outcome in your own words: amounts, refunds and other numbers.",
}


def _task_list_difficulty(target_env: Environment) -> dict[str, Any]:
    """The middle start, with the knobs the target does not interpret at their defaults, frozen."""
    fixed = sorted(fixed_knobs(target_env))
    return {**MIDDLE, **{k: DEFAULT_DIFFICULTY[k] for k in fixed}, "frozen": fixed}


def _task_list_plans(target_env: Environment) -> dict[str, Plan]:
    train = target_env.official_splits()["train"]
    writes = target_hook(target_env, "tool_classes")()["write"]
    by_family: dict[str, list[Any]] = {}
    for task in train:
        by_family.setdefault(task.family, []).append(task)
    n_writes = lambda t: sum(a["name"] in writes for a in t.gold_actions)  # noqa: E731
    writing = {f: 1.0 for f, ts in by_family.items() if all(n_writes(t) >= 1 for t in ts)}
    several = {f: 1.0 for f, ts in by_family.items() if all(n_writes(t) >= 2 for t in ts)}
    telling = {f: round(sum(bool(t.required_info) for t in ts) / len(ts), 4) for f, ts in by_family.items()}
    telling = {f: w for f, w in telling.items() if w > 0}
    difficulty = _task_list_difficulty(target_env)
    plans = {}
    if writing:
        plans["confirm_before_writing"] = Plan(
            writing, {"before": ["propose", "write"], "intent": 0}, {"after_call": "@write", "max_actions": 4},
            [_check("confirmed_writes", "no_policy_violation", 3, rules=["confirm_before_write"], requires=["asked"]),
             _check("asked", "asked_confirmation", 2)], _TASK_LIST_HINTS["confirm_before_writing"], difficulty)
        plans["execute_requested_action"] = Plan(
            writing, {"before": ["write"], "intent": 0}, {"after_call": "@write", "ok_only": True, "max_actions": 3},
            [_check("performed", "required_call", 3, tool="@write"),
             _check("confirmed_writes", "no_policy_violation", 1, rules=["confirm_before_write"], requires=["performed"])],
            _TASK_LIST_HINTS["execute_requested_action"], difficulty)
    if several:  # carrying on: proposing the next write (or making it) rather than closing
        plans["complete_multistep_transactions"] = Plan(
            several, {"before": ["propose", "write"], "intent": 1}, {"after_call": "@write", "max_actions": 3},
            [_check("continued", "asked_confirmation", 2, or_wrote=True)],
            _TASK_LIST_HINTS["complete_multistep_transactions"], difficulty)
    if telling:
        plans["communicate_results"] = Plan(
            telling, {"before": ["report"]}, {"after_reply": True, "max_actions": 3},
            [_check("told_user", "info_communicated", 3, info="required", partial=True)],
            _TASK_LIST_HINTS["communicate_results"], difficulty)
    return plans


# A whole episode needs every capability, so any partial credit pays an agent that gets all but
# one thing right: the echo agent earned 0.83 and the write-without-asking agent 0.67 on episodes
# they failed. The checks require each other (all or nothing) and stay apart only in ``info``.
_GENERIC_CHECKS = [STATE, INFO, AUTH_FIRST, _check("no_violation", "no_policy_violation", 1)]
_GENERIC_HINT = "Follow the policy step by step: authenticate, look up, confirm, act, and report the outcome."


def _failure_families(failed: Iterable[dict[str, Any]], capability: str, known: list[str]) -> Counter[str]:
    from trace_assets.identify.heuristic import RULES

    rule = RULES.get(capability)
    counts: Counter[str] = Counter()
    for trajectory in failed:
        info = trajectory.get("info") or {}
        family = info.get("family")
        if family not in known:
            continue
        if rule is not None and rule.judge(info)[0] != "LACKING":
            continue  # the trajectory failed for another reason
        counts[family] += 1
    return counts


def template_spec(capability: dict[str, Any], target_env: Environment, *,
                  failed_trajectories: Iterable[dict[str, Any]] = ()) -> dict[str, Any]:
    """A valid EnvSpec for ``capability`` ({name, description, failure_modes}) on ``target_env``."""
    name = capability["name"]
    task_list = getattr(target_env, "official_splits", None) is not None
    if task_list:  # synthetic tasks come from the official train tasks only
        known = [f for f in target_env.families() if any(t.family == f for t in target_env.official_splits()["train"])]
        plans = _task_list_plans(target_env)
    else:
        known, plans = target_env.families(), _PLANS
    plan = copy.deepcopy(plans.get(name))
    if plan is not None:
        base, checks, hint, difficulty, scenario = plan.families, plan.checks, plan.hint, plan.difficulty, plan.scenario
    else:  # no decision point known: the whole target episode, an all-or-nothing rubric
        base = {f: 1.0 for f in known}
        checks, hint = copy.deepcopy(_GENERIC_CHECKS), _GENERIC_HINT
        if not tool_groups(target_env)["@account"]:  # nothing needs authentication: ordering could not fail
            checks = [c for c in checks if c["id"] != AUTH_FIRST["id"]]
        for check in checks:
            check["requires"] = [c["id"] for c in checks if c is not check]
        difficulty = _task_list_difficulty(target_env) if task_list else copy.deepcopy(MIDDLE)
        scenario = copy.deepcopy(TARGET_SCENARIO)
    counts = _failure_families(failed_trajectories, name, known)
    total = sum(counts.values())
    weights = dict(base)
    for family in known:  # keep the target's order so the spec is canonical
        # A plan's families are those where its decision point exists and isolation holds, so
        # failures only reweight them; the generic spec may gain families.
        if counts[family] and (plan is None or family in base):
            weights[family] = round(weights.get(family, 1.0) * (1 + 2 * counts[family] / total), 4)
    families = [{"name": f, "weight": float(weights[f])} for f in known if f in weights]
    for check in checks + (plan.start.get("variants", []) if plan is not None else []):
        if "families" in check.get("when", {}):  # a `when.families` guard may only name listed families
            check["when"]["families"] = [f for f in check["when"]["families"] if f in weights]
    spec = {
        "schema_version": SCHEMA_VERSION,
        "capability": {"name": name, "description": capability.get("description", name),
                       "failure_modes": sorted(capability.get("failure_modes", []))},
        "target": {"env": target_env.name, "tools": [s["function"]["name"] for s in target_env.tool_schemas()]},
        "policy": "inherit",
        "tasks": {"families": families, "seed_range": list(SEED_RANGE), "scenario": scenario},
        **({"start": plan.start, "end": plan.end} if plan is not None else {}),
        "rubric": {"success_threshold": 1.0, "checks": checks},
        "hint": hint,
        "difficulty": difficulty,
        "notes": f"template synthesizer {TEMPLATE_VERSION}; failure families: {dict(sorted(counts.items()))}",
    }
    return spec
