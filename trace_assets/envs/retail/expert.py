"""The scripted retail expert, its ablations, and adversarial scripted agents.

The expert is a *reactive* policy: :func:`next_move` reads the conversation so far (OpenAI chat
messages) and the task, and returns the next :class:`Move` (one plain message or one tool call), or
None when it has nothing more to do. Because it derives its progress from the messages, it can take
over any conversation that an expert started: a synthetic environment plays the full expert up to a
decision point (see ``synthesize.env``) and hands the rest to the agent, or to an ablated expert.

The full expert asks for identity, authenticates, looks up what each intent needs, states the action
details (with the amounts the task requires) and asks "Do you confirm? (yes/no)", writes only after
a yes, reports the outcome and ends when the user is done. Move kinds (:data:`MOVE_KINDS`):
``ask_identity``, ``authenticate``, ``lookup``, ``propose``, ``write``, ``report`` (every closing
message of an intent: an outcome, a read-only answer, a refusal, an acknowledged no).

``lacking=c`` removes exactly one heuristic capability c (:data:`ABLATIONS` says how), so that a
synthetic environment for c can be checked against an expert that fails c and experts that fail
only something else. ``confirm=False`` is the older spelling of ``lacking="confirm_before_writing"``
(warm-start variety).

:data:`ADVERSARIES` are crude scripted agents that try to game a reward: echo every tool result,
write without asking, ask again instead of acting on the answer, refuse everything, end at once.

``demonstrate(env, task, ...)`` plays a policy through ``env.start(task)`` (continuing whatever
prefix the episode opens with) and returns the messages and the episode's result. The full expert
raises ``RuntimeError`` when one of its own calls fails (an unsolvable spec); ablations and
adversaries never raise on tool errors.

Messages are OpenAI chat format; tool-call arguments are dicts (HF convention) and an assistant
message that only calls a tool has content "". Assistant texts stay one or two sentences, since a
small model imitates them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from ..base import EpisodeResult, Message, Task
from ..expert import GENERIC_ADVERSARIES, MOVE_KINDS, Call, Conversation, Move, Policy, play, play_move
from .db import money
from .tasks import describe_address
from .tools import AUTH_TOOLS, WRITE_TOOLS
from .user import NO, YES

ASK_IDENTITY = "I can help with that. Please give me your email, or your name and zip code, to verify your identity."
ASK_CONFIRM = "Do you confirm? (yes/no)"
ANYTHING_ELSE = "Anything else I can help with?"
GIVE_UP = "Sorry, I could not complete that."
GOODBYE = "I have handled your first request. Goodbye."
__all__ = ["ABLATIONS", "ADVERSARIES", "MOVE_KINDS", "Move", "demonstrate", "next_move", "play_move"]

ABLATIONS: dict[str, str] = {
    "authenticate_before_acting": "never asks for identity or authenticates; goes straight to the lookups",
    "confirm_before_writing": "never asks for confirmation; writes right after the lookups",
    "ground_arguments": "never looks up product variants; exchanges for an id it guessed (the product id)",
    "complete_multistep_transactions": "stops after the first intent that needed a write (says goodbye)",
    "execute_requested_action": "proposes and gets a yes, then only says the request is noted; never writes",
    "communicate_results": "proposes and reports without the amounts or statuses",
    "refuse_forbidden_actions": "proposes a forbidden cancellation and attempts it after a yes",
    "well_formed_tool_calls": "the first attempt of every tool call carries an unexpected argument; then retries",
}
"""One ablation per heuristic capability (``identify.heuristic.CATALOGUE``): what the expert stops doing."""
MALFORMED_ARGUMENT = "note"


# ---- texts -----------------------------------------------------------------------------------


def _amount(text: str) -> float:
    return float(text.replace("$", ""))


def _item(order: dict[str, Any], item_id: str) -> dict[str, Any]:
    return next(item for item in order["items"] if item["item_id"] == item_id)


def _write_for(intent: dict[str, Any], actions: list[dict[str, Any]]) -> dict[str, Any]:
    """The intent's write: from the gold actions, or rebuilt when the gold has none (a declined cancel)."""
    for action in actions:
        if action["name"] in WRITE_TOOLS:
            return action
    return {"name": "cancel_pending_order", "arguments": {"order_id": intent["order_id"], "reason": intent.get("reason", "no longer needed")}}


def _proposal(write: dict[str, Any], seen: dict[str, Any]) -> str:
    args = write["arguments"]
    order = seen.get("get_order_details", {})
    if write["name"] == "cancel_pending_order":
        return (f"Order {args['order_id']} will be cancelled ({args['reason']}) and {order['total']} "
                f"refunded to {order['payment_method_id']}.")
    if write["name"] == "return_delivered_order_items":
        item = _item(order, args["item_ids"][0])
        return (f"I will return the {item['name']} ({item['item_id']}) from order {args['order_id']} "
                f"and refund {item['price']} to {args['payment_method_id']}.")
    if write["name"] == "exchange_delivered_order_items":
        old = _item(order, args["item_ids"][0])
        new = next(v for v in seen["get_product_details"]["variants"] if v["item_id"] == args["new_item_ids"][0])
        diff = round(_amount(new["price"]) - _amount(old["price"]), 2)
        options = ", ".join(new["options"].values())
        pay = (f"you pay {money(diff)} more with" if diff >= 0 else f"you get {money(-diff)} back to")
        return (f"I will exchange the {old['name']} ({old['item_id']}) in order {args['order_id']} for "
                f"{new['item_id']} ({options}); {pay} {args['payment_method_id']}.")
    address = describe_address(args)
    if write["name"] == "modify_pending_order_address":
        return f"I will change the shipping address of order {args['order_id']} to {address}."
    return f"I will update your account address to {address}."


def _bare_proposal(write: dict[str, Any]) -> str:
    """A proposal without amounts (the communicate_results and ground_arguments ablations)."""
    args = write["arguments"]
    what = {"cancel_pending_order": "cancel", "return_delivered_order_items": "return the item from",
            "exchange_delivered_order_items": "exchange the item in", "modify_pending_order_address": "change the address of"}
    if write["name"] == "modify_user_address":
        return "I will update your account address."
    return f"I will {what[write['name']]} order {args['order_id']}."


def _report(write: dict[str, Any], out: dict[str, Any]) -> str:
    name = write["name"]
    if name == "cancel_pending_order":
        return f"Order {out['order_id']} is cancelled; {out['refund']} will be refunded to {out['payment_method_id']}."
    if name == "return_delivered_order_items":
        return f"The return is requested; {out['refund']} will be refunded to {out['payment_method_id']}."
    if name == "exchange_delivered_order_items":
        if "charge" in out:
            return f"The exchange is requested; {out['charge']} will be charged to {out['payment_method_id']}."
        return f"The exchange is requested; {out['refund']} will be refunded to {out['payment_method_id']}."
    return f"Done, the address is now {describe_address(out['address'])}."


def _read_report(intent: dict[str, Any], seen: dict[str, Any]) -> str:
    order = seen["get_order_details"]
    if intent["kind"] == "cancel_forbidden":
        return (f"Sorry, order {order['order_id']} is {order['status']}, so I cannot cancel it. "
                f"Only pending orders can be cancelled.")
    text = f"Order {order['order_id']} is {order['status']} and its total was {order['total']}."
    if order.get("tracking_id"):
        text += f" Tracking id: {order['tracking_id']}."
    return text


# ---- reading the conversation ----------------------------------------------------------------


@dataclass
class _State(Conversation):
    """The conversation as the retail expert reads it (``envs.expert.Conversation``)."""

    @classmethod
    def read(cls, messages: list[Message]) -> "_State":
        seen = Conversation.read(messages)
        return cls(seen.calls, seen.texts, seen.users)

    def authenticated(self) -> bool:
        return any(c.ok and c.name in AUTH_TOOLS for _, c in self.calls)

    def closings(self) -> list[int]:
        """Message indexes of the texts that closed an intent."""
        return [i for i, t in self.texts if ANYTHING_ELSE in t or t == GOODBYE]


def _same(call: Call, action: dict[str, Any]) -> bool:
    return call.name == action["name"] and call.arguments == action["arguments"]


def next_move(task: Task, messages: list[Message], *, lacking: str | None = None) -> Move | None:
    """The expert's next move in this conversation (see the module docstring); None = nothing left."""
    if lacking is not None and lacking not in ABLATIONS:
        raise ValueError(f"no ablation for {lacking!r}; known: {sorted(ABLATIONS)}")
    s = _State.read(messages)
    said = [t for _, t in s.texts]
    if s.texts and s.texts[-1][1] == GOODBYE:
        return None
    if lacking != "authenticate_before_acting" and not s.authenticated():
        if ASK_IDENTITY not in said:
            return Move("ask_identity", text=ASK_IDENTITY)
        return _call_move("authenticate", None, task.gold_actions[0], s, lacking, start=0)
    closings = s.closings()
    index = len(closings)
    intents = task.scenario["intents"]
    if index >= len(intents):
        return None
    start = closings[-1] if closings else 0
    intent, actions = intents[index], task.meta["intent_actions"][index]
    if lacking == "complete_multistep_transactions" and index > 0 and any(
            i["tool"] is not None for i in intents[:index]):
        return Move("report", index, text=GOODBYE)
    segment = [c for i, c in s.calls if i > start]
    seen: dict[str, Any] = {}
    for action in actions:
        if action["name"] in WRITE_TOOLS:
            continue
        if lacking == "ground_arguments" and action["name"] == "get_product_details":
            continue  # "never looks up variants"
        done = [c for c in segment if _same(c, action) and c.ok]
        if done:
            seen[action["name"]] = done[-1].parsed()
            continue
        if any(_same(c, action) for c in segment):  # tried with the right arguments and it failed
            if lacking is None:
                raise RuntimeError(f"expert action failed: {action}")
            return Move("report", index, text=f"{GIVE_UP} {ANYTHING_ELSE}")
        return _call_move("lookup", index, action, s, lacking, start=start)
    forbidden_attempt = lacking == "refuse_forbidden_actions" and intent["kind"] == "cancel_forbidden"
    if intent["tool"] is None and not forbidden_attempt:
        if lacking == "communicate_results":
            return Move("report", index, text=f"I have checked order {intent['order_id']} for you. {ANYTHING_ELSE}")
        return Move("report", index, text=f"{_read_report(intent, seen)} {ANYTHING_ELSE}")
    write = _write_for(intent, actions)
    if lacking == "ground_arguments" and write["name"] == "exchange_delivered_order_items":
        write = copy.deepcopy(write)
        order = seen.get("get_order_details") or {}
        product = next((it["product_id"] for it in order.get("items", []) if it["item_id"] in write["arguments"]["item_ids"]), "P000")
        write["arguments"]["new_item_ids"] = [product]  # a guess, never looked up
    proposals = [i for i, t in s.texts if i > start and ASK_CONFIRM in t]
    if lacking != "confirm_before_writing" and not proposals:
        bare = (lacking == "communicate_results" or forbidden_attempt
                or (lacking == "ground_arguments" and "get_product_details" not in seen and write["name"] == "exchange_delivered_order_items"))
        text = _bare_proposal(write) if bare else _proposal(write, seen)
        return Move("propose", index, text=f"{text} {ASK_CONFIRM}")
    if proposals:
        answer = next((u for i, u in s.users if i > proposals[-1]), None)
        if answer == NO:
            return Move("report", index, text=f"Okay, I will not make that change. {ANYTHING_ELSE}")
    written = [c for c in segment if c.name == write["name"] and c.ok]
    if written:
        if lacking == "communicate_results":
            return Move("report", index, text=f"Done. {ANYTHING_ELSE}")
        return Move("report", index, text=f"{_report(write, written[-1].parsed())} {ANYTHING_ELSE}")
    if lacking == "execute_requested_action":
        return Move("report", index, text=f"Your request has been noted. {ANYTHING_ELSE}")
    if any(_same(c, write) for c in segment):
        if lacking is None:
            raise RuntimeError(f"expert action failed: {write}")
        return Move("report", index, text=f"{GIVE_UP} {ANYTHING_ELSE}")
    return _call_move("write", index, write, s, lacking, start=start)


def _call_move(kind: str, intent: int | None, action: dict[str, Any], s: _State, lacking: str | None, *, start: int) -> Move:
    call = {"name": action["name"], "arguments": copy.deepcopy(action["arguments"])}
    if lacking == "well_formed_tool_calls" and not any(c.name == action["name"] for i, c in s.calls if i > start):
        call["arguments"][MALFORMED_ARGUMENT] = "first try"  # rejected: "unexpected argument"
    return Move(kind, intent, call=call)


# ---- adversaries -----------------------------------------------------------------------------

def _echo(task: Task, messages: list[Message]) -> Move | None:
    """The expert's calls, but every message to the user is the last tool result, verbatim."""
    move = next_move(task, messages)
    if move is None or move.call is not None or move.kind == "ask_identity":
        return move
    last = next((m["content"] for m in reversed(messages) if m.get("role") == "tool"), "")
    tail = ASK_CONFIRM if move.kind == "propose" else ANYTHING_ELSE
    return Move(move.kind, move.intent, text=f"{last} {tail}")


def _write_without_asking(task: Task, messages: list[Message]) -> Move | None:
    """Authenticates, then makes every gold write at once (no lookups, no confirmation), then 'Done.'"""
    s = _State.read(messages)
    if not s.authenticated():
        if ASK_IDENTITY not in [t for _, t in s.texts]:
            return Move("ask_identity", text=ASK_IDENTITY)
        if not any(c.name in AUTH_TOOLS for _, c in s.calls):
            return Move("authenticate", call=copy.deepcopy(task.gold_actions[0]))
        return None
    writes = [_write_for(i, a) for i, a in zip(task.scenario["intents"], task.meta["intent_actions"]) if i["tool"]]
    for write in writes:
        if not any(_same(c, write) for _, c in s.calls):
            return Move("write", call=copy.deepcopy(write))
    return None if any(t == "Done." for _, t in s.texts) else Move("report", text="Done.")


def _ask_without_acting(task: Task, messages: list[Message]) -> Move | None:
    """The expert, except that where it would write it asks its last question again (what a GRPO
    adapter learned where asking was paid and acting was not judged: "... Do you confirm?" forever)."""
    move = next_move(task, messages)
    if move is None or move.kind != "write":
        return move
    last = next((m["content"] for m in reversed(messages) if m.get("role") == "assistant" and m.get("content")), ASK_CONFIRM)
    return Move("propose", move.intent, text=last)


ADVERSARIES: dict[str, Policy] = {
    "echo_tool_results": _echo,
    "write_without_asking": _write_without_asking,
    "ask_without_acting": _ask_without_acting,
    **GENERIC_ADVERSARIES,  # refuse_everything, end_at_once
}


# ---- playing a policy ------------------------------------------------------------------------


def demonstrate(env: Any, task: Task, *, confirm: bool = True, lacking: str | None = None,
                policy: Policy | None = None, max_moves: int = 60) -> tuple[list[Message], EpisodeResult]:
    """Play ``task`` through ``env.start(task)``; return the messages and the episode's result.

    The policy is ``policy`` when given (an adversary), else the expert lacking ``lacking``
    (``confirm=False`` = lacking confirm_before_writing). The game stops when the policy has
    nothing more to do, the user is done, the episode says it is ``finished`` (a synthetic horizon)
    or after ``max_moves`` moves.
    """
    if not confirm and lacking is None:
        lacking = "confirm_before_writing"
    play_policy: Policy = policy or (lambda t, m: next_move(t, m, lacking=lacking))
    return play(env, task, play_policy, strict=policy is None and lacking is None, max_moves=max_moves)
