"""The scripted retail expert: plays a task through a real episode, following the policy.

``demonstrate(env, task, confirm=True)`` asks for identity, authenticates, looks up what each
intent needs, states the action details (with the amounts the task requires) and asks
"Do you confirm? (yes/no)", writes only after a yes, reports the outcome and ends when the user
is done. With ``confirm=False`` it writes without asking (an imperfect style for warm-start
variety; it fails tasks where the user would have said no).

Messages are OpenAI chat format; tool-call arguments are dicts (HF convention) and an assistant
message that only calls a tool has content "". Assistant texts stay one or two sentences, since a
small model imitates them.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from ..base import EpisodeResult, Message, Task
from .db import money
from .tasks import describe_address
from .tools import WRITE_TOOLS
from .user import YES

ASK_IDENTITY = "I can help with that. Please give me your email, or your name and zip code, to verify your identity."
ASK_CONFIRM = "Do you confirm? (yes/no)"
ANYTHING_ELSE = "Anything else I can help with?"


def _amount(text: str) -> float:
    return float(text.replace("$", ""))


def _item(order: dict[str, Any], item_id: str) -> dict[str, Any]:
    return next(item for item in order["items"] if item["item_id"] == item_id)


def _write_for(intent: dict[str, Any], actions: list[dict[str, Any]]) -> dict[str, Any]:
    """The intent's write: from the gold actions, or rebuilt when the gold has none (a declined cancel)."""
    for action in actions:
        if action["name"] in WRITE_TOOLS:
            return action
    return {"name": "cancel_pending_order", "arguments": {"order_id": intent["order_id"], "reason": intent["reason"]}}


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


def demonstrate(env: Any, task: Task, *, confirm: bool = True) -> tuple[list[Message], EpisodeResult]:
    """Play ``task`` through ``env.start(task)``; return the messages and the episode's result."""
    episode = env.start(task)
    messages = episode.initial_messages()
    done = False

    def say(text: str) -> str:
        nonlocal done
        messages.append({"role": "assistant", "content": text})
        reply, done = episode.user_reply(text)
        messages.append({"role": "user", "content": reply})
        return reply

    def call(action: dict[str, Any]) -> Any:
        arguments = copy.deepcopy(action["arguments"])
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": action["name"], "arguments": arguments}}]})
        observation = episode.call_tool(action["name"], copy.deepcopy(arguments))
        messages.append({"role": "tool", "name": action["name"], "content": observation})
        if observation.startswith("Error:"):
            raise RuntimeError(f"expert action failed: {action} -> {observation}")
        try:
            return json.loads(observation)
        except json.JSONDecodeError:
            return observation

    say(ASK_IDENTITY)
    call(task.gold_actions[0])
    for intent, actions in zip(task.scenario["intents"], task.meta["intent_actions"]):
        if done:
            break
        seen: dict[str, Any] = {}
        for action in actions:
            if action["name"] not in WRITE_TOOLS:
                seen[action["name"]] = call(action)
        if intent["tool"] is None:
            say(f"{_read_report(intent, seen)} {ANYTHING_ELSE}")
            continue
        write = _write_for(intent, actions)
        if confirm and say(f"{_proposal(write, seen)} {ASK_CONFIRM}") != YES:
            say(f"Okay, I will not make that change. {ANYTHING_ELSE}")
            continue
        say(f"{_report(write, call(write))} {ANYTHING_ELSE}")
    return messages, episode.result()
