"""Decision points from logged trajectories: cut before the first LACKING step, replay, never train on it.

The steps come from Step 1's labels: the heuristic analyst names, on every ablated retail expert's
trajectory, a step before which the full expert, taking over, solves the task; the store keeps the
step and gives it back (a store from before steps gains the column and keeps its labels).

The logged trajectory is the retail expert lacking confirm_before_writing (it cancels without
asking); its step label marks that write as LACKING. The episode opened from it must show exactly
the logged conversation before the write, continue from the replayed state (authenticated, order
looked up), reward an agent that asks before writing, and keep the prefix out of the loss
(env_mask 0, inside prompt_len).
"""

from __future__ import annotations

import copy
from collections import Counter

import duckdb
import pytest

from trace_assets.agent.backends import Generation
from trace_assets.agent.chat import render
from trace_assets.agent.rollout import RolloutConfig, run_rollouts
from trace_assets.envs import get_environment
from trace_assets.envs.base import target_hook
from resources.store import TraceStore
from trace_assets.envs.expert import play
from trace_assets.envs.retail.expert import ABLATIONS, demonstrate, next_move
from trace_assets.identify.capabilities import Capability, Label
from trace_assets.identify.heuristic import CATALOGUE, HeuristicAnalyst
from trace_assets.synthesize.prefix import (
    LoggedPrefixEnv,
    PrefixError,
    cut_before,
    first_lacking_step,
    logged_prefixes,
)

CAP = "confirm_before_writing"


@pytest.fixture(scope="module")
def logged():
    target = get_environment("retail")
    task = target.make_task("cancel_pending", 7)
    messages, result = demonstrate(target, task, confirm=False)
    assert result.reward == 0.0  # the write without asking does not count
    writes = target_hook(target, "tool_classes")()["write"]
    step = next(i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("tool_calls")
                and m["tool_calls"][0]["function"]["name"] in writes)
    trajectory = {"trajectory_id": "logged-1", "task_id": task.task_id, "messages": messages}
    return target, task, trajectory, step


def test_the_cut_is_before_the_first_lacking_step(logged):
    target, task, trajectory, step = logged
    labels = [Label("logged-1", CAP, 1, "LACKING", step=step + 2), Label("logged-1", CAP, 0, "LACKING", step=step),
              Label("logged-1", CAP, 2, "PRESENT"), Label("logged-1", CAP, 3, "LACKING"),
              Label("logged-1", "ground_arguments", 0, "LACKING", step=2)]
    assert first_lacking_step(labels, "logged-1", CAP) == step
    unlabelled = {**trajectory, "trajectory_id": "logged-2"}
    [prefix] = logged_prefixes([trajectory, unlabelled], labels, CAP, target)
    assert prefix.step == step and list(prefix.messages) == trajectory["messages"][:step]
    assert prefix.task == task
    with pytest.raises(PrefixError, match="assistant turn"):
        cut_before(trajectory["messages"], step + 1)  # the write's tool observation
    with pytest.raises(PrefixError, match="no system message"):
        cut_before(trajectory["messages"][1:], step - 1)


def test_the_episode_continues_from_the_replayed_state(logged):
    target, task, trajectory, step = logged
    env = LoggedPrefixEnv(target, logged_prefixes([trajectory], [Label("logged-1", CAP, 0, "LACKING", step=step)], CAP, target))
    assert env.families() == ["cancel_pending"] and env.name == f"logged_{CAP}"
    [t] = env.sample_tasks(1, offset=5)
    assert t == env.make_task("cancel_pending", 3) and t.meta["step"] == step
    episode = env.start(t)
    assert episode.initial_messages() == trajectory["messages"][:step]
    assert episode.inner.result().info["authenticated"]
    # The agent makes the decisive move as the full expert would: it asks, then writes.
    confirmed, _ = demonstrate(target, task)
    assert confirmed[:step] == trajectory["messages"][:step]
    for message in confirmed[step:]:
        if message["role"] != "assistant":
            continue
        if message.get("tool_calls"):
            fn = message["tool_calls"][0]["function"]
            assert not episode.call_tool(fn["name"], copy.deepcopy(fn["arguments"])).startswith("Error:")
        else:
            episode.user_reply(message["content"])
    result = episode.result()
    assert result.success and result.info["decision_point"] == {
        "source": "logged", "trajectory_id": "logged-1", "capability": CAP, "step": step, "prefix_messages": step}


def test_a_log_that_does_not_reproduce_is_refused(logged):
    target, _, trajectory, step = logged
    tampered = copy.deepcopy(trajectory)
    first_tool = next(i for i, m in enumerate(tampered["messages"]) if m["role"] == "tool")
    tampered["messages"][first_tool]["content"] = '{"user_id": "someone_else"}'
    env = LoggedPrefixEnv(target, logged_prefixes([tampered], [Label("logged-1", CAP, 0, "LACKING", step=step)], CAP, target))
    with pytest.raises(PrefixError, match=f"diverges at message {first_tool}"):
        env.start(env.sample_tasks(1)[0])
    with pytest.raises(PrefixError, match="no logged trajectory"):
        LoggedPrefixEnv(target, [])


class _Script:
    """Emits one fixed assistant turn (a confirmation question), then says goodbye."""

    name = "script"

    def __init__(self, tokenizer, turns):
        self.tok, self.turns, self.calls = tokenizer, turns, 0

    def generate(self, prompts, params):
        text = (self.turns[self.calls] if self.calls < len(self.turns) else "Goodbye.") + "<|im_end|>"
        self.calls += 1
        ids = self.tok.encode(text, add_special_tokens=False)
        return [Generation(ids, self.tok.decode(ids), [0.0] * len(ids), "stop") for _ in prompts]


def test_the_prefix_is_prompt_never_trained_on(logged, tokenizer):
    target, task, trajectory, step = logged
    env = LoggedPrefixEnv(target, logged_prefixes([trajectory], [Label("logged-1", CAP, 0, "LACKING", step=step)], CAP, target))
    confirmed, _ = demonstrate(target, task)
    question = confirmed[step]["content"]
    [rollout] = run_rollouts(env, env.sample_tasks(1), _Script(tokenizer, [question]), tokenizer,
                             RolloutConfig(max_steps=1, max_new_tokens=64))
    assert rollout.error is None and rollout.messages[:step] == trajectory["messages"][:step]
    prompt = tokenizer.encode(render(tokenizer, trajectory["messages"][:step], env.tool_schemas(),
                                     add_generation_prompt=True), add_special_tokens=False)
    assert rollout.token_ids[:rollout.prompt_len] == prompt
    assert sum(rollout.env_mask[:rollout.prompt_len]) == 0 and sum(rollout.env_mask) == rollout.n_generated > 0
    assert rollout.messages[step]["content"] == question and rollout.messages[step + 1]["role"] == "user"


def test_heuristic_steps_are_decision_points_the_full_expert_recovers_from():
    target = get_environment("retail")
    capabilities = [Capability(rule.name, rule.description) for rule in CATALOGUE]
    lacking = Counter()
    for capability in sorted(ABLATIONS):
        for family in target.families():
            task = target.make_task(family, 1)
            messages, result = demonstrate(target, task, lacking=capability)
            trajectory = {"trajectory_id": f"{capability}/{family}", "task_id": task.task_id, "messages": messages,
                          "info": result.info}
            [label] = [l for l in HeuristicAnalyst().label(trajectory, capabilities, 0) if l.capability == capability]
            if label.label != "LACKING":
                continue
            lacking[capability] += 1
            assert label.step is not None and messages[label.step]["role"] == "assistant", (capability, family)
            env = LoggedPrefixEnv(target, logged_prefixes([trajectory], [label], capability, target))
            _, recovered = play(env, env.sample_tasks(1)[0], lambda t, m: next_move(task, m), strict=False)
            assert recovered.success, f"{capability} on {family}: the full expert fails from step {label.step}"
    assert set(lacking) == set(ABLATIONS)  # every ablation is caught at least once, so no case is vacuous


def test_the_store_keeps_steps_and_migrates_a_store_without_them(logged, tmp_path):
    target, _, trajectory, step = logged
    db = tmp_path / "trace.duckdb"
    with duckdb.connect(str(db)) as conn:  # a labels table from before steps, with one label in it
        conn.execute("CREATE TABLE labels (trajectory_id VARCHAR NOT NULL, capability VARCHAR NOT NULL, run INTEGER NOT "
                     "NULL, label VARCHAR NOT NULL, rationale VARCHAR NOT NULL, analyst VARCHAR NOT NULL, "
                     "dictionary_version VARCHAR NOT NULL, created_at TIMESTAMPTZ NOT NULL, "
                     "PRIMARY KEY (trajectory_id, capability, run, dictionary_version))")
        conn.execute(f"INSERT INTO labels VALUES ('old', '{CAP}', 0, 'LACKING', 'r', 'heuristic', 'v', now())")
    store = TraceStore(database=str(db))
    assert store.insert_labels([("logged-1", CAP, 0, "LACKING", "wrote at once", step),
                                ("logged-1", CAP, 1, "LACKING", "no step named"),
                                ("logged-1", "ground_arguments", 0, "PRESENT", "ok", None)], analyst="heuristic",
                               version="v") == 3
    assert store.query("SELECT count(*) AS n FROM labels").item() == 4  # the old label is kept, its step NULL
    [label] = store.lacking_steps("v", CAP)
    assert label == Label("logged-1", CAP, 0, "LACKING", "wrote at once", step)
    assert store.lacking_steps("v", CAP, ids=["other"]) == [] and store.lacking_steps("w", CAP) == []
    [prefix] = logged_prefixes([trajectory], store.lacking_steps("v", CAP), CAP, target)
    assert list(prefix.messages) == trajectory["messages"][:step]
