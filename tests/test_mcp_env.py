"""MCP servers as environments: tau2-bench's airline domain (fidelity) and a misbehaving server
(robustness). The airline server is started once per test session (conftest ``airline_env``)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from trace_assets.agent.backends import Generation
from trace_assets.agent.rollout import RolloutConfig, rollout_to_record, run_rollouts
from trace_assets.envs.base import Episode, Task
from trace_assets.envs.mcp import McpSchemaError, McpServer, McpServerConfig, McpServerError
from trace_assets.envs.splits import make_splits
from trace_assets.envs.tau2 import LlmUser, ScriptedUser, Tau2FormatError, Transcript, grade, load_tasks

pytest.importorskip("mcp")
FAKE_SERVER = str(Path(__file__).with_name("fake_mcp_server.py"))
GRADABLE_WITHOUT_LLM = {"DB", "ACTION", "COMMUNICATE"}
CLOSING = "Is there anything else I can help you with?"


def _all(env) -> list[Task]:
    return env.splits["train"] + env.splits["test"]


# ---------------------------------------------------------------- the airline domain


def test_official_split_tools_and_policy(airline_env):
    env = airline_env
    split = json.loads(env.spec.split_path.read_text())
    assert [t.scenario["tau2_id"] for t in env.splits["train"]] == split["train"] and len(split["train"]) == 30
    assert [t.scenario["tau2_id"] for t in env.splits["test"]] == split["test"] and len(split["test"]) == 20
    names = [t["function"]["name"] for t in env.tool_schemas()]
    assert len(names) == 14 and "reset_state" not in names and "get_call_log" not in names
    assert all("state_key" not in t["function"]["parameters"]["properties"] for t in env.tool_schemas())
    assert "Airline Agent Policy" in env.system_prompt()
    assert isinstance(env.start(env.splits["train"][0]), Episode)
    # task_splits keeps the official split: capped per family, nothing crosses train/test
    splits = make_splits(env, demo_per_family=1, train_per_family=2, test_per_family=1, seed=0)
    official_test = {t.task_id for t in env.splits["test"]}
    assert {t.task_id for t in splits["test"]} <= official_test
    assert not ({t.task_id for t in splits["demo"] + splits["train"]} & official_test)
    assert not ({t.task_id for t in splits["demo"]} & {t.task_id for t in splits["train"]})
    assert make_splits(env, demo_per_family=1, train_per_family=2, test_per_family=1, seed=7) == splits


def test_gold_replay_expert_scores_one_on_every_task_gradable_without_an_llm(airline_env):
    """The fidelity oracle: all 50 airline tasks have reward basis DB + COMMUNICATE."""
    gradable = [t for t in _all(airline_env) if set(t.meta["tau2"]["evaluation_criteria"]["reward_basis"]) <= GRADABLE_WITHOUT_LLM]
    assert len(gradable) == 50
    for task in gradable:
        messages, result = airline_env.demonstrate(task)
        assert result.reward == 1.0, (task.task_id, result.info)
        assert all(v is True for v in result.info["graded"].values()) and set(result.info["graded"]) == {"DB", "COMMUNICATE"}
        assert result.info["nl_assertions_outside_basis"] == "not graded"  # present, never counted as passed
        assert result.info["n_writes"] == len(result.info["gold_writes"])


def test_do_nothing_agent_scores_zero_on_every_task_that_needs_a_write(airline_env):
    env = airline_env
    fresh = env.gold_db_hash(next(t for t in _all(env) if t.family == "no_write"))
    needs_write = [t for t in _all(env) if env.gold_db_hash(t) != fresh]
    assert len(needs_write) == 26  # the other 24 leave the database as it was
    for task in needs_write:
        episode = env.start(task)
        episode.initial_messages()
        assert episode.user_reply(CLOSING)[1] is True
        result = episode.result()
        assert result.reward == 0.0 and result.info["graded"]["DB"] is False, task.task_id


def test_unknown_tool_and_bad_arguments_are_agent_errors(airline_env):
    episode = airline_env.start(airline_env.splits["train"][1])
    assert episode.call_tool("reset_state", {}).startswith("Error: Tool 'reset_state' not found")
    assert episode.call_tool("fly_me_to_the_moon", {}).startswith("Error:")
    assert episode.call_tool("get_user_details", {"user_id": "nobody"}).startswith("Error: User nobody not found")
    assert episode.call_tool("get_user_details", {"wrong": 1}).startswith("Error:")
    observation = json.loads(episode.call_tool("get_reservation_details", {"reservation_id": "EHGLP3"}))
    assert observation["reservation_id"] == "EHGLP3"
    assert len(episode.result().info["tool_errors"]) == 4 and "env_error" not in episode.result().info


def test_episodes_are_isolated(airline_env):
    task = next(t for t in _all(airline_env) if t.family == "cancel_reservation")
    write = next(a for a in task.gold_actions if a["name"] == "cancel_reservation")
    a, b = airline_env.start(task), airline_env.start(task)
    a.call_tool(write["name"], write["arguments"])
    status = lambda ep: json.loads(ep.call_tool("get_reservation_details", write["arguments"]))["status"]
    assert status(a) == "cancelled" and status(b) != "cancelled"


def test_killing_the_server_mid_episode_gives_an_error_episode_and_a_restart(airline_env, tokenizer):
    env = airline_env
    task = env.splits["train"][1]
    killed = []

    class KillingBackend:
        name = "scripted"

        def generate(self, prompts, params):
            if not killed:  # the server dies while the agent is thinking
                killed.append(env.server.pid)
                os.kill(env.server.pid, signal.SIGKILL)
            text = '<tool_call>{"name": "get_user_details", "arguments": {"user_id": "emma_kim_9957"}}</tool_call><|im_end|>'
            ids = tokenizer.encode(text, add_special_tokens=False)
            return [Generation(ids, tokenizer.decode(ids), [0.0] * len(ids), "stop") for _ in prompts]

    restarts = env.server.restarts
    [r] = run_rollouts(env, [task], KillingBackend(), tokenizer, RolloutConfig(max_steps=2, max_new_tokens=64))
    assert r.stop_reason == "error" and "tools/call 'get_user_details'" in r.error
    assert r.result.reward == 0.0 and "env_error" in r.result.info
    record = rollout_to_record(r, policy="base", source="test", split="train")
    assert record["info"]["runner_error"] and record["info"]["env_error"]
    # the next episode runs on a restarted server
    episode = env.start(task)
    assert json.loads(episode.call_tool("get_user_details", {"user_id": "emma_kim_9957"}))["user_id"] == "emma_kim_9957"
    assert env.server.restarts == restarts + 1 and env.server.pid not in killed


# ---------------------------------------------------------------- a misbehaving server


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory):
    server = McpServer(McpServerConfig(command=sys.executable, args=(FAKE_SERVER,), call_timeout_s=2,
                                       stderr_path=str(tmp_path_factory.mktemp("fake") / "stderr.log"), name="fake"))
    yield server
    server.stop()
    assert not server.alive


@pytest.mark.parametrize("tool, message", [
    ("garble", "malformed output from the server"),
    ("hang", "timed out"),
    ("crash", "Connection closed"),
    ("forget", "Unknown tool: forget"),
])
def test_server_faults_raise_clear_errors_and_the_server_restarts(fake_server, tool, message):
    assert json.loads(fake_server.call("echo", {"text": "hi"}).text) == {"echo": {"text": "hi"}}
    restarts = fake_server.restarts
    with pytest.raises(McpServerError, match=message) as err:
        fake_server.call(tool, {})
    assert f"fake: tools/call {tool!r}" in str(err.value)
    assert json.loads(fake_server.call("echo", {"text": "again"}).text) == {"echo": {"text": "again"}}
    assert fake_server.restarts == restarts + 1


def test_a_tool_schema_that_is_not_json_schema_is_named():
    server = McpServer(McpServerConfig(command=sys.executable, args=(FAKE_SERVER, "bad_schema"), name="fake"))
    with pytest.raises(McpSchemaError, match=r"fake: tool 'broken': inputSchema is not valid JSON Schema at properties/x/type"):
        server.start()
    server.stop()


def test_a_server_that_cannot_start_is_a_clear_error():
    server = McpServer(McpServerConfig(command=sys.executable, args=("-c", "import sys; sys.exit(5)"), start_timeout_s=20, name="dead"))
    with pytest.raises(McpServerError, match="dead: could not start"):
        server.start()
    server.stop()


# ---------------------------------------------------------------- grading rules and users


def _task(criteria: dict, instructions=None) -> Task:
    record = {"id": "9", "evaluation_criteria": criteria,
              "user_scenario": {"instructions": instructions or {"reason_for_call": "Change my flight.", "known_info": "I am Ann."}}}
    return Task(task_id="t/9", env="t", family="x", seed=9, instruction="", scenario={"tau2_id": "9", **record["user_scenario"]},
                gold_actions=[], required_info=criteria.get("communicate_info", []), expected_state_hash="", meta={"tau2": record})


def test_grading_follows_the_reward_basis():
    gold = {"name": "cancel_reservation", "arguments": {"reservation_id": "R1", "reason": "x"}, "compare_args": ["reservation_id"]}
    task = _task({"actions": [gold], "communicate_info": ["1,000"], "nl_assertions": ["Agent is polite."],
                  "reward_basis": ["DB", "ACTION", "COMMUNICATE"]})
    good = Transcript(calls=[{"name": "cancel_reservation", "arguments": {"reservation_id": "R1", "reason": "y"}, "ok": True}],
                      assistant_texts=["You get 1,000 back."], stopped=True)
    r = grade(task, good, final_db_hash="h", gold_db_hash="h")
    assert r.reward == 0.0 and r.info["graded"]["COMMUNICATE"] is False  # tau2 strips commas from the message only
    task = _task({"actions": [gold], "communicate_info": ["1000"], "nl_assertions": ["Agent is polite."],
                  "reward_basis": ["DB", "ACTION", "COMMUNICATE"]})
    assert grade(task, good, final_db_hash="h", gold_db_hash="h").reward == 1.0
    assert grade(task, good, final_db_hash="h", gold_db_hash="other").info["graded"]["DB"] is False
    wrong = Transcript(calls=[{"name": "cancel_reservation", "arguments": {"reservation_id": "R2"}, "ok": True}],
                       assistant_texts=good.assistant_texts, stopped=True)
    assert grade(task, wrong, final_db_hash="h", gold_db_hash="h").info["graded"]["ACTION"] is False
    unfinished = Transcript(calls=good.calls, assistant_texts=good.assistant_texts, stopped=False)
    assert grade(task, unfinished, final_db_hash="h", gold_db_hash="h").reward == 0.0  # premature termination


def test_nl_assertions_are_not_graded_without_a_judge_and_never_pass():
    task = _task({"actions": [], "communicate_info": [], "nl_assertions": ["Agent refuses."], "reward_basis": ["DB", "NL_ASSERTION"]})
    done = Transcript(assistant_texts=["No."], stopped=True)
    r = grade(task, done, final_db_hash="h", gold_db_hash="h")
    assert r.info["graded"] == {"DB": True, "NL_ASSERTION": "not graded"} and r.reward == 0.0 and not r.info["fully_graded"]
    judged = grade(task, done, final_db_hash="h", gold_db_hash="h", judge=lambda t, tr, a: [True] * len(a))
    assert judged.reward == 1.0 and judged.info["graded"]["NL_ASSERTION"] is True
    assert grade(task, done, final_db_hash=None, gold_db_hash="h").info["graded"]["DB"] == "not graded"


def test_bad_task_files_name_file_and_field(tmp_path):
    tasks, split = tmp_path / "tasks.json", tmp_path / "split.json"
    split.write_text(json.dumps({"train": ["1"], "test": []}))
    tasks.write_text("[{\"id\": \"1\",")
    with pytest.raises(Tau2FormatError, match=r"tasks.json: line 1: not JSON"):
        load_tasks(tasks, split, env="t", write_tools=frozenset())
    tasks.write_text(json.dumps([{"id": "1", "user_scenario": {"instructions": "x"}}]))
    with pytest.raises(Tau2FormatError, match=r"task '1': missing object field 'evaluation_criteria'"):
        load_tasks(tasks, split, env="t", write_tools=frozenset())
    tasks.write_text(json.dumps([{"id": "1", "user_scenario": {"instructions": "x"}, "evaluation_criteria": {"actions": [{"arguments": {}}]}}]))
    with pytest.raises(Tau2FormatError, match=r"actions\[0\] needs 'name'"):
        load_tasks(tasks, split, env="t", write_tools=frozenset())
    tasks.write_text(json.dumps([{"id": "1", "user_scenario": {"instructions": "x"}, "evaluation_criteria": {}}]))
    split.write_text(json.dumps({"train": ["1", "2"], "test": []}))
    with pytest.raises(Tau2FormatError, match=r"split.json: train: task ids not in tasks.json: \['2'\]"):
        load_tasks(tasks, split, env="t", write_tools=frozenset())


def test_scripted_user_is_deterministic_and_stops():
    user = ScriptedUser(_task({}))
    assert user.opening() == "Change my flight."
    assert user.reply("What is your user id?") == "I am Ann."
    assert user.reply("I will change it. Do you confirm? (yes/no)").startswith("Yes")
    assert not user.done and user.reply(CLOSING) == "###STOP###" and user.done


def test_llm_user_follows_tau2_rules_and_stop_tokens():
    from tests.openai_server import ScriptedOpenAI
    from trace_assets.llm_client import ChatClient

    with ScriptedOpenAI(["I want to change my flight.", "My user id is ann_1.", "Thanks. ###STOP###"]) as server:
        user = LlmUser(_task({}), ChatClient(base_url=server.base_url, model="user"))
        assert user.opening() == "I want to change my flight."
        assert user.reply("Your user id?") == "My user id is ann_1." and not user.done
        assert user.reply("Done.").endswith("###STOP###") and user.done
        first = server.requests[0]["messages"]
    assert "###STOP###" in first[0]["content"] and "Reason for call:\nChange my flight." in first[0]["content"]
    assert first[1] == {"role": "user", "content": "Hi! How can I help you today?"}


def test_confirmations_and_unconfirmed_writes_are_recorded(airline_env):
    task = next(t for t in _all(airline_env) if t.family == "cancel_reservation")
    _, asked = airline_env.demonstrate(task, confirm=True)
    assert asked.info["confirmations"] >= 1 and asked.info["policy_violations"] == [] and asked.reward == 1.0
    _, rushed = airline_env.demonstrate(task, confirm=False)
    assert [v["rule"] for v in rushed.info["policy_violations"]] == ["confirm_before_write"] * len(rushed.info["gold_writes"])
    assert rushed.info["authenticated"] == any(a["name"] == "get_user_details" for a in task.gold_actions)


def test_llm_judge_grades_nl_assertions_and_settings_wire_users():
    from tests.openai_server import ScriptedOpenAI
    from trace_assets.envs.tau2 import judge_from_settings, llm_judge, user_factory
    from trace_assets.llm_client import ChatClient
    from trace_assets.settings import UserSettings

    task = _task({"actions": [], "communicate_info": [], "nl_assertions": ["Agent refuses.", "Agent is brief."],
                  "reward_basis": ["NL_ASSERTION"]})
    done = Transcript(assistant_texts=["No."], user_texts=["Cancel it.", "###STOP###"], stopped=True)
    verdict = json.dumps({"results": [{"expectedOutcome": "Agent refuses.", "reasoning": "", "metExpectation": True},
                                      {"expectedOutcome": "Agent is brief.", "reasoning": "", "metExpectation": False}]})
    with ScriptedOpenAI(["not json", verdict]) as server:
        judge = llm_judge(ChatClient(base_url=server.base_url, model="judge"))
        r = grade(task, done, final_db_hash=None, gold_db_hash=None, judge=judge)
        assert "user: Cancel it.\nassistant: No." in server.requests[0]["messages"][1]["content"]
    assert r.info["graded"] == {"NL_ASSERTION": False} and r.reward == 0.0 and r.info["fully_graded"]
    assert judge_from_settings(UserSettings()) is None
    assert isinstance(user_factory(UserSettings(kind="llm"))(task), LlmUser)
    assert isinstance(user_factory(UserSettings())(task), ScriptedUser)
    with pytest.raises(ValueError, match="kind must be"):
        user_factory(UserSettings(kind="oracle"))


def test_a_failing_user_simulator_gives_an_error_episode(airline_env):
    from trace_assets.envs.mcp import McpEpisode

    class BrokenUser(ScriptedUser):
        kind = "llm"

        def reply(self, agent_text):
            raise ConnectionError("user endpoint is down")

    task = airline_env.splits["train"][0]
    episode = McpEpisode(airline_env, task, airline_env._key("broken-user"), BrokenUser(task))
    airline_env.reset(episode.key, task)
    episode.initial_messages()
    with pytest.raises(ConnectionError):
        episode.user_reply("How can I help?")
    result = episode.result()
    assert result.reward == 0.0 and result.info["env_error"].startswith("user simulator: ConnectionError")


def test_a_server_that_died_between_calls_is_restarted_before_the_next(fake_server):
    fake_server.call("echo", {})
    restarts, pid = fake_server.restarts, fake_server.pid
    os.kill(pid, signal.SIGKILL)
    for _ in range(50):  # until the kernel has reported the death
        if not fake_server.alive:
            break
        import time

        time.sleep(0.05)
    assert not fake_server.alive
    assert json.loads(fake_server.call("echo", {"text": "x"}).text) == {"echo": {"text": "x"}}
    assert fake_server.restarts == restarts + 1 and fake_server.pid != pid


def test_an_episode_whose_server_was_restarted_is_an_error_even_if_the_call_succeeds(airline_env):
    import time

    task = airline_env.splits["train"][1]
    episode = airline_env.start(task)
    os.kill(airline_env.server.pid, signal.SIGKILL)
    while airline_env.server.alive:
        time.sleep(0.05)
    with pytest.raises(McpServerError, match="the server was restarted during this episode"):
        episode.call_tool("get_user_details", {"user_id": "emma_kim_9957"})
    assert "restarted" in episode.result().info["env_error"]
    fresh = airline_env.start(task)  # episodes started after the restart are fine
    assert json.loads(fresh.call_tool("get_user_details", {"user_id": "emma_kim_9957"}))["user_id"] == "emma_kim_9957"
