"""The scripted retail user: deterministic answers from a task scenario, by keyword rules.

Contract:

* :meth:`ScriptedUser.opening` states the first intent; the user's identity is given only when
  the agent asks for it (email, or name + zip when the scenario's ``id_method`` is ``name_zip``
  or the agent asks only for name / zip).
* :meth:`ScriptedUser.reply` answers the agent's last plain message, checking in this order:
  "anything else" -> move on; a confirmation question -> "Yes, please proceed." or
  "No, please don't." (per the current intent's ``confirm``); identity; a softer confirmation
  ("confirm" / "proceed" in a question); the order id, item, new options, address, payment
  method or cancel reason; otherwise move on. Moving on = state the next intent once the current
  one is handled, restate the current one if it is not, and say "That is all, thank you." (done)
  after the last one.
* ``handled(intent)`` is supplied by the episode: a write intent is handled once its write
  succeeded on its target; a read-only intent once the agent has said all of its ``must_say``.
  An intent the user declined is handled too.
* The user is done after ``max_turns`` replies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

STRONG_CONFIRM = (
    "yes/no", "yes or no", "(y/n)", "do you confirm", "shall i", "would you like me to",
    "do you want me to", "should i", "can i proceed", "may i proceed", "ok to proceed",
)
IDENTITY = ("email", "e-mail", "name", "zip", "verify", "authenticate", "identity", "identify")
ASKING = ("?", "please", "provide", "could you", "can you", "may i", "tell me")
ORDER_ID = ("order id", "order number", "which order", "order #")
ITEM = ("which item", "what item", "which product", "what product")
OPTIONS = ("which variant", "what variant", "which option", "what option", "which color",
           "what color", "which size", "what size", "new item")
ADDRESS = ("new address", "what address", "which address", "what is the address")
PAYMENT = ("payment method", "refund to", "which card", "which method", "refund method")
REASON = ("reason", "why")

YES = "Yes, please proceed."
NO = "No, please don't."
DONE = "That is all, thank you."


def _has(text: str, words: tuple[str, ...]) -> bool:
    return any(word in text for word in words)


@dataclass
class UserTurn:
    text: str
    done: bool
    kind: str  # identity, order_id, confirm_yes, confirm_no, item, options, address, payment,
    # reason, next_intent, restate, done, cap


class ScriptedUser:
    """One simulated user. Stateful: create one per episode."""

    def __init__(self, scenario: dict[str, Any], max_turns: int = 10) -> None:
        self.scenario = scenario
        self.intents: list[dict[str, Any]] = scenario["intents"]
        self.max_turns = max_turns
        self.current = 0  # index of the intent stated last
        self.declined: set[int] = set()
        self.turns = 0
        self.done = False

    def opening(self) -> str:
        return self.scenario["opening"]

    # ---- answers ---------------------------------------------------------------------------

    def _identity(self, text: str) -> str:
        s = self.scenario
        name_zip = f"My name is {s['first_name']} {s['last_name']} and my zip code is {s['zip']}."
        asks_email = "email" in text or "e-mail" in text
        asks_name_zip = "name" in text or "zip" in text
        if s["id_method"] == "name_zip":
            return ("I don't remember my email. " + name_zip) if asks_email else name_zip
        if asks_name_zip and not asks_email:
            return name_zip
        return f"My email is {s['email']}."

    def _confirm(self) -> UserTurn:
        if self.intents[self.current]["confirm"]:
            return UserTurn(YES, False, "confirm_yes")
        self.declined.add(self.current)
        return UserTurn(NO, False, "confirm_no")

    def _move_on(self, handled: Callable[[dict[str, Any]], bool]) -> UserTurn:
        intent = self.intents[self.current]
        if self.current not in self.declined and not handled(intent):
            return UserTurn(intent["request"], False, "restate")
        if self.current + 1 < len(self.intents):
            self.current += 1
            return UserTurn(self.intents[self.current]["request"], False, "next_intent")  # says "also"
        self.done = True
        return UserTurn(DONE, True, "done")

    def _detail(self, text: str) -> UserTurn | None:
        intent = self.intents[self.current]
        if _has(text, ORDER_ID) and intent.get("order_id"):
            return UserTurn(f"The order id is {intent['order_id']}.", False, "order_id")
        if _has(text, ITEM) and intent.get("item"):
            return UserTurn(f"The {intent['item']}.", False, "item")
        if _has(text, OPTIONS) and intent.get("new_options"):
            return UserTurn(f"The one with {intent['new_options']}.", False, "options")
        if _has(text, ADDRESS) and intent.get("address"):
            a = intent["address"]
            return UserTurn(f"The new address is {a['address1']}, {a['city']}, {a['zip']}.", False, "address")
        if _has(text, PAYMENT) and intent.get("payment"):
            return UserTurn(f"To {intent['payment']}, please.", False, "payment")
        if _has(text, REASON) and intent.get("reason"):
            return UserTurn(f"The reason is: {intent['reason']}.", False, "reason")
        return None

    def reply(self, assistant_text: str, handled: Callable[[dict[str, Any]], bool]) -> UserTurn:
        """The answer to one plain assistant message (see the module docstring for the rules)."""
        if self.done:
            return UserTurn(DONE, True, "done")
        self.turns += 1
        if self.turns > self.max_turns:
            self.done = True
            return UserTurn("I have to go now. Bye.", True, "cap")
        text = assistant_text.lower()
        asking = _has(text, ASKING)
        if "anything else" in text:
            return self._move_on(handled)
        if _has(text, STRONG_CONFIRM):
            return self._confirm()
        if asking and _has(text, IDENTITY):
            return UserTurn(self._identity(text), False, "identity")
        if "?" in text and ("confirm" in text or "proceed" in text):
            return self._confirm()
        if asking:
            detail = self._detail(text)
            if detail is not None:
                return detail
        return self._move_on(handled)
