"""``RetailEnv`` and ``RetailEpisode``: the built-in target environment behind base.py's protocols.

Scoring (tau2-bench style, binary): ``reward = state_match * info_score`` where ``state_match``
says the final database hash equals the task's ``expected_state_hash`` and ``info_score`` is 1
when every ``required_info`` string occurs (case-insensitively) in some plain assistant message
(the texts passed to ``user_reply``, or to ``record_assistant_text``), else 0.

Confirmation is recorded, not enforced: a successful write made when the last user message was
not an explicit yes to a confirmation question adds a ``confirm_before_write`` violation. One yes
covers one write.
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from typing import Any

from ..base import EpisodeResult, Message, Task, jsonable
from .db import RetailDB, generate_db
from .tasks import FAMILIES, make_task, replay_actions
from .tools import ACCOUNT_TOOLS, AUTH_TOOLS, TOOL_SCHEMAS, WRITE_TOOLS, Session, run_tool
from .user import ScriptedUser

ROLE = "You are a retail customer service agent. Use the tools and follow this policy."


def load_policy() -> str:
    return resources.files(__package__).joinpath("policy.md").read_text(encoding="utf-8").strip()


class RetailEpisode:
    """One conversation: its own database copy, scripted user and action log."""

    def __init__(self, task: Task, system_prompt: str, max_user_turns: int = 10) -> None:
        self.task = task
        self.session = Session(generate_db(task.seed))
        self.user = ScriptedUser(task.scenario, max_turns=max_user_turns)
        self._system_prompt = system_prompt
        self.actions: list[dict[str, Any]] = []
        self.tool_errors: list[str] = []
        self.policy_violations: list[dict[str, str]] = []
        self.assistant_texts: list[str] = []
        self.confirmations = 0
        self._confirmed = False  # the last user message was an explicit yes to a confirmation

    # ---- protocol ------------------------------------------------------------------------

    def initial_messages(self) -> list[Message]:
        return [
            {"role": "system", "content": self._system_prompt},
            {"role": "user", "content": self.user.opening()},
        ]

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        outcome = run_tool(self.session, name, arguments)
        self.actions.append({"name": name, "arguments": jsonable(arguments), "ok": outcome.ok})
        if not outcome.ok:
            self.tool_errors.append(outcome.observation)
        if outcome.violation is not None:
            self.policy_violations.append(outcome.violation)
        if outcome.ok and name in WRITE_TOOLS:
            if not self._confirmed:
                detail = f"{name} {json.dumps(arguments, sort_keys=True)}"
                self.policy_violations.append({"rule": "confirm_before_write", "detail": detail})
            self._confirmed = False  # one yes covers one write
        return outcome.observation

    def malformed_call(self, raw: str, error: str) -> str:
        observation = f"Error: malformed tool call: {error}"
        self.tool_errors.append(observation)
        return observation

    def user_reply(self, assistant_text: str) -> tuple[str, bool]:
        self.record_assistant_text(assistant_text)
        if self.session.transferred:
            self.user.done = True
            self._confirmed = False
            return "Thank you, I will wait for the human agent.", True
        turn = self.user.reply(assistant_text, self._handled)
        if turn.kind in ("confirm_yes", "confirm_no"):
            self.confirmations += 1
        self._confirmed = turn.kind == "confirm_yes"
        return turn.text, turn.done

    def result(self) -> EpisodeResult:
        state_match = self.session.db.state_hash() == self.task.expected_state_hash
        said = [text.lower() for text in self.assistant_texts]
        missing = [info for info in self.task.required_info if not any(info.lower() in t for t in said)]
        info_score = 0.0 if missing else 1.0
        reward = float(state_match) * info_score
        info = {
            "family": self.task.family,
            "state_match": state_match,
            "info_score": info_score,
            "missing_info": missing,
            "actions": copy.deepcopy(self.actions),
            "tool_errors": list(self.tool_errors),
            "policy_violations": copy.deepcopy(self.policy_violations),
            "authenticated": self.session.user_id is not None,
            "confirmations": self.confirmations,
            "n_writes": sum(1 for a in self.actions if a["ok"] and a["name"] in WRITE_TOOLS),
            "gold_writes": [a["name"] for a in self.task.gold_actions if a["name"] in WRITE_TOOLS],
            "transferred": self.session.transferred,
            "user_turns": self.user.turns,
            "user_done": self.user.done,
        }
        return EpisodeResult(reward=reward, success=reward == 1.0, info=info)

    # ---- helpers -------------------------------------------------------------------------

    def record_assistant_text(self, text: str) -> None:
        """Count ``text`` as said to the user (for required info) without a user turn."""
        self.assistant_texts.append(text if isinstance(text, str) else str(text))

    def grant_confirmation(self) -> None:
        """Act as if the user had just said yes to a confirmation question (for replays)."""
        self.confirmations += 1
        self._confirmed = True

    def _handled(self, intent: dict[str, Any]) -> bool:
        if intent["tool"] is None:
            said = " ".join(self.assistant_texts).lower()
            return all(s.lower() in said for s in intent["must_say"])
        for action in self.actions:
            args = action["arguments"] if isinstance(action["arguments"], dict) else {}
            target = args.get("order_id", args.get("user_id"))
            if action["ok"] and action["name"] == intent["tool"] and target == intent["target"]:
                return True
        return False


class RetailEnv:
    """The built-in retail target environment (see base.Environment), with every base.TargetHooks hook."""

    name = "retail"

    def __init__(self, max_user_turns: int = 10) -> None:
        self.max_user_turns = max_user_turns

    def tool_schemas(self) -> list[dict[str, Any]]:
        return copy.deepcopy(TOOL_SCHEMAS)

    def system_prompt(self) -> str:
        return f"{ROLE}\n\n{load_policy()}"

    def families(self) -> list[str]:
        return list(FAMILIES)

    def make_task(self, family: str, seed: int) -> Task:
        return make_task(family, seed)

    def start(self, task: Task) -> RetailEpisode:
        return RetailEpisode(task, self.system_prompt(), self.max_user_turns)

    def replay(self, task: Task, actions: list[dict[str, Any]], *, say: list[str] | None = None,
               confirm: bool = True) -> EpisodeResult:
        """Apply ``actions`` ({"name", "arguments"}) in a fresh episode, then score it.

        With ``confirm`` each write is preceded by an implied user yes; ``say`` lists assistant
        texts counted as said to the user.
        """
        episode = self.start(task)
        for action in actions:
            if confirm and action["name"] in WRITE_TOOLS:
                episode.grant_confirmation()
            episode.call_tool(action["name"], action["arguments"])
        for text in say or []:
            episode.record_assistant_text(text)
        return episode.result()

    # ---- target hooks (base.TargetHooks) ----------------------------------------------------

    def expert(self, task: Task, *, confirm: bool = True, via: Any = None) -> tuple[list[Message], EpisodeResult]:
        from .expert import demonstrate

        return demonstrate(via or self, task, confirm=confirm)

    def tool_classes(self) -> dict[str, frozenset[str]]:
        return {"auth": AUTH_TOOLS, "write": WRITE_TOOLS, "account": ACCOUNT_TOOLS}

    def generate_db(self, seed: int) -> RetailDB:
        return generate_db(seed)

    def replay_state(self, db: RetailDB, actions: list[dict[str, Any]]) -> str:
        return replay_actions(db, actions).state_hash()
