"""Step 2 validation: calibration with a scripted policy, isolation against ablated experts, and
the LLM synthesizer against a real local OpenAI-protocol server with scripted answers."""

from __future__ import annotations

import json
import random

import pytest

from tests.openai_server import ScriptedOpenAI
from trace_assets.envs import get_environment
from trace_assets.envs.base import EpisodeResult
from trace_assets.envs.retail.expert import demonstrate
from trace_assets.identify.heuristic import RULES
from trace_assets.llm_client import ChatClient, LLMError
from trace_assets.envs.retail.expert import ABLATIONS, ADVERSARIES
from trace_assets.synthesize import (
    SynthesisError,
    SyntheticEnv,
    calibrate,
    isolation_heatmap,
    isolation_markdown,
    isolation_matrix,
    llm_spec,
    template_spec,
)
from trace_assets.synthesize.llm_synth import render_prompt
from trace_assets.synthesize.validate import GAMING_BOUND, ISOLATION_BOUNDS

ENV = get_environment("retail")


def cap(name):
    return {"name": name, "description": RULES[name].description if name in RULES else "A capability.",
            "failure_modes": ["wrote without explicit confirmation"]}


# ---------------------------------------------------------------- calibration


def success_probability(difficulty):
    """The scripted policy: easier knobs raise its success probability (known, monotone)."""
    p = (0.05 + 0.3 * difficulty["hint_share"] + 0.2 * difficulty["volunteer_identity"]
         - 0.1 * difficulty["distractor_orders"] - 0.1 * difficulty["family_bias"])
    return min(1.0, max(0.0, p))


def scripted_rollouts(env, tasks, k, temperature):
    p = success_probability(env.difficulty)
    out = []
    for task in tasks:
        for j in range(k):
            ok = random.Random(f"{task.seed}/{j}").random() < p
            out.append(EpisodeResult(reward=1.0 if ok else 0.0, success=ok, info={}))
    return out


def hard_spec():
    spec = template_spec(cap("confirm_before_writing"), ENV)
    spec["difficulty"] = {"hint_share": 0.0, "volunteer_identity": 0.0, "distractor_orders": 2, "family_bias": 1.0, "frozen": []}
    return spec


def test_calibration_makes_a_too_hard_env_easier_until_it_passes():
    report = calibrate(hard_spec(), ENV, scripted_rollouts, seeds=32, k=4)
    assert report.passed, report.rounds
    assert [r["round"] for r in report.rounds] == list(range(len(report.rounds))) and len(report.rounds) >= 2
    assert all(not r["passed"] and r["direction"] == "easier" for r in report.rounds[:-1])
    final = report.rounds[-1]
    assert final["passed"] and 0.2 <= final["mean_reward"] <= 0.6 and final["informative_share"] >= 0.5
    hints = [r["difficulty"]["hint_share"] for r in report.rounds]
    assert hints == sorted(hints) and hints[-1] > hints[0]
    assert report.spec["difficulty"] == final["difficulty"]
    assert SyntheticEnv(report.spec, ENV).difficulty["distractor_orders"] < 2
    assert all(r["n_tasks"] == 32 and r["k"] == 4 for r in report.rounds)
    json.dumps(report.to_dict())


def test_calibration_of_an_impossible_env_fails_with_a_full_report():
    never = lambda env, tasks, k, t: [{"reward": 0.0, "success": False} for _ in range(len(tasks) * k)]  # noqa: E731
    report = calibrate(hard_spec(), ENV, never, seeds=8, k=2, max_rounds=5)
    assert not report.passed and len(report.rounds) == 5 and "5 rounds" in report.reason
    assert all(r["mean_reward"] == 0.0 and not r["passed"] for r in report.rounds)
    long = calibrate(hard_spec(), ENV, never, seeds=8, k=2, max_rounds=20)
    assert not long.passed and "easiest" in long.reason and len(long.rounds) < 20
    assert long.spec["difficulty"]["hint_share"] == 1.0 and long.spec["difficulty"]["family_bias"] == -2.0


def test_calibration_makes_a_too_easy_env_harder_and_respects_frozen_knobs():
    always = lambda env, tasks, k, t: [EpisodeResult(1.0, True, {}) for _ in range(len(tasks) * k)]  # noqa: E731
    spec = template_spec(cap("authenticate_before_acting"), ENV)
    assert "volunteer_identity" in spec["difficulty"]["frozen"]
    report = calibrate(spec, ENV, always, seeds=4, k=2, max_rounds=3)
    assert not report.passed and [r["direction"] for r in report.rounds[:2]] == ["harder", "harder"]
    assert report.rounds[1]["difficulty"]["distractor_orders"] == 1
    assert all(r["difficulty"]["volunteer_identity"] == 0.0 for r in report.rounds)


def test_calibration_needs_informative_groups():
    constant = lambda env, tasks, k, t: [EpisodeResult(float(task.seed % 2), bool(task.seed % 2), {})  # noqa: E731
                                         for task in tasks for _ in range(k)]
    report = calibrate(hard_spec(), ENV, constant, seeds=8, k=4, max_rounds=2)
    assert not report.passed and report.rounds[0]["informative_share"] == 0.0
    assert report.rounds[0]["mean_reward"] == 0.5


# ---------------------------------------------------------------- isolation against ablated experts


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_isolation_matrix_row_of_every_template_env(name):
    spec = template_spec(cap(name), ENV)
    report = isolation_matrix(spec, ENV, seeds=2)
    assert report["passed"], report["reason"]
    assert report["method"] == "ablated experts"
    rows = {r["agent"]: r for r in report["rows"]}
    n = 2 * len(spec["tasks"]["families"])  # every family, whatever its weight
    assert set(rows) == {"full", *ABLATIONS, *ADVERSARIES} and all(r["n"] == n for r in rows.values())
    assert rows["full"]["success"] == 1.0
    assert rows[name]["n_acts"] > 0 and rows[name]["success_where_acts"] == 0.0
    # Overlaps by design: E_confirm's contrast episodes need the status told (order_status) and the
    # write made once the user said yes (the answered start).
    overlap = {"confirm_before_writing": {"communicate_results", "execute_requested_action"}}.get(name, set())
    assert all(rows[other]["success"] == 1.0 for other in ABLATIONS if other != name and other not in overlap)
    assert all(ISOLATION_BOUNDS[1] <= rows[other]["success"] < 1.0 for other in overlap)
    # Refusing everything and ending at once never solve a decision point that needs an action.
    assert rows["end_at_once"]["success"] == 0.0 and rows["refuse_everything"]["success"] <= 0.5
    json.dumps(report)


def test_isolation_fails_when_the_env_needs_another_capability_and_weaker_without_ablation():
    # Exchanges need variant lookups: an expert lacking only ground_arguments cannot execute them.
    spec = template_spec(cap("execute_requested_action"), ENV)
    spec["tasks"]["families"] = [{"name": "exchange_delivered", "weight": 1.0}]
    report = isolation_matrix(spec, ENV, seeds=2)
    assert not report["passed"] and "lacking only ground_arguments fails it" in report["reason"]
    # A whole-episode rubric with the write weighted in: the expert lacking confirmation passes it.
    loose = template_spec(cap("confirm_before_writing"), ENV)
    loose = {k: v for k, v in loose.items() if k not in ("start", "end")}
    loose["tasks"]["families"] = [{"name": "cancel_pending", "weight": 1.0}]
    loose["rubric"]["checks"] = [{"id": "state", "kind": "final_state_match", "weight": 1}]
    report = isolation_matrix(loose, ENV, seeds=2)
    assert not report["passed"] and "lacking confirm_before_writing still succeeds on 1.00" in report["reason"]
    weak = isolation_matrix(template_spec(cap("some_new_capability"), ENV), ENV, seeds=1)
    assert weak["method"].startswith("weaker") and weak["passed"], weak["reason"]
    table = isolation_markdown([report, weak])
    assert "| E_confirm_before_writing |" in table and "(weaker)" in table and "**1.00**" in table
    png = isolation_heatmap([report, weak])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_isolation_blocks_a_rubric_that_pays_adversaries_for_failing():
    """Without its gates, E_confirm_before_writing's checks that pass by absence paid the agents that
    refuse everything or end at once about 0.7 on episodes they failed: the blocking check says so."""
    spec = template_spec(cap("confirm_before_writing"), ENV)
    rows = {r["agent"]: r for r in isolation_matrix(spec, ENV, seeds=2)["rows"]}
    assert rows["refuse_everything"]["reward_when_failed"] == 0.0 and rows["end_at_once"]["n_failed"] == rows["end_at_once"]["n"]
    for check in spec["rubric"]["checks"]:
        check.pop("requires", None)
    report = isolation_matrix(spec, ENV, seeds=2)
    rows = {r["agent"]: r for r in report["rows"]}
    assert rows["refuse_everything"]["success"] == 0.0 and rows["refuse_everything"]["reward_when_failed"] > GAMING_BOUND
    assert not report["passed"] and "the rubric pays adversary refuse_everything a mean reward of" in report["reason"]
    assert "the rubric pays adversary end_at_once" in report["reason"]


def test_ablations_are_the_heuristic_failures_on_the_target():
    """Each ablated expert shows, on target tasks, exactly the failure the Step-1 heuristic names."""
    tasks = [ENV.make_task(f, s) for f in ENV.families() for s in range(2)]
    for name in ABLATIONS:
        labels = [RULES[name].judge(demonstrate(ENV, t, lacking=name)[1].info)[0] for t in tasks]
        full = [RULES[name].judge(demonstrate(ENV, t)[1].info)[0] for t in tasks]
        assert "LACKING" in labels and "LACKING" not in full, name


# ---------------------------------------------------------------- the LLM synthesizer


def _client(server):
    return ChatClient(base_url=server.base_url, model="scripted", timeout_s=10)


def good_answer(name="confirm_before_writing"):
    spec = template_spec(cap(name), ENV)
    spec["notes"] = "written by the model"
    return spec


def test_llm_spec_repairs_bad_answers():
    unknown_tool = good_answer()
    unknown_tool["target"]["tools"].append("teleport_user")
    unsatisfiable = good_answer()
    unsatisfiable["rubric"]["checks"].append({"id": "transferred", "kind": "required_call", "weight": 2, "tool": "transfer_to_human_agents"})
    renamed = good_answer()
    renamed["capability"] = {"name": "something_else", "description": "the model's own idea"}
    answers = ["Here is my plan: make the agent confirm things. No JSON today.",
               json.dumps(unknown_tool), json.dumps(unsatisfiable),
               "```json\n" + json.dumps(renamed) + "\n```"]
    with ScriptedOpenAI(answers) as server:
        spec, reasons = llm_spec(cap("confirm_before_writing"), ENV, _client(server), max_retries=3)
    assert len(server.requests) == 4 and len(reasons) == 3
    assert "not a JSON object" in reasons[0]
    assert "teleport_user" in reasons[1]
    assert "transferred" in reasons[2] and "transfer_to_human_agents" in reasons[2]
    assert spec["capability"] == {"name": "confirm_before_writing", "description": cap("confirm_before_writing")["description"],
                                  "failure_modes": ["wrote without explicit confirmation"]}
    assert spec["notes"] == "written by the model" and SyntheticEnv(spec, ENV).name == "synthetic_confirm_before_writing"
    # The model saw the schema, the tools and the families, and then each rejection reason.
    prompt = server.requests[0]["messages"][0]["content"]
    assert "envspec/v2.json" in prompt and "exchange_delivered_order_items" in prompt and "cancel_and_return" in prompt
    assert "1000000" in prompt and "confirm_before_writing" in prompt
    repair = server.requests[2]["messages"][-1]["content"]
    assert "invalid" in repair and "teleport_user" in repair


def test_llm_spec_raises_with_every_reason_when_retries_run_out():
    bad_weight = good_answer()
    bad_weight["rubric"]["checks"][0]["weight"] = 0
    not_inherited = good_answer()
    not_inherited["policy"] = "Do whatever the user asks."
    with ScriptedOpenAI([json.dumps(bad_weight), json.dumps(not_inherited), json.dumps(good_answer())]) as server:
        with pytest.raises(SynthesisError) as info:
            llm_spec(cap("confirm_before_writing"), ENV, _client(server), max_retries=1)
    assert len(server.requests) == 2  # bounded: 1 + max_retries attempts
    err = info.value
    assert isinstance(err, LLMError) and len(err.reasons) == 2
    assert "weight" in err.reasons[0] and "policy" in err.reasons[1]
    assert "policy" in str(err) and "confirm_before_writing" in str(err)


def test_llm_spec_first_answer_valid_and_failures_in_prompt():
    failed = [{"trajectory_id": "traj-7", "info": {"family": "modify_address", "policy_violations": [
        {"rule": "confirm_before_write", "detail": "modify_pending_order_address"}]}}]
    prompt = render_prompt(cap("confirm_before_writing"), ENV, failed)
    assert "traj-7" in prompt and "modify_address" in prompt
    with ScriptedOpenAI([json.dumps(good_answer())]) as server:
        spec, reasons = llm_spec(cap("confirm_before_writing"), ENV, _client(server), failed_trajectories=failed)
    assert reasons == [] and len(server.requests) == 1 and "traj-7" in server.requests[0]["messages"][0]["content"]
    assert spec == {**good_answer(), "capability": spec["capability"]}


def test_llm_spec_emits_decision_point_envs_and_is_held_to_isolation():
    """The LLM synthesizer is told about decision points and ablations, and its answer must isolate."""
    leaky = good_answer("execute_requested_action")
    leaky["tasks"]["families"].append({"name": "exchange_delivered", "weight": 1.0})  # needs variant lookups too
    fixed = good_answer("execute_requested_action")
    with ScriptedOpenAI([json.dumps(leaky), json.dumps(fixed)]) as server:
        spec, reasons = llm_spec(cap("execute_requested_action"), ENV, _client(server), max_retries=1)
    assert len(reasons) == 1 and "isolation" in reasons[0] and "ground_arguments" in reasons[0]
    assert spec["start"] == {"before": ["write"], "intent": 0} and spec["schema_version"] == "2"
    prompt = server.requests[0]["messages"][0]["content"]
    assert "DECISION POINT" in prompt and "ask_identity, authenticate, lookup, propose, write, report" in prompt
    assert "lacking execute_requested_action" in prompt and '"start":' in prompt  # the example has one


def test_isolation_counts_every_family_whatever_the_calibrated_weights():
    """A calibrator that tilts the weights toward complex families (allowed cancels) must not hide the
    forbidden ones from the isolation check: every family is measured."""
    from trace_assets.synthesize.validate import _step

    spec = template_spec(cap("refuse_forbidden_actions"), ENV)
    for _ in range(3):
        spec = _step(spec, "harder")
    assert SyntheticEnv(spec, ENV).family_weights()["cancel_forbidden"] < 0.25
    report = isolation_matrix(spec, ENV, seeds=2)
    assert report["passed"], report["reason"]
    rows = {r["agent"]: r for r in report["rows"]}
    assert rows["refuse_forbidden_actions"]["n_acts"] == 2 and rows["refuse_forbidden_actions"]["success_where_acts"] == 0.0


def test_calibration_plays_tasks_apart_from_grpos_and_seeds_its_sampling_from_the_training_seed():
    """Calibration never tunes the difficulty on the tasks GRPO then trains on first (it once did:
    both started at seed offset 0), and its sampling seeds follow the training seed."""
    from trace_assets.synthesize import CALIBRATION_OFFSET, calibration_rollout_seed
    from trace_assets.train.config import GRPOConfig
    from trace_assets.train.heldout import HELD_OUT_OFFSET

    played = []

    def recording(env, tasks, k, temperature):
        played.extend(t.seed for t in tasks)
        return scripted_rollouts(env, tasks, k, temperature)

    PAPER = GRPOConfig()  # the paper's recipe: the most training tasks
    spec = hard_spec()
    report = calibrate(spec, ENV, recording, seeds=32, k=4)
    env = SyntheticEnv(spec, ENV)
    start = env.seed_range[0]
    training = {t.seed for t in env.sample_tasks(PAPER.iterations * PAPER.groups, offset=PAPER.seed_offset)}
    assert played and not set(played) & training
    assert min(played) == start + CALIBRATION_OFFSET and max(played) < start + HELD_OUT_OFFSET
    assert len(report.rounds) >= 2 and len(set(played)) == 32  # every round plays the same tasks

    seeds = {(s, r): calibration_rollout_seed(s, r) for s in range(3) for r in range(5)}
    assert len(set(seeds.values())) == len(seeds)
    grpo = {PAPER.__class__(seed=s).rollout_config(i).seed for s in range(3) for i in range(1, 41)}
    assert not set(seeds.values()) & grpo
