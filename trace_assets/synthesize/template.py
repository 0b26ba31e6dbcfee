"""The offline default synthesizer: a deterministic EnvSpec per capability, no LLM.

``template_spec(capability, target_env, failed_trajectories=())`` returns a spec that is schema-valid,
fidelity-clean and gold-solvable for every capability of the Step-1 heuristic CATALOGUE; any other
name gets a generic spec (all families, balanced rubric). Choices:

* tools: all of the target's tools. The agent then sees exactly the target's tool list, so what it
  learns transfers; the capability is isolated by the families and the rubric, not by hiding tools.
* families: those where the capability is exercised, with base weights; failed trajectories that
  exhibit the capability (``info.family``, filtered by the capability's heuristic rule when there is
  one) raise their families' weights by up to 3x and add target families the template did not list.
* rubric: checks guarded by ``when`` so each one applies only to tasks where it is satisfiable (the
  gold replay reaches reward 1 on every family of the target).
* difficulty: a middle start for the calibrator.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterable
from typing import Any

from trace_assets.envs.base import Environment
from trace_assets.envs.splits import SYNTHETIC_SEED_BASE

TEMPLATE_VERSION = "v1"
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

# name -> (families with base weights, rubric checks, hint, difficulty, scenario)
_PLANS: dict[str, tuple[dict[str, float], list[dict[str, Any]], str, dict[str, Any], dict[str, Any]]] = {
    "authenticate_before_acting": (
        {"order_status": 1, "cancel_pending": 1, "return_delivered": 1, "modify_address": 1, "update_address_everywhere": 1},
        [_check("authenticated", "required_call", 3, tool="@auth"),
         _check("auth_first", "ordering", 3, before="@auth", after="@account"),
         _check("no_auth_violation", "no_policy_violation", 2, rules=["auth_before_action", "one_user"]),
         STATE],
        "Verify the user's identity with an authentication tool before you look up or change anything.",
        # The user must be asked: volunteering identity would skip half of the capability.
        {"hint_share": 0.25, "volunteer_identity": 0.0, "distractor_orders": 0, "family_bias": 0.0,
         "frozen": ["volunteer_identity"]},
        {"name_zip_share": 0.5, "decline_share": 0.0},
    ),
    "confirm_before_writing": (
        {"cancel_pending": 1, "cancel_declined": 2, "modify_address": 1, "return_delivered": 1, "exchange_delivered": 1},
        [_check("confirmed_writes", "no_policy_violation", 3, rules=["confirm_before_write"]),
         _check("final_state", "final_state_match", 3), INFO],
        "Before any change, state exactly what you will do and ask the user for an explicit yes.",
        {"hint_share": 0.25, "volunteer_identity": 0.5, "distractor_orders": 0, "family_bias": 0.0, "frozen": []},
        {"name_zip_share": None, "decline_share": 0.25},
    ),
    "ground_arguments": (
        {"return_delivered": 2, "exchange_delivered": 3, "modify_address": 1},
        [_write_call("return_items_grounded", "return_delivered_order_items", 3,
                     {"item_ids": {"grounded": True, "gold": True}, "payment_method_id": {"grounded": True}}),
         _write_call("exchange_items_grounded", "exchange_delivered_order_items", 3,
                     {"item_ids": {"grounded": True, "gold": True}, "new_item_ids": {"grounded": True, "gold": True},
                      "payment_method_id": {"grounded": True}}),
         _write_call("address_order_grounded", "modify_pending_order_address", 3, {"order_id": {"gold": True}}),
         _check("no_grounding_errors", "no_tool_error", 2, contains=GROUNDING_ERRORS),
         STATE],
        "Copy ids, item ids and payment methods exactly from earlier tool results; look them up when unsure.",
        {"hint_share": 0.25, "volunteer_identity": 0.5, "distractor_orders": 1, "family_bias": 0.0, "frozen": []},
        {"name_zip_share": None, "decline_share": 0.0},
    ),
    "complete_multistep_transactions": (
        {"update_address_everywhere": 1, "cancel_and_return": 1},
        [_write_call("user_address", "modify_user_address", 2, {"user_id": {"gold": True}}),
         _write_call("order_address", "modify_pending_order_address", 2, {"order_id": {"gold": True}}),
         _write_call("cancelled", "cancel_pending_order", 2, {"order_id": {"gold": True}}),
         _write_call("returned", "return_delivered_order_items", 2, {"order_id": {"gold": True}}),
         _check("final_state", "final_state_match", 3), INFO],
        "When a request has several parts, finish every write before you end the conversation.",
        {"hint_share": 0.25, "volunteer_identity": 0.5, "distractor_orders": 0, "family_bias": 0.0, "frozen": []},
        {"name_zip_share": None, "decline_share": 0.0},
    ),
    "execute_requested_action": (
        {"cancel_pending": 1, "modify_address": 1, "return_delivered": 1, "exchange_delivered": 1},
        [_write_call("cancelled", "cancel_pending_order", 3, {"order_id": {"gold": True}}),
         _write_call("address_changed", "modify_pending_order_address", 3, {"order_id": {"gold": True}}),
         _write_call("returned", "return_delivered_order_items", 3, {"order_id": {"gold": True}}),
         _write_call("exchanged", "exchange_delivered_order_items", 3, {"order_id": {"gold": True}}),
         STATE, INFO],
        "After the user confirms, call the tool that performs the change; do not only describe it.",
        {"hint_share": 0.25, "volunteer_identity": 0.5, "distractor_orders": 0, "family_bias": 0.0, "frozen": []},
        {"name_zip_share": None, "decline_share": 0.0},
    ),
    "communicate_results": (
        {"order_status": 2, "cancel_pending": 1, "return_delivered": 1, "exchange_delivered": 1, "cancel_forbidden": 1},
        [_check("told_user", "info_communicated", 4, info="required", partial=True),
         _check("final_state", "final_state_match", 1)],
        "Tell the user the concrete outcome: statuses, totals, refunds and price differences.",
        {"hint_share": 0.25, "volunteer_identity": 0.5, "distractor_orders": 0, "family_bias": 0.0, "frozen": []},
        {"name_zip_share": None, "decline_share": 0.0},
    ),
    "refuse_forbidden_actions": (
        # Allowed cancels stay in the mix so that refusing everything is not the optimum.
        {"cancel_forbidden": 3, "cancel_declined": 1, "cancel_pending": 1},
        [_check("no_forbidden_write", "forbidden_call", 3, tool="@write", when={"gold_avoids": "@write"}),
         _check("no_forbidden_attempt", "no_policy_violation", 2, rules=["status", "refund_method", "exchange"]),
         _write_call("allowed_cancel", "cancel_pending_order", 2, {"order_id": {"gold": True}}),
         _check("told_why", "info_communicated", 1, info="required"), STATE],
        "Check the order's status against the policy before acting, and refuse with the reason if it is not allowed.",
        {"hint_share": 0.25, "volunteer_identity": 0.5, "distractor_orders": 0, "family_bias": 0.0, "frozen": []},
        {"name_zip_share": None, "decline_share": 0.0},
    ),
    "well_formed_tool_calls": (
        {"order_status": 1, "cancel_pending": 1, "return_delivered": 1, "exchange_delivered": 1,
         "modify_address": 1, "update_address_everywhere": 1},
        [_check("well_formed", "no_tool_error", 3, contains=FORMAT_ERRORS),
         _check("authenticated", "required_call", 1, tool="@auth"),
         STATE, INFO],
        "Emit each tool call as one JSON object with a known tool name and exactly its schema's arguments.",
        {"hint_share": 0.25, "volunteer_identity": 0.5, "distractor_orders": 0, "family_bias": 0.0, "frozen": []},
        {"name_zip_share": None, "decline_share": 0.0},
    ),
}

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
    known = target_env.families()
    if name in _PLANS:
        base, checks, hint, difficulty, scenario = copy.deepcopy(_PLANS[name])
    else:
        base = {f: 1.0 for f in known}
        checks, hint = copy.deepcopy(_GENERIC_CHECKS), _GENERIC_HINT
        difficulty = {"hint_share": 0.25, "volunteer_identity": 0.5, "distractor_orders": 0, "family_bias": 0.0, "frozen": []}
        scenario = {"name_zip_share": None, "decline_share": 0.0}
    counts = _failure_families(failed_trajectories, name, known)
    total = sum(counts.values())
    weights = dict(base)
    for family in known:  # keep the target's order so the spec is canonical
        if counts[family]:
            weights[family] = round(weights.get(family, 1.0) * (1 + 2 * counts[family] / total), 4)
    families = [{"name": f, "weight": float(weights[f])} for f in known if f in weights]
    for check in checks:  # a `when.families` guard may only name listed families
        if "families" in check.get("when", {}):
            check["when"]["families"] = [f for f in check["when"]["families"] if f in weights]
    return {
        "schema_version": "1",
        "capability": {"name": name, "description": capability.get("description", name),
                       "failure_modes": sorted(capability.get("failure_modes", []))},
        "target": {"env": target_env.name, "tools": [s["function"]["name"] for s in target_env.tool_schemas()]},
        "policy": "inherit",
        "tasks": {"families": families, "seed_range": list(SEED_RANGE), "scenario": scenario},
        "rubric": {"success_threshold": 1.0, "checks": checks},
        "hint": hint,
        "difficulty": difficulty,
        "notes": f"template synthesizer {TEMPLATE_VERSION}; failure families: {dict(sorted(counts.items()))}",
    }
