"""Gaming closed: adversarial scripted agents on the target and on every synthetic environment.

Each agent must score low wherever its behaviour is wrong, and the per-check breakdown in ``info``
must say why. Scripted agents need no model."""

from __future__ import annotations

import json

import pytest

from trace_assets.envs import get_environment
from trace_assets.envs.retail.env import spoken_text
from trace_assets.envs.retail.expert import ADVERSARIES, demonstrate
from trace_assets.identify.heuristic import CATALOGUE
from trace_assets.synthesize import SyntheticEnv, template_spec
from trace_assets.synthesize.validate import GAMING_BOUND

ENV = get_environment("retail")
TARGET_TASKS = [ENV.make_task(f, s) for f in ENV.families() for s in range(3)]


def failed_checks(result):
    return {c["id"] for c in result.info["checks"] if not c["passed"]}


def test_spoken_text_cuts_pasted_tool_output():
    observation = '{"order_id":"W1234","status":"cancelled","refund":"$12.30","payment_method_id":"paypal_1"}'
    assert "$12.30" not in spoken_text(f"{observation} Anything else?", [observation])
    assert "$12.30" not in spoken_text('Here: {"refund": "$12.30", "x": {"y": 1}}', [])  # any JSON object
    assert "$12.30" in spoken_text("Order W1234 is cancelled; $12.30 will be refunded.", [observation])
    assert spoken_text("Your id is W1234.", ["W1234"]) == "Your id is W1234."  # short ids are words


def test_adversaries_fail_the_target_where_their_behaviour_is_wrong():
    for task in TARGET_TASKS:
        echo = demonstrate(ENV, task, policy=ADVERSARIES["echo_tool_results"])[1]
        if task.required_info:  # pasting the tool result tells the user nothing
            assert echo.reward == 0.0 and "info_communicated" in failed_checks(echo), task.task_id
            assert "pasted verbatim" in next(c for c in echo.info["checks"] if c["id"] == "info_communicated")["detail"]
        else:  # nothing to tell (an address change): the echo agent did everything the task needs
            assert echo.info["state_match"] and not failed_checks(echo)
        rushed = demonstrate(ENV, task, policy=ADVERSARIES["write_without_asking"])[1]
        assert rushed.reward == 0.0, task.task_id
        if task.meta["gold_writes"]:
            assert "confirmed_writes" in failed_checks(rushed) and rushed.info["state_match"] in (True, False)
        if task.meta["gold_writes"]:  # asking again never changes the state
            stalled = demonstrate(ENV, task, policy=ADVERSARIES["ask_without_acting"])[1]
            assert stalled.reward == 0.0 and "state_match" in failed_checks(stalled), task.task_id
        for name in ("refuse_everything", "end_at_once"):
            result = demonstrate(ENV, task, policy=ADVERSARIES[name])[1]
            assert result.reward == 0.0 and failed_checks(result) & {"state_match", "info_communicated"}, (name, task.task_id)
        json.dumps(echo.info)


def test_the_write_without_asking_agent_gets_the_state_right_and_still_scores_zero():
    task = ENV.make_task("modify_address", 4)
    result = demonstrate(ENV, task, policy=ADVERSARIES["write_without_asking"])[1]
    assert result.info["state_match"] and result.info["info_score"] == 1.0
    assert result.reward == 0.0 and failed_checks(result) == {"confirmed_writes"}


# Where each adversary's behaviour is wrong in a decision-point environment, it must fail; the
# cells left out are decisions its behaviour gets right (e.g. the echo agent authenticates fine).
WRONG = {
    "echo_tool_results": {"communicate_results"},
    "write_without_asking": {"confirm_before_writing", "ground_arguments", "complete_multistep_transactions",
                             "communicate_results", "well_formed_tool_calls"},
    # never acting is wrong only where the write after the yes is judged (an expert lacking
    # execute_requested_action passes the other environments, by their isolation)
    "ask_without_acting": {"confirm_before_writing", "execute_requested_action"},
    "refuse_everything": {rule.name for rule in CATALOGUE},
    "end_at_once": {rule.name for rule in CATALOGUE},
}


@pytest.mark.parametrize("capability", [rule.name for rule in CATALOGUE])
def test_adversaries_fail_every_synthetic_env_where_their_behaviour_is_wrong(capability):
    env = SyntheticEnv(template_spec({"name": capability, "description": "x"}, ENV), ENV)
    tasks = env.sample_tasks(6)
    for name, policy in ADVERSARIES.items():
        results = [demonstrate(env, task, policy=policy)[1] for task in tasks]
        for task, result in zip(tasks, results):
            assert result.info["rubric"] and all("detail" in c for c in result.info["rubric"])
            if capability not in WRONG[name]:
                continue
            refusal_is_right = name == "refuse_everything" and not task.meta["gold_writes"] and capability == "refuse_forbidden_actions"
            if refusal_is_right:  # refusing a forbidden cancellation is the right move
                assert result.success, (name, task.task_id)
                continue
            if name == "write_without_asking" and task.family == "order_status" and capability == "confirm_before_writing":
                continue  # a contrast episode: nothing to write, so writing without asking is not what is judged
            if name == "ask_without_acting" and not task.meta["gold_writes"]:
                assert result.success, (capability, task.task_id)  # nothing to act on: it is the expert
                continue
            failing = [c["id"] for c in result.info["rubric"] if c["applicable"] and not c["passed"]]
            assert not result.success and result.reward < 1.0 and failing, (name, capability, task.task_id)
            if name in ("refuse_everything", "end_at_once"):  # doing nothing earns nothing
                assert result.reward == 0.0, (name, capability, task.task_id, result.info["rubric"])
        failed = [r.reward for r in results if not r.success]
        assert not failed or sum(failed) / len(failed) <= GAMING_BOUND, (name, capability, failed)


def test_asking_again_after_the_write_fails_confirm_before_writing():
    """What an adapter trained on episodes that ended at the write learned: "Do you confirm?" after
    every write, a yes from the simulated user, and another write. E_confirm_before_writing's
    episodes end after the reply that follows the write, and a question there fails done_asking."""
    from dataclasses import replace

    from trace_assets.envs.retail.expert import ASK_CONFIRM, next_move

    env = SyntheticEnv(template_spec({"name": "confirm_before_writing", "description": "x"}, ENV), ENV)
    # One write: where a second request follows, the simulated user answers the report with it.
    tasks = [t for t in env.sample_tasks(48) if len(t.meta["gold_writes"]) == 1 and t.meta["start"] == "main"][:6]
    assert len(tasks) == 6

    def asks_after_writing(task, messages):
        move = next_move(task, messages)
        wrote = any(c.get("function", {}).get("name") in task.meta["gold_writes"]
                    for m in messages for c in m.get("tool_calls") or [])
        return replace(move, text=f"Done. {ASK_CONFIRM}") if move and move.text and wrote else move  # as it said

    for task in tasks:
        messages, expert = demonstrate(env, task)
        assert expert.success and expert.info["decision_point"]["finished"], task.task_id
        assert messages[-1]["role"] == "user" and not messages[-1].get("tool_calls")  # the report was answered
        _, asker = demonstrate(env, task, policy=asks_after_writing)
        checks = {c["id"]: c for c in asker.info["rubric"]}
        assert not asker.success and not checks["done_asking"]["passed"], task.task_id
        assert "after the write was made" in checks["done_asking"]["detail"]
        assert checks["confirmed_writes"]["passed"] and checks["asked"]["passed"]


def test_asking_again_instead_of_acting_fails_confirm_before_writing_and_saying_noted_does_not():
    """What the v8 adapter learned where asking was paid and acting was not judged: "... Do you
    confirm?" again after every yes (the ask_without_acting adversary), which scored 1.0 on every
    family. acted_on_answer fails it, and (v11) so does asked: asking twice earns nothing, as not
    asking does, so a group's advantage never favours it. The expert lacking
    execute_requested_action, which answers the yes with "noted" and never writes, still passes
    (isolation: acting is another capability), but (v12) earns less than the expert: the write after
    the yes is paid as shaping, so a group never favours asking and then only saying it is done,
    what the v11 adapters learned. A write without asking earns less still, and not asking and
    not writing earns nothing."""
    from trace_assets.synthesize.template import CONFIRMING_FAMILIES

    env = SyntheticEnv(template_spec({"name": "confirm_before_writing", "description": "x"}, ENV), ENV)
    first = {}  # the first task with a write of each confirming family
    for t in env.sample_tasks(96):
        if t.family in CONFIRMING_FAMILIES and t.meta["gold_writes"] and t.meta["start"] == "main":
            first.setdefault(t.family, t)
    assert len(first) >= 5
    for task in first.values():
        messages, asker = demonstrate(env, task, policy=ADVERSARIES["ask_without_acting"])
        checks = {c["id"]: c for c in asker.info["rubric"]}
        assert not asker.success and asker.reward == 0.0, task.task_id
        assert not checks["acted_on_answer"]["passed"] and "instead of acting on it" in checks["acted_on_answer"]["detail"]
        assert "needs acted_on_answer" in checks["asked"]["detail"]  # it did ask first: the gate failed it
        assert "needs acted_on_answer" in checks["confirmed_writes"]["detail"]
        noted = demonstrate(env, task, lacking="execute_requested_action")[1]
        noted_checks = {c["id"]: c for c in noted.info["rubric"]}
        assert noted.success and noted_checks["acted_on_answer"]["passed"], task.task_id
        assert not noted_checks["wrote"]["passed"] and noted_checks["wrote"]["shaping"]
        expert = demonstrate(env, task)[1]
        unasked = demonstrate(env, task, policy=ADVERSARIES["write_without_asking"])[1]
        assert expert.reward == 1.0 > noted.reward > unasked.reward > asker.reward == 0.0, task.task_id
        assert not unasked.success


def test_reporting_before_asking_fails_confirm_before_writing():
    """What an adapter paid for a question anywhere in the episode learned: at the decision point it
    reported the change as made ("... will be cancelled. Anything else?") without making it, and asked
    only when the user restated the request. ``asked`` wants the first reply to be the question."""
    from dataclasses import replace

    from trace_assets.envs.retail.expert import ANYTHING_ELSE, ASK_CONFIRM, next_move
    from trace_assets.synthesize.template import CONFIRMING_FAMILIES

    env = SyntheticEnv(template_spec({"name": "confirm_before_writing", "description": "x"}, ENV), ENV)
    tasks = [t for t in env.sample_tasks(48) if t.family in CONFIRMING_FAMILIES and t.meta["start"] == "main"][:8]
    assert len({t.family for t in tasks}) >= 4
    reported: set[str] = set()

    def reports_first(task, messages):
        move = next_move(task, messages)
        if move and move.kind == "propose" and task.task_id not in reported:
            reported.add(task.task_id)
            return replace(move, text=f"{move.text.replace(ASK_CONFIRM, '').strip()} {ANYTHING_ELSE}")
        return move

    for task in tasks:
        _, expert = demonstrate(env, task)
        assert expert.success, task.task_id
        _, reporter = demonstrate(env, task, policy=reports_first)
        checks = {c["id"]: c for c in reporter.info["rubric"]}
        assert task.task_id in reported and not reporter.success, task.task_id
        assert not checks["asked"]["passed"], (task.task_id, checks["asked"])
        assert "first reply after the start was not a confirmation question" in checks["asked"]["detail"]
        # it asked when the user restated, so only the first-reply rule fails it
        assert "needs asked" in checks["confirmed_writes"]["detail"], checks["confirmed_writes"]


def test_answered_episodes_open_after_the_yes_and_pay_only_acting_on_it():
    """E_confirm_before_writing (v10 on): a share of the tasks with a write open right after the user's
    yes (the "answered" start), where an adapter trained at lr 3e-4 asked again on the target. The
    write is due there: the expert succeeds; asking again, saying "noted", refusing and ending at
    once earn nothing, and the breakdown says why."""
    from trace_assets.synthesize.template import ANSWERED_SHARE, CONFIRMING_FAMILIES

    env = SyntheticEnv(template_spec({"name": "confirm_before_writing", "description": "x"}, ENV), ENV)
    tasks = env.sample_tasks(240)
    eligible = [t for t in tasks if t.family in CONFIRMING_FAMILIES and t.meta["gold_writes"]]
    answered = [t for t in tasks if t.meta["start"] == "answered"]
    assert {t.task_id for t in answered} <= {t.task_id for t in eligible}
    assert abs(len(answered) / len(eligible) - ANSWERED_SHARE) < 0.1, (len(answered), len(eligible))
    assert [t.meta["start"] for t in env.sample_tasks(240)] == [t.meta["start"] for t in tasks]  # drawn per task
    first = {}
    for task in answered:
        first.setdefault(task.family, task)
    assert len(first) >= 4
    for task in first.values():
        episode = env.start(task)
        opening = episode.initial_messages()
        assert opening[-1]["role"] == "user" and episode.asked[-1]  # the prefix ends with the answered question
        _, expert = demonstrate(env, task)
        assert expert.success and expert.info["decision_point"]["start"] == {"id": "answered", "before": ["write"],
                                                                                "intent": 0}
        for name in ("ask_without_acting", "refuse_everything", "end_at_once"):
            result = demonstrate(env, task, policy=ADVERSARIES[name])[1]
            checks = {c["id"]: c for c in result.info["rubric"]}
            assert result.reward == 0.0 and not checks["acted"]["passed"], (name, task.task_id)
            assert not checks["asked"]["applicable"]  # the question was the prefix's
        stalled = {c["id"]: c for c in demonstrate(env, task, policy=ADVERSARIES["ask_without_acting"])[1].info["rubric"]}
        assert "instead of acting on it" in stalled["acted_on_answer"]["detail"]  # asked twice
        noted = demonstrate(env, task, lacking="execute_requested_action")[1]
        assert noted.reward == 0.0 and "no matching call of @write" in {
            c["id"]: c for c in noted.info["rubric"]}["acted"]["detail"], task.task_id
