"""AdapterBank (switching, bit-exact merge/restore, exact "cat" composition), soft weights, routed runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trace_assets.route.compose import AdapterBank, plan_groups, route_and_run, soft_weights
from trace_assets.route.router import Decision

LAYER = "base_model.model.model.layers.0.self_attn.q_proj"


def _make_adapter(tiny_model_path: Path, folder: Path, seed: int, r: int) -> Path:
    from peft import get_peft_model

    from trace_assets.agent.lora import lora_config
    from trace_assets.agent.model import load_model

    model, _ = load_model(str(tiny_model_path))
    peft_model = get_peft_model(model, lora_config(r=r, alpha=2 * r))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:  # fresh LoRA has B = 0 (a no-op); randomise it
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def adapters(tiny_model_path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"a": _make_adapter(tiny_model_path, root / "a", 1, r=4),
            "b": _make_adapter(tiny_model_path, root / "b", 2, r=2)}


@pytest.fixture()
def bank(tiny_model_path, adapters) -> AdapterBank:
    from trace_assets.agent.model import load_model

    model, _ = load_model(str(tiny_model_path))
    return AdapterBank(model, adapters)


def _base_state(bank: AdapterBank) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in bank.model.get_base_model().state_dict().items() if "lora_" not in k}


def _logits(model: Any, tokenizer: Any) -> torch.Tensor:
    ids = torch.tensor([tokenizer.encode("Hello, I want to return an item from order #W1234.")])
    with torch.inference_mode():
        return model(input_ids=ids).logits.clone()


# ---------------------------------------------------------------- soft weights and groups


def test_soft_weights_top_p_and_base_handling():
    probs = {"a": 0.5, "b": 0.3, None: 0.15, "c": 0.05}
    assert soft_weights(probs, 0.4) == {"a": 1.0}
    w = soft_weights(probs, 0.8)
    assert w == pytest.approx({"a": 0.625, "b": 0.375}) and sum(w.values()) == pytest.approx(1.0)
    # the base is kept by top-p but has no delta: dropped, the rest renormalised
    w = soft_weights(probs, 0.9)
    assert set(w) == {"a", "b"} and sum(w.values()) == pytest.approx(1.0)
    w = soft_weights(probs, 1.0)
    assert set(w) == {"a", "b", "c"} and w["c"] == pytest.approx(0.05 / 0.85)
    assert soft_weights({None: 0.7, "a": 0.3}, 0.6) == {}  # base alone reaches top_p: run the base
    assert soft_weights({None: 0.7, "a": 0.3}, 0.9) == {"a": 1.0}


def test_plan_groups_hard_and_soft():
    d = [Decision("a", {"a": 0.9, "b": 0.05, None: 0.05}, "A"),
         Decision(None, {"a": 0.2, "b": 0.2, None: 0.6}, "C"),
         Decision("a", {"a": 0.5, "b": 0.45, None: 0.05}, "A")]
    hard = plan_groups(d)
    assert [(g.key, g.indices) for g in hard] == [("a", [0, 2]), ("base", [1])]
    soft = plan_groups(d, soft_top_p=0.9)
    assert [(g.adapter, g.indices) for g in soft][:1] == [("a", [0])]
    assert soft[1].adapter is None and soft[1].weights == pytest.approx({"a": 0.5, "b": 0.5})
    assert soft[2].weights == pytest.approx({"a": 0.5 / 0.95, "b": 0.45 / 0.95})


# ---------------------------------------------------------------- the bank


def test_use_switches_adapters_and_never_touches_the_base(bank, tokenizer):
    before = _base_state(bank)
    with bank.use(None) as m:
        base1 = _logits(m, tokenizer)
    with bank.use("a") as m:
        out_a = _logits(m, tokenizer)
    with bank.use("b") as m:
        out_b = _logits(m, tokenizer)
    with bank.use(None) as m:
        base2 = _logits(m, tokenizer)
    assert torch.equal(base1, base2)
    assert not torch.allclose(out_a, base1, atol=1e-3) and not torch.allclose(out_b, base1, atol=1e-3)
    assert not torch.allclose(out_a, out_b, atol=1e-3)
    after = _base_state(bank)
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(KeyError):
        with bank.use("nope"):
            pass


def test_merge_then_restore_is_bit_exact(bank, tokenizer):
    before = _base_state(bank)
    with bank.use("a") as m:
        unmerged = _logits(m, tokenizer)
    with bank.merged("a") as m:
        merged = _logits(m, tokenizer)
        changed = _base_state(bank)
    assert any(not torch.equal(before[k], changed[k]) for k in before)  # really merged
    assert torch.allclose(merged, unmerged, atol=1e-4)  # W + BA on the fly == merged W'
    after = _base_state(bank)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert bank.last_unmerge_exact in (True, False)  # recorded; restored from the snapshot if False
    with bank.use(None) as m:
        assert torch.equal(_logits(m, tokenizer), _logits(m, tokenizer))


def test_cat_composition_equals_the_weighted_sum_of_deltas(bank, tokenizer):
    alphas = {"a": 0.7, "b": 0.3}
    layer = bank.model.get_submodule(LAYER)
    manual = sum(alpha * layer.scaling[name] * (layer.lora_B[name].weight @ layer.lora_A[name].weight)
                 for name, alpha in alphas.items())
    names_before = set(bank.model.peft_config)
    before = _base_state(bank)
    with bank.composed(alphas) as m:
        tmp = bank.active
        assert tmp not in ("a", "b")
        delta = layer.get_delta_weight(tmp)
        assert torch.allclose(delta, manual, atol=1e-6, rtol=1e-5)
        composed_out = _logits(m, tokenizer)
    assert set(bank.model.peft_config) == names_before and bank.active == "a"
    assert all(torch.equal(before[k], v) for k, v in _base_state(bank).items())
    with bank.use("a") as m:
        assert not torch.allclose(_logits(m, tokenizer), composed_out, atol=1e-4)
    with bank.composed({"b": 1.0}) as m:  # a single full weight is the adapter itself
        assert bank.active == "b"
    with bank.composed({}) as m:  # nothing kept: the base
        with bank.use(None) as base:
            expected = _logits(base, tokenizer)
        assert torch.equal(_logits(m, tokenizer), expected)


# ---------------------------------------------------------------- routed rollouts


class _RecordingBackend:
    """Answers every prompt with a plain final message and records which adapter was live."""

    name = "recording"

    def __init__(self, bank: AdapterBank, tokenizer: Any, log: list[tuple[str, int]]) -> None:
        self.bank, self.tokenizer, self.log = bank, tokenizer, log

    def generate(self, prompts, params):
        from trace_assets.agent.backends import Generation

        layer = self.bank.model.get_submodule(LAYER)
        live = "base" if layer.disable_adapters else self.bank.active
        self.log.append((live, len(prompts)))
        stop = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids = self.tokenizer.encode("Goodbye.", add_special_tokens=False) + [stop]
        return [Generation(token_ids=ids, text="Goodbye.<|im_end|>", logprobs=[0.0] * len(ids), finish_reason="stop")
                for _ in prompts]


def test_route_and_run_groups_by_adapter_and_keeps_task_order(bank, tokenizer):
    from trace_assets.agent.rollout import RolloutConfig
    from trace_assets.envs.retail.env import RetailEnv

    env = RetailEnv(max_user_turns=1)
    tasks = [env.make_task(env.families()[i % len(env.families())], 100 + i) for i in range(4)]
    decisions = [Decision("a", {"a": 1.0}, "A"), Decision(None, {None: 1.0}, "C"),
                 Decision("a", {"a": 1.0}, "A"), Decision("b", {"b": 0.6, "a": 0.4}, "B")]
    log: list[tuple[str, int]] = []
    config = RolloutConfig(max_steps=1, max_new_tokens=8)
    rollouts = route_and_run(tasks, decisions, env, bank, tokenizer, config,
                             lambda model, tok: _RecordingBackend(bank, tok, log))
    assert [r.task.task_id for r in rollouts] == [t.task_id for t in tasks]
    assert log == [("a", 2), ("base", 1), ("b", 1)]  # one batch per adapter group
    log.clear()
    route_and_run(tasks, decisions, env, bank, tokenizer, config,
                  lambda model, tok: _RecordingBackend(bank, tok, log), soft_top_p=0.9)
    assert [n for _, n in log] == [2, 1, 1] and log[2][0].startswith("composed_")
    assert set(bank.model.peft_config) == {"a", "b"}


def test_route_and_run_with_the_real_backend_matches_direct_runs(bank, tokenizer):
    from trace_assets.agent.backends import TransformersBackend
    from trace_assets.agent.rollout import RolloutConfig, run_rollouts
    from trace_assets.envs.retail.env import RetailEnv

    env = RetailEnv(max_user_turns=1)
    tasks = [env.make_task(env.families()[0], 200 + i) for i in range(2)]
    config = RolloutConfig(max_steps=1, max_new_tokens=6)
    factory = lambda model, tok: TransformersBackend(model, tok, batch_size=4)  # noqa: E731
    routed = route_and_run(tasks, [Decision("a", {"a": 1.0}, "A"), Decision(None, {None: 1.0}, "C")],
                           env, bank, tokenizer, config, factory)
    with bank.use("a") as m:
        direct_a = run_rollouts(env, tasks[:1], factory(m, tokenizer), tokenizer, config)[0]
    with bank.use(None) as m:
        direct_base = run_rollouts(env, tasks[1:], factory(m, tokenizer), tokenizer, config)[0]
    assert routed[0].token_ids == direct_a.token_ids
    assert routed[1].token_ids == direct_base.token_ids
    with bank.use(None) as m:  # and the adapter did change what task 0 got
        base_0 = run_rollouts(env, tasks[:1], factory(m, tokenizer), tokenizer, config)[0]
    assert routed[0].assistant_texts != base_0.assistant_texts
