"""benchmarks/learning_curve.py runs end to end on the tiny model: one GRPO iteration, evaluated
before and after, JSON and PNG written; --select evaluates on train-side validation seeds;
--target-test plays the target's test split with the adapter, its null and the base (its train
split under --select), on the families the store's labels call LACKING."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from statistics import mean

import pytest

from trace_assets.train.heldout import HELD_OUT_OFFSET, TRAIN_VALIDATION_OFFSET

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "learning_curve.py"


def _module():
    spec = importlib.util.spec_from_file_location("learning_curve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("extra,offset", [
    ([], HELD_OUT_OFFSET),
    # the tiny random model earns reward 0 everywhere: its one group ties and is re-sampled once
    (["--select", "--no-calibrate", "--resample-rounds", "1"], TRAIN_VALIDATION_OFFSET),
    # the expert's play joins the group (reward 1 beside the tiny model's 0s)
    (["--no-calibrate", "--expert-guidance"], HELD_OUT_OFFSET),
])
def test_one_iteration_on_tiny_writes_json_and_png(tmp_path, monkeypatch, tiny_model_path, extra, offset):
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    out = tmp_path / "curve"
    result = _module().main([
        "--agent", str(tiny_model_path), "--profile", "tiny", "--capability", "confirm_before_writing",
        "--iterations", "1", "--groups", "1", "--samples", "2", "--max-steps", "1", "--max-new-tokens", "4",
        "--eval-tasks", "2", "--eval-every", "1", "--seeds", "0", "--backend", "transformers", "--out", str(out),
        "--groups-out", str(tmp_path / "groups.json"), *extra])
    data = json.loads((tmp_path / "curve.json").read_text())
    assert data["eval"]["seed_offset"] == offset and data["mode"] == result["mode"]
    [seed] = data["seeds"]
    assert [p["iteration"] for p in seed["points"]] == [0, 1]
    before, after = seed["points"]
    resampled = data["grpo"]["resample_rounds"]
    assert resampled == (1 if "--resample-rounds" in extra else 0)
    assert seed["history"][0]["resampled_groups"] == resampled
    assert before["rollouts"] == 0 and after["rollouts"] == 2 * (1 + resampled) and after["generated_tokens"] > 0
    assert after["sequence_tokens"] > after["generated_tokens"] and after["train_wall_s"] > 0
    assert len(seed["history"]) == 1 and data["grpo"]["learning_rate"] > 0
    assert data["summary"]["success_gain_per_seed"] == {"0": after["success"] - before["success"]}
    families = data["eval"]["families"]
    assert len(families) == 2 and set(data["summary"]["per_family"]) == set(families)
    for family, row in data["summary"]["per_family"].items():  # the family's share of each point's successes
        at = [j for j, f in enumerate(families) if f == family]
        assert row["tasks"] == len(at)
        assert row["after"] == pytest.approx(sum(after["successes"][j] for j in at) / len(at), abs=1e-4)
    assert ("calibration" in data["environment"]) == ("--no-calibrate" not in extra)
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "curve.envspec.json").read_text())["capability"]["name"] == "confirm_before_writing"
    groups = json.loads((tmp_path / "groups.json").read_text())
    [samples] = groups["samples"].values()
    demos = [r for r in samples if r["demo"]]
    assert len(samples) - len(demos) == after["rollouts"] and all(r["iteration"] == 1 for r in samples)
    assert [r["reward"] for r in demos] == ([1.0] * (1 + resampled) if "--expert-guidance" in extra else [])
    assert data["grpo"]["expert_guidance"] == ("--expert-guidance" in extra)
    played = [r for r in samples if not r["demo"]]
    assert all({"family", "start", "tool_calls", "tool_errors", "first_reply"} <= set(r) for r in played)
    by_tool = groups["advantage_by_tool_use"]["0"]["1"]
    assert set(by_tool) == {"with_tool_calls", "without"}
    assert sum(by_tool.values()) == pytest.approx(sum(r["advantage"] for r in played if r["kept"]), abs=1e-3)


def test_the_success_gain_has_a_paired_interval_over_tasks_and_seeds():
    def run(seed, before, after):
        return {"seed": seed, "points": [
            {"iteration": i, "rollouts": 0, "generated_tokens": 0, "sequence_tokens": 0, "train_wall_s": 0.0,
             "success": sum(ok) / len(ok), "mean_reward": 0.0, "successes": ok} for i, ok in ((0, before), (4, after))]}

    summarize = _module().summarize
    same = summarize([run(0, [0, 1, 0, 1], [0, 1, 0, 1]), run(1, [0, 1, 0, 1], [0, 1, 0, 1])])
    assert same["success_gain_interval"] | {"level": 0} == {"estimate": 0.0, "low": 0.0, "high": 0.0, "level": 0}
    every = summarize([run(0, [0, 0, 0, 0], [1, 1, 1, 1]), run(1, [0, 0, 0, 0], [1, 1, 1, 1])])
    assert (every["success_gain_interval"]["low"], every["success_gain_interval"]["high"]) == (1.0, 1.0)
    mixed = summarize([run(0, [0, 0, 1, 0, 0, 1], [1, 1, 0, 0, 1, 1]), run(1, [0, 0, 1, 0, 0, 1], [1, 0, 1, 0, 0, 1])])
    ci = mixed["success_gain_interval"]
    assert ci["estimate"] == pytest.approx(mean(mixed["success_gain_per_seed"].values()))
    assert ci["low"] < ci["estimate"] < ci["high"] and ci["level"] == 0.95
    assert "success_gain_interval" not in summarize([{"seed": 0, "points": run(0, [1], [1])["points"][:1]}])


def test_target_test_plays_the_test_split_to_measure_and_the_train_split_to_choose(tmp_path, monkeypatch, tiny_model_path):
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    module = _module()
    result = module.main([
        "--agent", str(tiny_model_path), "--profile", "tiny", "--capability", "confirm_before_writing", "--no-calibrate",
        "--iterations", "1", "--groups", "1", "--samples", "2", "--max-steps", "1", "--max-new-tokens", "4",
        "--eval-tasks", "1", "--eval-every", "1", "--seeds", "0,1", "--backend", "transformers",
        "--target-test", "--families", "cancel_pending,order_status", "--out", str(tmp_path / "curve")])
    t = json.loads((tmp_path / "curve.json").read_text())["target_test"]
    assert t["families"] == ["cancel_pending", "order_status"] == result["target_test"]["families"]
    assert t["n_tasks"] == len(t["task_ids"]) > 0 and all(i.split("/")[1] in t["families"] for i in t["task_ids"])
    assert set(t["per_seed"]) == {"0", "1"} and set(t["differences"]) == {"adapter - base", "adapter - null", "null - base"}
    assert [len(row) for row in t["outcomes"]["adapter"]] == [t["n_tasks"]] * 2
    for name, interval in t["systems"].items():
        assert interval["low"] <= interval["estimate"] <= interval["high"], name
    seeds = json.loads((tmp_path / "curve.json").read_text())["seeds"]
    for policy in ("adapter", "null"):  # the target's own checks, per task: a success passed them all
        for run in seeds:
            tested = run["target_test"][policy]
            assert set(tested["checks"]) == {"state_match", "info_communicated", "confirmed_writes"}
            assert all(len(row) == t["n_tasks"] for row in tested["checks"].values())
            assert all(all(row[i] for row in tested["checks"].values()) for i, ok in enumerate(tested["successes"]) if ok)
        assert t["checks"][policy]["state_match"] == [
            sum(sum(r["target_test"][policy]["checks"]["state_match"]) for r in seeds), 2 * t["n_tasks"]]
    assert t["checks"]["base"]["confirmed_writes"][1] == t["n_tasks"]  # the base plays once
    assert (tmp_path / "curve.target_test.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="not families"):
        module.main(["--agent", str(tiny_model_path), "--profile", "tiny", "--no-calibrate", "--seeds", "0",
                     "--target-test", "--families", "nope", "--backend", "transformers"])
    assert t["split"] == "test"
    # choosing (--select) never plays the test split: train by default, test refused before any work
    with pytest.raises(SystemExit, match="for measuring only"):
        module.main(["--agent", str(tiny_model_path), "--profile", "tiny", "--no-calibrate", "--seeds", "0", "--select",
                     "--target-test", "--target-split", "test", "--families", "cancel_pending", "--backend", "transformers"])
    chosen = module.main([
        "--agent", str(tiny_model_path), "--profile", "tiny", "--capability", "confirm_before_writing", "--no-calibrate",
        "--iterations", "1", "--groups", "1", "--samples", "2", "--max-steps", "1", "--max-new-tokens", "4",
        "--eval-tasks", "1", "--eval-every", "1", "--seeds", "0", "--backend", "transformers", "--select",
        "--resample-rounds", "0", "--target-test", "--families", "cancel_pending", "--out", str(tmp_path / "chosen")])
    from benchmarks.target_success import task_list
    from trace_assets.envs import get_environment
    from trace_assets.settings import load_settings

    train = {x.task_id for x in task_list(get_environment("retail"), load_settings("tiny"), "train")}
    played = chosen["target_test"]
    assert played["split"] == "train" and played["task_ids"] and set(played["task_ids"]) <= train
    assert not set(played["task_ids"]) & set(t["task_ids"])


def test_lacking_families_come_from_the_train_side_labels(tmp_path, monkeypatch):
    from resources.store import TraceStore
    from trace_assets.envs import get_environment
    from trace_assets.settings import load_settings

    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path))
    env, settings = get_environment("retail"), load_settings("tiny")
    from benchmarks.target_success import task_list

    train, test = task_list(env, settings, "train"), task_list(env, settings, "test")
    rows = [(train[0], "train", "LACKING"), (train[-1], "train", "PRESENT"), (test[1], "test", "LACKING")]
    assert len({train[0].family, train[-1].family, test[1].family}) == 3
    store = TraceStore()
    store.insert_trajectories([
        {"trajectory_id": f"t{i}", "task_id": task.task_id, "env": "retail", "split": split, "policy": "base",
         "messages": [], "reward": 0.0, "success": False, "info": {}, "source": "base_rollout",
         "created_at": "2026-01-01T00:00:00Z", "agent_id": "a"}
        for i, (task, split, _) in enumerate(rows)], batch_name="b")
    store.insert_labels([(f"t{i}", "confirm_before_writing", 0, label, "r") for i, (_, _, label) in enumerate(rows)],
                        analyst="heuristic", version="v")
    assert store.lacking_families("confirm_before_writing", train) == [train[0].family]
    assert store.lacking_families("confirm_before_writing", train, version="v") == [train[0].family]
    assert store.lacking_families("confirm_before_writing", train, version="other") == []
    assert store.lacking_families("ask_for_missing_info", train) == []


def test_target_success_counts_the_episodes_that_fail_one_check_alone():
    from benchmarks.target_success import sole_failures

    def episode(*failed):
        return {"checks": [{"id": c, "passed": c not in failed} for c in ("state_match", "info_communicated", "confirmed_writes")]}

    episodes = [episode("confirmed_writes"), episode("confirmed_writes"), episode("state_match", "confirmed_writes"),
                episode(), episode("info_communicated"), {"checks": None}]
    assert sole_failures(episodes) == {"confirmed_writes": 2, "info_communicated": 1}
    from benchmarks.target_success import check_failures

    assert check_failures(episodes) == {"confirmed_writes": 3, "state_match": 1, "info_communicated": 1}


def test_check_outcomes_are_the_rubric_s_in_a_synthetic_episode_and_the_target_s_otherwise():
    from trace_assets.envs.base import check_outcomes

    target = [{"id": "state_match", "passed": False, "detail": ""}, {"id": "info_communicated", "passed": True}]
    rubric = [{"id": "asked", "applicable": True, "passed": True}, {"id": "acted", "applicable": True, "passed": False},
              {"id": "answered", "applicable": False, "passed": False}]
    assert check_outcomes({"checks": target}) == {"state_match": False, "info_communicated": True}
    assert check_outcomes({"checks": target, "rubric": rubric}) == {"asked": True, "acted": False}
    assert check_outcomes({}) == {}


def test_target_success_plays_a_synthetic_environment_s_seeds_with_its_rubric(tmp_path, monkeypatch, tiny_model_path):
    """``--spec``: the synthetic environment's validation seeds, greedy, per-check figures of its
    rubric; the target's splits and the synthetic seeds are not mixed up."""
    from benchmarks import target_success
    from trace_assets.envs import get_environment
    from trace_assets.synthesize import SyntheticEnv, template_spec
    from trace_assets.train.heldout import TRAIN_VALIDATION_OFFSET

    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    spec = template_spec({"name": "confirm_before_writing", "description": "x"}, get_environment("retail"))
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    common = ["--env", "retail", "--agent", str(tiny_model_path), "--profile", "tiny", "--max-steps", "1"]
    # no --env: the spec names its target
    summary = target_success.main([*common[2:], "--spec", str(tmp_path / "spec.json"), "--split", "validation",
                                   "--limit", "2", "--out", str(tmp_path / "synthetic")])
    data = json.loads((tmp_path / "synthetic.json").read_text())
    assert data["env"] == "retail"
    # the profile's target is retail too: what decides is the spec's own target.env
    (tmp_path / "airline.json").write_text(json.dumps({**spec, "target": {**spec["target"], "env": "tau2_airline"}}))
    (tmp_path / "broken.json").write_text("{not json")
    assert target_success.spec_target(tmp_path / "airline.json") == "tau2_airline"
    assert target_success.spec_target(tmp_path / "broken.json") is None  # load_spec then names what is wrong
    assert summary["tasks"] == len(data["episodes"]) == 2 and data["spec"] == str(tmp_path / "spec.json")
    env = SyntheticEnv(spec, get_environment("retail"))
    assert [e["task_id"] for e in data["episodes"]] == [t.task_id for t in env.sample_tasks(2, offset=TRAIN_VALIDATION_OFFSET)]
    rubric = {c["id"] for c in spec["rubric"]["checks"]}
    for e in data["episodes"]:
        assert e["checks"] and {c["id"] for c in e["checks"]} <= rubric
    assert data["check_failures"] == {k: v for k, v in data["check_failures"].items() if k in rubric}
    with pytest.raises(SystemExit, match="--split validation: the seeds of a synthetic environment"):
        target_success.main([*common, "--split", "validation"])
    with pytest.raises(SystemExit, match="--split must be one of"):
        target_success.main([*common, "--spec", str(tmp_path / "spec.json"), "--split", "train"])


def test_decision_point_opens_target_tasks_where_the_expert_decides_and_names_the_first_turn():
    """``target_success.py --decision-point``: the target's own task, opened by its expert at the
    template's ``start`` (before the proposal of the first request); asking there is a question,
    writing at once a write, anything else a reply. A task without that move is left out."""
    from types import SimpleNamespace

    from benchmarks.target_success import DecisionPointTarget, first_turn
    from trace_assets.envs import get_environment
    from trace_assets.envs.expert import play_move
    from trace_assets.envs.retail.expert import next_move

    target = get_environment("retail")
    env = DecisionPointTarget(target, "confirm_before_writing")
    task = target.make_task("cancel_pending", 3)
    assert env.has_decision_point(task)

    def first(task, move=None, **ablation):
        """The first-turn kind of ``move`` (default: the expert's next move, ``ablation`` applied)."""
        episode = env.start(task)
        messages = episode.initial_messages()
        assert [m["role"] for m in messages[:2]] == ["system", "user"] and messages[-1]["role"] == "tool"
        play_move(episode, messages, move or next_move(task, messages, **ablation))
        return first_turn(SimpleNamespace(messages=messages, result=episode.result()), env.writes)

    assert first(task) == "question"  # the expert proposes and asks
    assert first(task, lacking="confirm_before_writing") == "write"
    assert first(task, lacking="communicate_results") == "question"
    report = SimpleNamespace(call=None, text="Your order is cancelled. Anything else I can help with?")
    assert first(task, report) == "reply"
    # the contrast: the answer is due, nothing to confirm
    assert first(target.make_task("order_status", 3)) == "reply"
    assert not DecisionPointTarget(target, "ground_arguments").has_decision_point(task)  # no variants to look up


def test_decision_point_before_the_write_opens_after_the_yes():
    """``--before write``: the expert proposes and the user says yes; acting is a write, asking
    again a question, "noted" a reply. A declined change has no write to open before."""
    from types import SimpleNamespace

    from benchmarks.target_success import DecisionPointTarget, first_turn
    from trace_assets.envs import get_environment
    from trace_assets.envs.expert import play_move
    from trace_assets.envs.retail.expert import ADVERSARIES, YES, next_move

    target = get_environment("retail")
    env = DecisionPointTarget(target, "confirm_before_writing", before=["write"])
    task = target.make_task("cancel_pending", 3)

    def first(policy):
        episode = env.start(task)
        messages = episode.initial_messages()
        assert messages[-1] == {"role": "user", "content": YES}
        play_move(episode, messages, policy(task, messages))
        return first_turn(SimpleNamespace(messages=messages, result=episode.result()), env.writes)

    assert first(next_move) == "write"
    assert first(ADVERSARIES["ask_without_acting"]) == "question"
    assert first(lambda t, m: next_move(t, m, lacking="execute_requested_action")) == "reply"
    assert not env.has_decision_point(target.make_task("cancel_declined", 3))
    with pytest.raises(SystemExit, match="unknown move kind"):
        DecisionPointTarget(target, "confirm_before_writing", before=["act"])


def test_families_keep_their_order_and_an_unknown_one_is_named():
    from benchmarks.target_success import parse_families

    assert parse_families(" modify_address,cancel_pending,,modify_address", ["cancel_pending", "modify_address"],
                          "retail") == ["modify_address", "cancel_pending"]
    with pytest.raises(SystemExit, match=r"\['modify_adress'\] are not families of the test split of retail"):
        parse_families("modify_adress,cancel_pending", ["cancel_pending"], "the test split of retail")


def test_each_seed_is_written_as_it_ends_and_resume_reuses_only_what_measured_the_same(tmp_path, monkeypatch,
                                                                                       tiny_model_path):
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    module = _module()
    out = tmp_path / "curve"
    common = ["--agent", str(tiny_model_path), "--profile", "tiny", "--capability", "confirm_before_writing",
              "--no-calibrate", "--iterations", "1", "--groups", "1", "--samples", "2", "--max-steps", "1",
              "--max-new-tokens", "4", "--eval-tasks", "1", "--backend", "transformers", "--out", str(out)]
    written: list[dict] = []
    real_write = module.write_result
    monkeypatch.setattr(module, "write_result", lambda files, data: (written.append(data), real_write(files, data)))
    module.main([*common, "--seeds", "0,1"])
    assert [([r["seed"] for r in d["seeds"]], d["complete"]) for d in written] == [([0], False), ([0, 1], True)]
    first = json.loads((tmp_path / "curve.json").read_text())
    assert first["complete"] and [r["seed"] for r in first["seeds"]] == [0, 1]

    written.clear()
    trained: list[int] = []
    real_curve = module.learning_curve
    monkeypatch.setattr(module, "learning_curve", lambda *a, **k: (trained.append(k["seed"]), real_curve(*a, **k))[1])
    respelled = [str(tiny_model_path) + "/" if a == str(tiny_model_path) else a for a in common]  # the same folder
    result = module.main([*respelled, "--seeds", "1,2", "--resume"])
    assert trained == [2]  # seed 1 came from the file; seed 0, not asked for, is kept in it
    stored = json.loads((tmp_path / "curve.json").read_text())
    assert [r["seed"] for r in stored["seeds"]] == [1, 2, 0] == [r["seed"] for r in result["seeds"]]
    assert stored["seeds"][0]["points"] == first["seeds"][1]["points"] and stored["complete"]

    with pytest.raises(SystemExit, match=r"curve\.json measured something else \(grpo: .*learning_rate"):
        module.main([*common, "--seeds", "3", "--resume", "--lr", "0.5"])
    assert json.loads((tmp_path / "curve.json").read_text()) == stored  # the refused run changed nothing


def test_resume_adds_the_target_test_to_stored_seeds_from_their_saved_adapters(tmp_path, monkeypatch, tiny_model_path):
    """A run measured without --target-test gains it on --resume, from the adapters it saved, without
    retraining; a seed whose adapter was not saved is named, and nothing is written."""
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    module = _module()
    out, saved = tmp_path / "curve", tmp_path / "adapters"
    common = ["--agent", str(tiny_model_path), "--profile", "tiny", "--capability", "confirm_before_writing",
              "--no-calibrate", "--iterations", "1", "--groups", "1", "--samples", "2", "--max-steps", "1",
              "--max-new-tokens", "4", "--eval-tasks", "1", "--backend", "transformers", "--out", str(out)]
    test = ["--target-test", "--families", "cancel_pending", "--resume"]
    module.main([*common, "--seeds", "0"])  # nothing saved
    with pytest.raises(SystemExit, match=r"seed 0 in .*curve\.json has no target test and no saved adapter"):
        module.main([*common, *test, "--seeds", "0"])
    assert "target_test" not in json.loads((tmp_path / "curve.json").read_text())

    module.main([*common, "--seeds", "0,1", "--save-adapters", str(saved), "--out", str(tmp_path / "saved")])
    first = json.loads((tmp_path / "saved.json").read_text())
    assert [r["adapter_dir"] for r in first["seeds"]] == [str(saved / "seed0"), str(saved / "seed1")]
    # stored before warmup_iterations existed, without adapter_dir: the --save-adapters folder is looked in
    del first["grpo"]["warmup_iterations"]
    for run in first["seeds"]:
        del run["adapter_dir"]
    (tmp_path / "saved.json").write_text(json.dumps(first))
    trained: list[int] = []
    real_curve = module.learning_curve
    monkeypatch.setattr(module, "learning_curve", lambda *a, **k: (trained.append(k["seed"]), real_curve(*a, **k))[1])
    result = module.main([*common, *test, "--seeds", "0,1", "--out", str(tmp_path / "saved"), "--save-adapters", str(saved)])
    assert trained == []  # both seeds came from the file, their adapters from the folder
    stored = json.loads((tmp_path / "saved.json").read_text())
    assert [r["points"] for r in stored["seeds"]] == [r["points"] for r in first["seeds"]]
    t = stored["target_test"]
    assert set(t["per_seed"]) == {"0", "1"} and t == json.loads(json.dumps(result["target_test"]))
    assert sum("base" in r["target_test"] for r in stored["seeds"]) == 1  # the base plays once
    assert [len(row) for row in t["outcomes"]["adapter"]] == [t["n_tasks"]] * 2


def test_resume_reads_runs_stored_before_packing_as_unpacked(tmp_path):
    """A run stored before ``pack_suffixes`` existed trained unpacked: resuming it unpacked is the
    same measurement, resuming it packed is another one (an error that names the field)."""
    module = _module()
    ours = {"benchmark": "learning_curve", "agent": str(tmp_path), "grpo": {"learning_rate": 1e-3, "seed": 0},
            "environment": {"spec_hash": "s"}, "generation": {"backend": "vllm"}, "eval": {"n_tasks": 4}}
    stored = tmp_path / "run.json"
    stored.write_text(json.dumps({**ours, "seeds": [{"seed": 0}]}))
    unpacked = {**ours, "grpo": {**ours["grpo"], "pack_suffixes": False}}
    assert set(module.resumed_seeds(stored, unpacked)) == {0}
    with pytest.raises(SystemExit, match="pack_suffixes"):
        module.resumed_seeds(stored, {**ours, "grpo": {**ours["grpo"], "pack_suffixes": True}})
