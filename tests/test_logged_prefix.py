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
import json
import re
from collections import Counter
from dataclasses import replace

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
from trace_assets.envs.base import EpisodeResult
from trace_assets.identify.heuristic import CATALOGUE, HeuristicAnalyst
from trace_assets.settings import SynthesisSettings
from trace_assets.synthesize import environment_of, isolation_markdown, logged_spec
from trace_assets.synthesize.build import LOGGED_WEAKER, build_logged_environment
from trace_assets.train.heldout import HELD_OUT_OFFSET
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


def _lacking_logs(target, n=20, capability=CAP):
    """Logs of the expert lacking ``capability`` on ``n`` write tasks, with the heuristic's labels."""
    capabilities = [Capability(rule.name, rule.description) for rule in CATALOGUE]
    trajectories, labels = [], []
    for seed in range(n):
        task = target.make_task(("cancel_pending", "modify_address", "return_delivered")[seed % 3], seed)
        messages, result = demonstrate(target, task, lacking=capability)
        trajectory = {"trajectory_id": f"log-{seed:02d}", "task_id": task.task_id, "messages": messages,
                      "info": result.info, "reward": result.reward, "success": result.success}
        trajectories.append(trajectory)
        labels += [l for l in HeuristicAnalyst().label(trajectory, capabilities, 0) if l.capability == capability]
    return trajectories, labels


def test_a_logged_environment_is_data_with_disjoint_sides_and_errors_that_name_the_field():
    target = get_environment("retail")
    trajectories, labels = _lacking_logs(target)
    spec = logged_spec({"name": CAP, "description": "d", "failure_modes": []},
                       logged_prefixes(trajectories, labels, CAP, target), target)
    spec = json.loads(json.dumps(spec))  # what the store keeps
    env = environment_of(spec, target)
    assert isinstance(env, LoggedPrefixEnv) and env.spec == spec
    held = {p["trajectory_id"] for p in spec["prefixes"] if p["side"] == "held_out"}
    assert held and len(held) < len(spec["prefixes"])
    evaluated = env.sample_tasks(100, offset=HELD_OUT_OFFSET)
    assert sorted(t.meta["trajectory_id"] for t in evaluated) == sorted(held)  # each once, never cycled
    trained = env.sample_tasks(3 * len(spec["prefixes"]), offset=0)
    assert not held & {t.meta["trajectory_id"] for t in trained}
    episode = env.start(evaluated[0])
    assert episode.initial_messages() == next(p["messages"] for p in spec["prefixes"]
                                              if p["trajectory_id"] == evaluated[0].meta["trajectory_id"])
    for mutate, field in [(lambda s: s["prefixes"][1].update(step="3"), "prefixes[1].step"),
                          (lambda s: s["prefixes"][2].update(side="test"), "prefixes[2].side"),
                          (lambda s: s["prefixes"][0]["messages"].pop(), "prefixes[0].messages"),
                          (lambda s: s["prefixes"][3].update(task_id="retail/teleport/1"), "prefixes[3].task_id"),
                          (lambda s: s["capability"].update(name="../etc"), "capability.name"),
                          (lambda s: s["target"].update(env="tau2_airline"), "target.env")]:
        bad = copy.deepcopy(spec)
        mutate(bad)
        with pytest.raises(PrefixError, match=re.escape(field)):
            environment_of(bad, target)


class _Rollouts:
    """Calibration's rollout function without a model: every other episode of a group succeeds."""

    def __init__(self):
        self.rounds = []

    def __call__(self, env, tasks, k, temperature):
        assert all(t.meta["trajectory_id"] in {env.prefixes[i].trajectory_id for i in env.sides["train"]} for t in tasks)
        self.rounds.append(len(tasks) * k)
        return [EpisodeResult(reward=float(i % 2), success=bool(i % 2), info={}) for i in range(len(tasks) * k)]


def test_the_logged_build_quarantines_what_does_not_replay_and_its_isolation_can_fail():
    target = get_environment("retail")
    syn = SynthesisSettings(calibration_seeds=4, calibration_k=2)
    capability = {"name": CAP, "description": "confirm", "failure_modes": []}
    trajectories, labels = _lacking_logs(target)
    tampered = copy.deepcopy(trajectories[0])
    tampered["trajectory_id"] = "log-tampered"
    first_tool = next(i for i, m in enumerate(tampered["messages"]) if m["role"] == "tool")
    tampered["messages"][first_tool]["content"] = '{"user_id": "someone_else"}'
    labels.append(replace(labels[0], trajectory_id="log-tampered"))
    built = build_logged_environment(capability, trajectories + [tampered], labels, target, _Rollouts(), syn)
    assert built.passed and built.calibration.rounds[0]["informative_share"] == 1.0
    [row] = built.isolation["rows"]
    assert row["agent"] == CAP and row["n"] == len(trajectories) and row["success"] == 0.0  # it wrote without asking
    assert built.isolation["method"] == LOGGED_WEAKER and sum(built.isolation["sides"].values()) == len(trajectories)
    assert built.rejected == built.isolation["quarantined"] and "log-tampered" in built.rejected[0]
    assert "(weaker)" in isolation_markdown([built.isolation])
    # A label that blames a conversation the agent got right: the logged agent passes, isolation fails.
    solved, _ = _lacking_logs(target, capability="ground_arguments")  # these write only after a yes
    solved = [t for t in solved if t["success"]]
    wrong = [Label(t["trajectory_id"], CAP, 0, "LACKING", "wrongly blamed", step=next(
        i for i, m in enumerate(t["messages"]) if m["role"] == "assistant" and i > 2)) for t in solved]
    built = build_logged_environment(capability, solved, wrong, target, _Rollouts(), syn)
    assert not built.passed and "the logged agent still succeeds on 1.00" in built.isolation["reason"]
