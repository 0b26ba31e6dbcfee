"""Any MCP tool server as a target environment's tools, through the official ``mcp`` client SDK.

:class:`McpServer` runs one server process over stdio, shared by every episode of an environment.
The SDK is async and the rest of TRACE is sync, so the client session lives on a dedicated
event-loop thread and the sync methods submit coroutines to it with a bounded timeout.

Contracts:

* ``start()`` spawns ``command`` and runs ``initialize`` then ``tools/list``; every tool's
  ``inputSchema`` is checked as JSON Schema (Draft 2020-12), and a bad one raises
  :class:`McpSchemaError` naming the tool. ``stop()`` closes the session and the process
  (stdin closed, then SIGTERM/SIGKILL by the SDK) and is idempotent.
* ``call(name, arguments)`` makes one ``tools/call``. A tool that reports ``isError`` is an
  ordinary :class:`ToolReply` (the agent's mistake, shown to it). Everything that means the
  *server* is broken raises :class:`McpServerError`: the process died, the call timed out, the
  server wrote a line that is not JSON-RPC, the reply is not a valid ``CallToolResult``, a JSON-RPC
  error (e.g. the server does not know a tool it listed). After such a fault the connection is
  dropped (the process killed); the next call starts a fresh process (``restarts`` counts them).
* A process that died between calls is noticed (``alive`` checks the process) and restarted
  before the next call; ``starts`` counts processes, so an episode begun on an earlier process
  knows its state may be gone.
* Environments turn :class:`McpServerError` into the rollout runner's error path (the exception
  propagates out of ``Episode.call_tool``), so a bad server is never scored as an agent failure.
  :class:`McpEpisode` also raises it when the server was restarted under a running episode.

:func:`openai_tools` turns MCP tool declarations into the OpenAI tool schemas agents see, minus
the server's control tools and its isolation argument (``state_key`` for tau2's server), which
the environment fills in itself.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import re
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .base import EpisodeResult, Message, Task, jsonable

log = logging.getLogger(__name__)


class McpServerError(RuntimeError):
    """The MCP server itself failed (crash, timeout, malformed output, protocol error)."""


class McpSchemaError(McpServerError):
    """A tool declared by the server has an ``inputSchema`` that is not valid JSON Schema."""


@dataclass(frozen=True)
class McpServerConfig:
    """How to start one stdio MCP server. ``env`` is added to the inherited environment the SDK
    passes (PATH, HOME, ...). ``stderr_path`` collects the server's stderr; its tail is quoted in
    errors."""

    command: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    call_timeout_s: float = 30.0
    start_timeout_s: float = 60.0
    stderr_path: str | None = None
    name: str = "mcp"


@dataclass(frozen=True)
class ToolReply:
    """One ``tools/call`` result: the text content, the structured content, and ``isError``."""

    text: str
    structured: Any
    is_error: bool


def check_tool_schemas(tools: list[dict[str, Any]], server: str = "mcp") -> None:
    """Raise :class:`McpSchemaError` naming the first tool whose ``inputSchema`` is not a valid
    JSON Schema object schema."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    for tool in tools:
        name = tool.get("name")
        schema = tool.get("inputSchema")
        if not isinstance(name, str) or not name:
            raise McpSchemaError(f"{server}: a tool has no name: {tool!r:.200}")
        if not isinstance(schema, dict):
            raise McpSchemaError(f"{server}: tool {name!r}: inputSchema is not an object")
        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as exc:
            where = "/".join(str(p) for p in exc.path) or "(root)"
            raise McpSchemaError(f"{server}: tool {name!r}: inputSchema is not valid JSON Schema at {where}: {exc.message}") from None
        if schema.get("type", "object") != "object":
            raise McpSchemaError(f"{server}: tool {name!r}: inputSchema type must be 'object', got {schema.get('type')!r}")


def openai_tools(tools: list[dict[str, Any]], *, hidden: frozenset[str] = frozenset(), strip_args: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """OpenAI-format schemas for the MCP declarations ``tools`` (``name``, ``description``,
    ``inputSchema``), without the ``hidden`` tools and without the ``strip_args`` properties."""
    out = []
    for tool in tools:
        if tool["name"] in hidden:
            continue
        params = copy.deepcopy(tool["inputSchema"])
        props = params.get("properties") or {}
        for arg in strip_args:
            props.pop(arg, None)
        if "required" in params:
            params["required"] = [r for r in params["required"] if r not in strip_args]
        out.append({"type": "function", "function": {"name": tool["name"], "description": tool.get("description") or "", "parameters": params}})
    return out


def _leaf(exc: BaseException) -> BaseException:
    """The first non-group exception inside ``exc`` (anyio task groups wrap what they raise)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _stderr_tail(path: str | None, limit: int = 600) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, "rb") as fh:
        fh.seek(max(0, os.path.getsize(path) - limit))
        tail = fh.read().decode("utf-8", "replace").strip()
    return f"; server stderr ends: {tail}" if tail else ""


class _Connection:
    """One live server process and its initialized ClientSession, owned by the loop thread."""

    def __init__(self) -> None:
        self.session: Any = None
        self.tools: list[dict[str, Any]] = []
        self.closing: asyncio.Event = asyncio.Event()
        self.fault: asyncio.Future = asyncio.get_running_loop().create_future()  # set on a stream fault
        self.task: asyncio.Task | None = None
        self.pid: int | None = None


class McpServer:
    """A stdio MCP server shared by many episodes. Thread-safe; see the module docstring."""

    def __init__(self, config: McpServerConfig) -> None:
        self.config = config
        self.restarts = 0
        self.starts = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._conn: _Connection | None = None
        self._lock = threading.RLock()

    # ---- sync API ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the process (if it is not running) and list its tools."""
        with self._lock:
            if self.alive:
                return
            if self._conn is not None and self._loop is not None:  # a dead process: drop its session first
                self._submit(self._close(), self.config.start_timeout_s, "closing the dead connection")
            self._ensure_loop()
            self._submit(self._open(), self.config.start_timeout_s, "start")

    def stop(self) -> None:
        """Close the session and the process; stop the loop thread. Safe to call twice."""
        with self._lock:
            if self._loop is None:
                return
            try:
                self._submit(self._close(), self.config.start_timeout_s, "stop")
            except McpServerError as exc:
                log.warning("%s", exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
            self._loop = self._thread = self._conn = None

    @property
    def alive(self) -> bool:
        """The connection is up and its process has not exited (checked now, not at the next call)."""
        if self._conn is None or self._conn.task is None or self._conn.task.done():
            return False
        if self._conn.pid is None:
            return True
        import psutil

        try:
            return psutil.Process(self._conn.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    @property
    def pid(self) -> int | None:
        """The server process id (for tests and diagnostics), None when it is not running."""
        return self._conn.pid if self.alive else None

    def tools(self) -> list[dict[str, Any]]:
        """The MCP declarations from ``tools/list`` (``name``, ``description``, ``inputSchema``)."""
        self.start()
        return copy.deepcopy(self._conn.tools)

    def call(self, name: str, arguments: dict[str, Any]) -> ToolReply:
        """One ``tools/call``; restarts a dead server first. Raises :class:`McpServerError`."""
        with self._lock:
            if self._conn is not None and not self.alive:
                self.restarts += 1
                log.warning("%s: server is not running; restarting it", self.config.name)
                self._submit(self._close(), self.config.start_timeout_s, "closing the dead connection")
            self.start()
            # The SDK's own read timeout fires first; the outer bound only guards a stuck loop.
            return self._submit(self._call(name, arguments), self.config.call_timeout_s + 10, f"tools/call {name}")

    # ---- loop thread ---------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"mcp-{self.config.name}", daemon=True)
        self._thread.start()

    def _submit(self, coro: Any, timeout: float, what: str) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            self._kill()
            raise McpServerError(f"{self.config.name}: {what} did not finish in {timeout:.0f}s") from None

    def _kill(self) -> None:
        """Drop the connection from outside the loop (after a stuck call)."""
        if self._loop is not None and self._conn is not None:
            self._loop.call_soon_threadsafe(self._conn.closing.set)

    async def _open(self) -> None:
        conn = _Connection()
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        conn.task = asyncio.create_task(self._serve(conn, ready))
        try:
            await asyncio.wait_for(asyncio.shield(ready), self.config.start_timeout_s)
        except asyncio.TimeoutError:
            conn.closing.set()
            raise McpServerError(f"{self.config.name}: no answer to initialize/tools/list in {self.config.start_timeout_s:.0f}s{_stderr_tail(self.config.stderr_path)}") from None
        except McpServerError:
            await asyncio.wait([conn.task], timeout=self.config.start_timeout_s)
            raise
        self._conn = conn
        self.starts += 1

    async def _serve(self, conn: _Connection, ready: asyncio.Future) -> None:
        """The connection's whole life: spawn, initialize, list tools, wait for ``closing``."""
        import psutil
        from mcp import ClientSession, StdioServerParameters, stdio_client

        cfg = self.config
        params = StdioServerParameters(command=cfg.command, args=list(cfg.args), env=dict(cfg.env), cwd=cfg.cwd)
        errlog = open(cfg.stderr_path, "a", encoding="utf-8") if cfg.stderr_path else open(os.devnull, "w")

        async def on_message(message: Any) -> None:
            if isinstance(message, Exception) and not conn.fault.done():
                conn.fault.set_result(f"malformed output from the server: {type(message).__name__}: {str(message)[:300]}")

        before = {p.pid for p in psutil.Process().children()}
        try:
            async with stdio_client(params, errlog=errlog) as (read, write):
                spawned = [p.pid for p in psutil.Process().children() if p.pid not in before]
                conn.pid = spawned[0] if spawned else None
                async with ClientSession(read, write, read_timeout_seconds=cfg.start_timeout_s, message_handler=on_message) as session:
                    await session.initialize()
                    listed = await session.list_tools()
                    tools = [t.model_dump(by_alias=True, exclude_none=True) for t in listed.tools]
                    check_tool_schemas(tools, cfg.name)
                    conn.session, conn.tools = session, tools
                    ready.set_result(None)
                    await conn.closing.wait()
        except BaseException as group:  # spawn failure, crash during initialize, a bad schema, ...
            exc = _leaf(group)
            if isinstance(exc, McpServerError):
                if not ready.done():
                    ready.set_exception(exc)
            elif not ready.done():
                ready.set_exception(McpServerError(f"{cfg.name}: could not start {cfg.command} {' '.join(cfg.args)}: "
                                                   f"{type(exc).__name__}: {exc}{_stderr_tail(cfg.stderr_path)}"))
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
        finally:
            errlog.close()

    async def _close(self) -> None:
        conn = self._conn
        if conn is None or conn.task is None:
            return
        conn.closing.set()
        await asyncio.wait([conn.task], timeout=self.config.start_timeout_s)

    async def _call(self, name: str, arguments: dict[str, Any]) -> ToolReply:
        from pydantic import ValidationError

        conn = self._conn
        what = f"{self.config.name}: tools/call {name!r}"
        call = asyncio.ensure_future(conn.session.call_tool(name, arguments, read_timeout_seconds=self.config.call_timeout_s))
        done, _ = await asyncio.wait([call, conn.fault, conn.task], timeout=self.config.call_timeout_s + 5,
                                     return_when=asyncio.FIRST_COMPLETED)
        try:
            if call not in done:
                call.cancel()
                if conn.fault in done:
                    raise McpServerError(f"{what}: {conn.fault.result()}")
                if conn.task in done:
                    raise McpServerError(f"{what}: the server process exited{_stderr_tail(self.config.stderr_path)}")
                raise McpServerError(f"{what}: no reply in {self.config.call_timeout_s:.0f}s")
            try:
                result = call.result()
            except (ValidationError, ValueError, TypeError) as exc:
                raise McpServerError(f"{what}: malformed reply: {type(exc).__name__}: {str(exc)[:300]}") from None
            except Exception as exc:  # MCPError: timeout, connection closed, JSON-RPC error
                raise McpServerError(f"{what}: {type(exc).__name__}: {exc}{_stderr_tail(self.config.stderr_path)}") from None
            if conn.fault.done():  # a garbage line arrived next to a valid reply: do not trust it
                raise McpServerError(f"{what}: {conn.fault.result()}")
        except McpServerError:
            conn.closing.set()  # drop this connection; the next call restarts the server
            await asyncio.wait([conn.task], timeout=self.config.start_timeout_s)
            raise
        texts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
        return ToolReply(text="\n".join(texts), structured=result.structured_content, is_error=bool(result.is_error))



# ---- an Environment over an MCP server, with tasks in tau2-bench's format --------------------


@dataclass(frozen=True)
class McpEnvSpec:
    """Everything that makes one MCP server a target environment (data, not code).

    ``isolation_arg`` is the per-call argument by which the server keeps one state per episode
    (tau2's ``state_key``); the environment fills it in, agents never see it. ``reset_tool``
    (called with ``reset_arguments`` + ``task_id`` + the key) gives an episode a fresh state.
    ``state_dir_env`` names the server's variable for where it persists states (set to a private
    folder per environment); ``read_state(folder, key)`` reads one state's database from there, for
    DB grading. Without it DB is reported "not graded".
    """

    name: str
    server: McpServerConfig
    tasks_path: Path
    split_path: Path
    policy_path: Path
    write_tools: frozenset[str]
    role: str = "You are a customer service agent. Use the tools and follow this policy."
    isolation_arg: str | None = "state_key"
    reset_tool: str | None = "reset_state"
    reset_arguments: dict[str, Any] = field(default_factory=dict)
    hidden_tools: frozenset[str] = frozenset()
    state_dir_env: str | None = None
    read_state: Any = None  # Callable[[Path, str], Any]
    auth_tools: frozenset[str] = frozenset()  # a successful call identifies the user ("authenticated")
    account_tools: frozenset[str] = frozenset()  # tools the server refuses before authentication (none for tau2)


class McpEpisode:
    """One conversation against the shared server, in its own state namespace (see McpEnv)."""

    def __init__(self, env: "McpEnv", task: Task, key: str, user: Any) -> None:
        from .tau2 import Transcript

        self.env, self.task, self.key, self.user = env, task, key, user
        self.generation = env.server.starts  # which server process holds this episode's state
        self.transcript = Transcript()
        self.tool_errors: list[str] = []
        self.fault: str | None = None
        self._opening: str | None = None
        self.policy_violations: list[dict[str, str]] = []
        self.confirmations = 0
        self._confirmed = False  # the last user message said yes to a confirmation question

    def initial_messages(self) -> list[Message]:
        if self._opening is None:
            try:
                self._opening = self.user.opening()
            except Exception as exc:
                self.fault = f"user simulator: {type(exc).__name__}: {exc}"
                raise
            self.transcript.user_texts.append(self._opening)
        return [{"role": "system", "content": self.env.system_prompt()}, {"role": "user", "content": self._opening}]

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        from .tau2 import extract_tau2_text

        args = jsonable(arguments) if isinstance(arguments, dict) else {}
        if name not in self.env.agent_tool_names():
            observation = f"Error: Tool '{name}' not found."
        else:
            try:
                reply = self.env.call_isolated(self.key, name, args)
                if self.env.server.starts != self.generation:  # a restart mid-episode may have lost its state
                    raise McpServerError(f"{self.env.name}: tools/call {name!r}: the server was restarted during this episode")
            except McpServerError as exc:
                self.fault = str(exc)
                raise
            observation = extract_tau2_text(reply.structured, reply.text)
            if reply.is_error and not observation.startswith("Error"):
                observation = f"Error: {observation}"
        ok = not observation.startswith("Error")
        self.transcript.calls.append({"name": name, "arguments": args, "ok": ok})
        if not ok:
            self.tool_errors.append(observation)
        if ok and name in self.env.spec.write_tools:  # recorded, not enforced (as in retail)
            if not self._confirmed:
                self.policy_violations.append({"rule": "confirm_before_write", "detail": f"{name} {json.dumps(args, sort_keys=True)}"})
            self._confirmed = False  # one yes covers one write
        return observation

    def malformed_call(self, raw: str, error: str) -> str:
        observation = f"Error: malformed tool call: {error}"
        self.tool_errors.append(observation)
        return observation

    def user_reply(self, assistant_text: str) -> tuple[str, bool]:
        text = assistant_text if isinstance(assistant_text, str) else str(assistant_text)
        self.transcript.assistant_texts.append(text)
        if self.user.done:
            return "", True
        try:
            reply = self.user.reply(text)
        except Exception as exc:  # a user-simulator failure is the environment's, not the agent's
            self.fault = f"user simulator: {type(exc).__name__}: {exc}"
            raise
        self.transcript.user_texts.append(reply)
        asked = any(k in text.lower() for k in ("confirm", "(yes/no)", "proceed"))
        self.confirmations += asked
        self._confirmed = asked and bool(re.search(r"\byes\b", reply.lower()))
        self.transcript.stopped = self.user.done
        return reply, self.user.done

    def result(self) -> EpisodeResult:
        from .tau2 import db_hash, grade

        base = {
            "family": self.task.family,
            "actions": json.loads(json.dumps(self.transcript.calls)),
            "tool_errors": list(self.tool_errors),
            "user": self.user.kind,
            "user_turns": self.user.turns,
            "user_done": self.user.done,
            "n_writes": sum(1 for c in self.transcript.calls if c["ok"] and c["name"] in self.env.spec.write_tools),
            "gold_writes": [a["name"] for a in self.task.gold_actions if a["name"] in self.env.spec.write_tools],
            "policy_violations": copy.deepcopy(self.policy_violations),
            "confirmations": self.confirmations,
        }
        if self.env.spec.auth_tools:
            base["authenticated"] = any(c["ok"] and c["name"] in self.env.spec.auth_tools for c in self.transcript.calls)
        if self.fault is not None:  # the server broke: an error episode, not an agent failure
            return EpisodeResult(reward=0.0, success=False, info={**base, "env_error": self.fault, "graded": {}})
        final = self.env.read_db(self.key)
        result = grade(self.task, self.transcript, final_db_hash=None if final is None else db_hash(final),
                       gold_db_hash=self.env.gold_db_hash(self.task), judge=self.env.judge)
        return EpisodeResult(reward=result.reward, success=result.success, info={**base, **result.info})


class McpEnv:
    """An :class:`~trace_assets.envs.base.Environment` over one MCP server and a tau2-format task
    file (see the module docstring and :class:`McpEnvSpec`).

    One server process is shared by every episode and started at first use. Each episode gets a
    state namespace from a pool (``<env uid>/slot<n>``), reset through ``reset_tool`` at start and
    returned to the pool when the episode object is freed, so the server holds at most as many
    states as there are live episodes. The gold database of a task is computed by replaying its
    gold actions through the same server in a fresh namespace, once per task.
    """

    def __init__(self, spec: McpEnvSpec, *, user_factory: Any = None, judge: Any = None, work_dir: Path | None = None) -> None:
        import tempfile
        import uuid

        from .tau2 import ScriptedUser, load_tasks

        self.spec, self.name = spec, spec.name
        self.write_tools = spec.write_tools
        self.judge = judge
        self.user_factory = user_factory or (lambda task: ScriptedUser(task))
        self.splits = load_tasks(spec.tasks_path, spec.split_path, env=spec.name, write_tools=spec.write_tools)
        self._by_seed = {(t.family, t.seed): t for tasks in self.splits.values() for t in tasks}
        self._policy = Path(spec.policy_path).read_text(encoding="utf-8").strip()
        self.work_dir = Path(tempfile.mkdtemp(prefix=f"trace-{spec.name}-", dir=work_dir))
        env = dict(spec.server.env)
        if spec.state_dir_env:
            env[spec.state_dir_env] = str(self.work_dir / "state")
        from dataclasses import replace

        self.server = McpServer(replace(spec.server, env=env, stderr_path=str(self.work_dir / "server.stderr.log"), name=spec.name))
        self._uid = uuid.uuid4().hex[:8]
        self._free: list[int] = []
        self._slots = 0
        self._gold: dict[str, str | None] = {}
        self._agent_tools: list[dict[str, Any]] | None = None
        import atexit

        atexit.register(self.close)

    # ---- Environment protocol --------------------------------------------------------------

    def tool_schemas(self) -> list[dict[str, Any]]:
        if self._agent_tools is None:
            hidden = self.spec.hidden_tools | ({self.spec.reset_tool} if self.spec.reset_tool else set())
            strip = frozenset({self.spec.isolation_arg} if self.spec.isolation_arg else set())
            self._agent_tools = openai_tools(self.server.tools(), hidden=frozenset(hidden), strip_args=strip)
        return copy.deepcopy(self._agent_tools)

    def system_prompt(self) -> str:
        return f"{self.spec.role}\n\n{self._policy}"

    def families(self) -> list[str]:
        return sorted({t.family for tasks in self.splits.values() for t in tasks})

    def make_task(self, family: str, seed: int) -> Task:
        try:
            return self._by_seed[(family, seed)]
        except KeyError:
            raise KeyError(f"{self.name}: no task of family {family!r} with seed {seed}") from None

    def start(self, task: Task) -> McpEpisode:
        import weakref

        slot = self._free.pop() if self._free else self._new_slot()
        key = self._key(f"slot{slot}")
        self.reset(key, task)
        episode = McpEpisode(self, task, key, self.user_factory(task))
        weakref.finalize(episode, self._free.append, slot)
        return episode

    # ---- extras: official split, expert, grading helpers ----------------------------------

    def official_splits(self) -> dict[str, list[Task]]:
        """The benchmark's own train/test split (never re-drawn by TRACE)."""
        return {name: list(tasks) for name, tasks in self.splits.items()}

    def demonstrate(self, task: Task, *, confirm: bool = True) -> tuple[list[Message], EpisodeResult]:
        """The gold-replay expert on ``task`` (the warm-start's demonstrations)."""
        return self.expert(task, confirm=confirm)

    # ---- target hooks (base.TargetHooks), derived from the tools, the task file and the gold ---

    def expert(self, task: Task, *, confirm: bool = True, via: Any = None, lacking: str | None = None,
               policy: Any = None) -> tuple[list[Message], EpisodeResult]:
        from .tau2 import demonstrate

        return demonstrate(via or self, task, confirm=confirm, lacking=lacking, policy=policy,
                           write_tools=self.spec.write_tools, auth_tools=self.spec.auth_tools)

    def next_move(self, task: Task, messages: list[Message], *, lacking: str | None = None) -> Any:
        from .tau2 import gold_next_move

        return gold_next_move(task, messages, write_tools=self.spec.write_tools, auth_tools=self.spec.auth_tools,
                              lacking=lacking)

    def ablations(self) -> dict[str, str]:
        """The gold replay's ablations (``tau2.GOLD_ABLATIONS``); ``tau2.NO_ABLATION`` says why
        the other heuristic capabilities have none here."""
        from .tau2 import GOLD_ABLATIONS

        return dict(GOLD_ABLATIONS)

    def adversaries(self) -> dict[str, Any]:
        from .tau2 import gold_adversaries

        return gold_adversaries(write_tools=self.spec.write_tools, auth_tools=self.spec.auth_tools)

    def tool_classes(self) -> dict[str, frozenset[str]]:
        """Writes are the server's own write-tool list; ``auth`` the calls that identify the user."""
        return {"auth": self.spec.auth_tools, "write": self.spec.write_tools, "account": self.spec.account_tools}

    def synthetic_task(self, family: str, seed: int, *, scenario: dict[str, Any], difficulty: dict[str, Any]) -> Task:
        """An official TRAIN task of ``family`` (``seed`` modulo their number, in file order), never
        a test task. The server owns one database, so there is no new database per seed; of the
        spec's knobs only the hint and the family weights act here (:meth:`synthesis_knobs`)."""
        from dataclasses import replace

        pool = self._train_family(family)
        return replace(pool[seed % len(pool)], seed=seed)

    def synthesis_knobs(self) -> frozenset[str]:
        return frozenset({"hint_share", "family_bias"})

    def family_complexity(self, family: str) -> float:
        """Mean number of gold actions of the family's official train tasks."""
        pool = self._train_family(family)
        return sum(len(t.gold_actions) for t in pool) / len(pool)

    def _train_family(self, family: str) -> list[Task]:
        pool = [t for t in self.splits["train"] if t.family == family]
        if not pool:
            raise ValueError(f"{self.name}: no official train task of family {family!r} (synthetic tasks come from the "
                             f"train split only); train families: {sorted({t.family for t in self.splits['train']})}")
        return pool

    def agent_tool_names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tool_schemas()}

    def call_isolated(self, key: str, name: str, arguments: dict[str, Any]) -> ToolReply:
        if self.spec.isolation_arg:
            arguments = {**arguments, self.spec.isolation_arg: key}
        return self.server.call(name, arguments)

    def reset(self, key: str, task: Task) -> None:
        if not self.spec.reset_tool:
            return
        args = {**self.spec.reset_arguments, "task_id": task.scenario.get("tau2_id"), self.spec.isolation_arg: key}
        reply = self.server.call(self.spec.reset_tool, args)
        if reply.is_error:
            raise McpServerError(f"{self.name}: {self.spec.reset_tool} failed for {key}: {reply.text[:300]}")

    def read_db(self, key: str) -> Any:
        if self.spec.read_state is None or not self.spec.state_dir_env:
            return None
        return self.spec.read_state(self.work_dir / "state", key)

    def gold_db_hash(self, task: Task) -> str | None:
        """Hash of the database after replaying ``task``'s gold actions on a fresh state."""
        from .tau2 import db_hash

        # Only writes change the database (the server's own write-tool list), so reads are not
        # replayed, and every task without a write shares the hash of the fresh database.
        writes = [a for a in task.gold_actions if a["name"] in self.spec.write_tools]
        # By what the replay depends on, so the synthetic tasks drawn from one task share it.
        cache = json.dumps([task.scenario.get("tau2_id"), writes], sort_keys=True) if writes else "<fresh>"
        if cache not in self._gold:
            key = self._key("gold")
            self.reset(key, task)
            generation = self.server.starts
            for action in writes:
                self.call_isolated(key, action["name"], json.loads(json.dumps(action["arguments"])))
            if self.server.starts != generation:
                raise McpServerError(f"{self.name}: the server was restarted while replaying the gold actions of {task.task_id}")
            db = self.read_db(key)
            self._gold[cache] = None if db is None else db_hash(db)
        return self._gold[cache]

    def close(self) -> None:
        """Stop the server and remove this environment's scratch states (and forget this
        environment in the registry's cache, so the next ``get_environment`` makes a fresh one)."""
        import shutil

        from . import _CACHE

        self.server.stop()
        shutil.rmtree(self.work_dir, ignore_errors=True)
        if _CACHE.get(self.name) is self:
            del _CACHE[self.name]

    def _new_slot(self) -> int:
        self._slots += 1
        return self._slots - 1

    def _key(self, suffix: str) -> str:
        return f"trace-{self._uid}/{suffix}"
