"""The null control, the promotion gate and agent-keyed trajectories (what makes Step 3's and
Step 4's figures mean what they say; fidelity itself is tests/test_adapter_fidelity.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import duckdb
import pytest
import torch
from safetensors.torch import load_file

from trace_assets.agent.identity import agent_id, agent_identity, generation_identity
from trace_assets.agent.lora import null_adapter
from trace_assets.train.heldout import EvalReport, promotion


def _pairs(weights: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {k: (weights[k], weights[k.replace(".lora_A.", ".lora_B.")]) for k in weights if ".lora_A." in k}


def test_null_adapter_keeps_each_layers_norm_with_random_directions(tiny_model_path: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    from trace_assets.agent.model import load_model

    torch.manual_seed(0)
    peft = get_peft_model(load_model(str(tiny_model_path))[0], LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                                                          init_lora_weights=False))
    peft.save_pretrained(tmp_path / "trained")
    null = null_adapter(tmp_path / "trained", tmp_path / "null", seed=7)
    assert json.loads((null / "adapter_config.json").read_text()) == json.loads((tmp_path / "trained" / "adapter_config.json").read_text())
    trained, control = _pairs(load_file(str(tmp_path / "trained" / "adapter_model.safetensors"))), _pairs(load_file(str(null / "adapter_model.safetensors")))
    assert trained.keys() == control.keys() and len(trained) == 4  # 2 layers x 2 modules
    for key, (a, b) in trained.items():
        delta, twin = (b @ a).flatten(), (control[key][1] @ control[key][0]).flatten()
        assert torch.linalg.norm(twin) == pytest.approx(float(torch.linalg.norm(delta)), rel=1e-4)
        assert abs(float(torch.nn.functional.cosine_similarity(delta, twin, dim=0))) < 0.3  # another direction
    again = load_file(str(null_adapter(tmp_path / "trained", tmp_path / "again", seed=7) / "adapter_model.safetensors"))
    other = load_file(str(null_adapter(tmp_path / "trained", tmp_path / "other", seed=8) / "adapter_model.safetensors"))
    first = load_file(str(null / "adapter_model.safetensors"))
    assert all(torch.equal(first[k], again[k]) for k in first)  # seeded
    assert any(not torch.equal(first[k], other[k]) for k in first)


def _report(policy: str, successes: list[bool]) -> EvalReport:
    n = len(successes)
    return EvalReport(policy=policy, n=n, mean_reward=sum(successes) / n, success_rate=sum(successes) / n,
                      rewards=[float(s) for s in successes], successes=successes)


def test_promotion_needs_to_beat_the_base_and_the_null_beyond_noise() -> None:
    base = [False] * 8 + [True] * 8
    strong = [True] * 16  # 8 wins, 0 losses against base: one-sided p = 1/256
    gate = promotion({"base": _report("base", base), "adapter": _report("adapter", strong), "null": _report("null", base)})
    assert gate["promoted"] and gate["vs_base"]["wins"] == 8 and gate["vs_base"]["p_greater"] == pytest.approx(1 / 256)
    assert gate["reason"].startswith("promoted")
    # as good as its null: a perturbation of the same size did the same, so nothing was learned
    same = promotion({"base": _report("base", base), "adapter": _report("adapter", strong), "null": _report("null", strong)})
    assert not same["promoted"] and "does not beat null" in same["reason"] and "beats base" in same["reason"]
    # inside the noise: 2 wins, 1 loss
    noisy = [True, True, False] + [False] * 5 + [True] * 8
    small = promotion({"base": _report("base", base), "adapter": _report("adapter", noisy), "null": _report("null", base)})
    assert not small["promoted"] and small["vs_base"]["p_greater"] > 0.05
    # the demo's case: held-out success fell
    worse = promotion({"base": _report("base", strong), "adapter": _report("adapter", base), "null": _report("null", base)})
    assert not worse["promoted"]
    assert not promotion({"base": _report("base", base), "adapter": _report("adapter", strong)})["promoted"]  # no null


def test_promotion_refuses_an_adapter_that_stopped_passing_a_shaping_check() -> None:
    """What the v11 E_confirm_before_writing adapters did: success rose because they asked and then
    never wrote. The write is a shaping check there (reward, not success); the gate compares its
    passes with the base's, paired, and refuses a significant loss."""
    from trace_assets.train.heldout import _report as report_of

    def rollouts(successes, wrote):
        def info(ok, w):
            return {"rubric": [{"id": "asked", "applicable": True, "passed": ok, "shaping": False},
                               {"id": "wrote", "applicable": w is not None, "passed": bool(w), "shaping": True}]}
        return [SimpleNamespace(result=SimpleNamespace(reward=float(ok), success=ok, info=info(ok, w)))
                for ok, w in zip(successes, wrote)]

    base_ok, strong = [False] * 8 + [True] * 8, [True] * 16
    base = report_of("base", rollouts(base_ok, [True] * 12 + [None] * 4))
    assert base.shaping == ["wrote"] and base.check_counts() == {"asked": [8, 16], "wrote": [12, 12]}
    null = report_of("null", rollouts(base_ok, [True] * 12 + [None] * 4))
    silent = report_of("adapter", rollouts(strong, [False] * 12 + [None] * 4))
    gate = promotion({"base": base, "adapter": silent, "null": null})
    assert gate["vs_base"]["p_greater"] < 0.05 and gate["vs_null"]["p_greater"] < 0.05  # success alone would pass
    assert not gate["promoted"] and gate["guards"]["wrote"] == {"applicable": 12, "base": 12, "adapter": 0,
                                                                "p_greater": pytest.approx(1 / 4096)}
    assert "it stopped passing wrote" in gate["reason"]
    kept = report_of("adapter", rollouts(strong, [True] * 11 + [False] + [None] * 4))  # one loss: noise
    assert promotion({"base": base, "adapter": kept, "null": null})["promoted"]


def test_promotion_refuses_an_adapter_that_does_harm_on_the_targets_train_tasks() -> None:
    """What the E_confirm_before_writing adapter of the first guided experiment's seed 0 did: success
    on its environment rose, and on the target it stopped making the writes the target needs. The
    target guard plays the target's train tasks of the LACKING families; a significant loss of
    success there refuses the adapter. The target's checks are reported beside it: a check that
    falls while success does not is a trade, not a refusal."""
    from trace_assets.train.heldout import _report as report_of

    def target(state_match, informed):
        def info(s, i):
            return {"checks": [{"id": "state_match", "passed": s}, {"id": "info_communicated", "passed": i},
                               {"id": "confirmed_writes", "passed": True}]}
        return [SimpleNamespace(result=SimpleNamespace(reward=float(s and i), success=s and i, info=info(s, i)))
                for s, i in zip(state_match, informed)]

    base_ok, strong = [False] * 8 + [True] * 8, [True] * 16
    synthetic = {"base": _report("base", base_ok), "adapter": _report("adapter", strong), "null": _report("null", base_ok)}
    base = report_of("base", target([True] * 12 + [False] * 12, [True] * 24))
    assert base.shaping == [] and base.check_counts()["state_match"] == [12, 24]
    silent = report_of("adapter", target([True] * 2 + [False] * 22, [True] * 24))  # asks, then does not write
    lacking = [True] * 4 + [False] * 20  # the capability was LACKING in the family of the first 4
    gate = promotion(synthetic, target={"base": base, "adapter": silent, "lacking": lacking})
    assert gate["vs_base"]["p_greater"] < 0.05 and gate["vs_null"]["p_greater"] < 0.05  # its environment alone passes
    assert not gate["promoted"]
    assert gate["target_guard"]["success"] == {"applicable": 24, "base": 12, "adapter": 2, "p_greater": pytest.approx(1 / 1024)}
    assert gate["target_guard"]["state_match"]["adapter"] == 2  # where the loss comes from
    assert gate["target_guard"]["success_lacking_families"] == {"applicable": 4, "base": 4, "adapter": 2,
                                                                "p_greater": pytest.approx(1 / 4)}
    assert "it succeeds on 2, base 12 (on the 4 of its LACKING families: 2, base 4)" in gate["reason"]
    assert "succeeds less often than the base" in gate["reason"]
    # more writes right, fewer details told, more successes: a trade the guard reports and lets through
    traded = report_of("adapter", target([True] * 20 + [False] * 4, [True] * 6 + [False] * 6 + [True] * 12))
    ok = promotion(synthetic, target={"base": base, "adapter": traded})
    assert ok["target_guard"]["info_communicated"]["p_greater"] < 0.05 and ok["target_guard"]["success"]["adapter"] == 14
    assert ok["promoted"] and "nor success on the target's train tasks" in ok["reason"]
    # without the guard's episodes the gate says it did not measure them
    assert "the target guard measured nothing" in promotion(synthetic)["reason"]


def test_guard_tasks_take_every_family_in_turn() -> None:
    from trace_assets.train.heldout import guard_tasks

    tasks = [SimpleNamespace(task_id=f"{f}/{i}", family=f) for f in ("a", "b", "c") for i in range(3)]
    # the LACKING families first, in the order given, then the others, one task of each in turn
    assert [t.task_id for t in guard_tasks(tasks, ["c", "a"], 5)] == ["c/0", "a/0", "b/0", "c/1", "a/1"]
    assert [t.task_id for t in guard_tasks(tasks, ["b"], 2)] == ["b/0", "a/0"]
    assert len(guard_tasks(tasks, [], 100)) == 9 and guard_tasks(tasks, ["a"], 0) == []


def test_agent_identity_tells_dtype_backend_adapter_and_warm_start_apart() -> None:
    vllm = lambda dtype: SimpleNamespace(name="vllm", engine=SimpleNamespace(options=SimpleNamespace(dtype=dtype)))
    hf = SimpleNamespace(name="transformers", bf16=False)
    base = {"path": "/m/base_agent/x", "checksum": "c0ffee"}
    assert generation_identity(vllm("bfloat16")) == {"backend": "vllm", "dtype": "bfloat16"}
    assert generation_identity(hf) == {"backend": "transformers", "dtype": "float32"}
    ids = {agent_id(agent_identity(base, vllm("bfloat16"))), agent_id(agent_identity(base, vllm("float32"))),
           agent_id(agent_identity(base, hf)), agent_id(agent_identity({**base, "checksum": "other"}, hf)),
           agent_id(agent_identity(base, hf, adapter="cap@123"))}
    assert len(ids) == 5


def _record(tid: str, *, agent: str, source: str, success: bool = True) -> dict:
    return {"trajectory_id": tid, "task_id": "t", "env": "retail", "split": "train", "policy": "base",
            "messages": [{"role": "user", "content": "hi"}], "reward": float(success), "success": success,
            "info": {}, "source": source, "created_at": "2026-12-01T00:00:00+00:00", "agent_id": agent}


def test_readers_get_only_their_agents_rows_and_an_old_store_migrates(tmp_path: Path) -> None:
    from resources.store import PIPELINE_SOURCE, TraceStore

    db = tmp_path / "old.duckdb"
    with duckdb.connect(str(db)) as conn:  # a data folder from before agent ids
        conn.execute("CREATE TABLE trajectories (trajectory_id VARCHAR PRIMARY KEY, task_id VARCHAR NOT NULL, env VARCHAR NOT NULL, "
                     "split VARCHAR NOT NULL, policy VARCHAR NOT NULL, messages JSON NOT NULL, reward DOUBLE NOT NULL, "
                     "success BOOLEAN NOT NULL, info JSON NOT NULL, source VARCHAR NOT NULL, created_at TIMESTAMPTZ NOT NULL)")
        conn.execute("INSERT INTO trajectories VALUES ('old', 't', 'retail', 'train', 'base', '[]', 1.0, true, '{}', ?, now())",
                     [PIPELINE_SOURCE])
    store = TraceStore(database=str(db))
    store.insert_trajectories([_record("bf16", agent="a-bf16", source=PIPELINE_SOURCE),
                               _record("fp32", agent="a-fp32", source=PIPELINE_SOURCE),
                               _record("user-log", agent="", source="logs.jsonl")], batch_name="b")
    assert {r["trajectory_id"] for r in store.trajectories()} == {"old", "bf16", "fp32", "user-log"}  # nothing lost
    assert store.trajectories(trajectory_id="old")[0]["agent_id"] == ""
    rows = {r["trajectory_id"] for r in store.agent_trajectories(split="train", agent_id="a-bf16")}
    assert rows == {"bf16", "user-log"}  # its own rows and the user's imports; never another dtype's or the old agent's
    assert {r["trajectory_id"] for r in store.agent_trajectories(split="train", agent_id="a-bf16", imported=False)} == {"bf16"}


def test_the_same_conversation_by_another_agent_is_another_trajectory() -> None:
    from trace_assets.agent.rollout import trajectory_id

    messages = [{"role": "user", "content": "cancel my order"}]
    assert trajectory_id("t", "base", 0, messages) == trajectory_id("t", "base", 0, messages, "")  # old ids stay
    assert trajectory_id("t", "base", 0, messages, "a-bf16") != trajectory_id("t", "base", 0, messages, "a-fp32")


def test_the_gate_path_keeps_the_null_controls_effect_too_or_moves_to_float32(tiny_model_path: Path, tmp_path: Path,
                                                                               monkeypatch) -> None:
    """The adapter-vs-null comparison is fair only where both are applied as trained: the null is
    probed on the adapter's path (judged on the adapter's scale), and where it fails there the
    evaluation moves to the next (float32) candidate, with the null active during its probe."""
    from peft import LoraConfig, get_peft_model

    from trace_assets.agent import fidelity
    from trace_assets.agent.model import load_model
    from trace_assets.assets.train import fidelity_checked
    from trace_assets.train.heldout import NULL_ADAPTER

    torch.manual_seed(0)
    peft = get_peft_model(load_model(str(tiny_model_path))[0], LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                                          init_lora_weights=False))
    peft.save_pretrained(tmp_path / "trained")
    null_dir = null_adapter(tmp_path / "trained", tmp_path / "null", seed=1)

    def report(path: str, rms_error: float, rms_shift: float) -> fidelity.FidelityReport:
        return fidelity.FidelityReport(path=path, n_tokens=100, correlation=0.99, rel_rms_error=rms_error / rms_shift,
                                       max_abs_error=rms_error, mean_shift_ref=0.0, mean_shift_path=0.0,
                                       mean_abs_shift_ref=rms_shift, onpolicy_mean_abs=rms_shift,
                                       rms_shift_ref=rms_shift, rms_error=rms_error)

    def make_check(null_error_bf16: float):
        probed = []

        def check(path, model, backend, probe):
            active = model.active_adapter
            probed.append((path, active))
            if active == NULL_ADAPTER:  # the null moves log-probs less than its twin (0.02 against 0.1)
                return report(path, null_error_bf16 if path == "bf16" else 0.001, 0.02)
            return report(path, 0.01, 0.1)
        return check, probed

    candidate = lambda label: SimpleNamespace(policy_backend_factory=lambda path: None,
                                              backend=lambda model, tok: label, backend_label=lambda backend: backend)
    models = SimpleNamespace(fidelity_candidates=lambda path: [candidate("bf16"), candidate("fp32")])
    log = SimpleNamespace(info=lambda m: None, warning=lambda m: None)

    # the null's error 0.03 nats is within 0.4 x the adapter's shift rms 0.1: bf16 stays
    check, probed = make_check(0.03)
    monkeypatch.setattr(fidelity, "check_backend", check)
    chosen, _, adapter_report, null_report = fidelity_checked(models, "base", peft, None, None, "t", log, null_dir=str(null_dir))
    assert chosen.backend(None, None) == "bf16" and null_report.path == "bf16" and adapter_report.path == "bf16"
    assert probed == [("bf16", "default"), ("bf16", NULL_ADAPTER)]
    assert peft.active_adapter == "default" and NULL_ADAPTER not in peft.peft_config  # put back as it was

    # 0.05 nats > 0.4 x 0.1: the null's effect is lost in bf16, so both move to float32
    check, probed = make_check(0.05)
    monkeypatch.setattr(fidelity, "check_backend", check)
    chosen, _, adapter_report, null_report = fidelity_checked(models, "base", peft, None, None, "t", log, null_dir=str(null_dir))
    assert chosen.backend(None, None) == "fp32" and null_report.path == "fp32" and adapter_report.path == "fp32"
    assert probed == [("bf16", "default"), ("bf16", NULL_ADAPTER), ("fp32", "default"), ("fp32", NULL_ADAPTER)]

    # without a null, only the adapter is probed, as before
    check, probed = make_check(0.05)
    monkeypatch.setattr(fidelity, "check_backend", check)
    assert fidelity_checked(models, "base", peft, None, None, "t", log)[3] is None and probed == [("bf16", "default")]
