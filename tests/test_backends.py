"""TransformersBackend: the KV-loop engine with the shared-prefix cache against the HF reference.

Fast tests use the tiny random Llama (fp32: cached, uncached and HF ``generate`` paths must be
token-identical at T = 0). The slow test uses the demo model on real retail first prompts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trace_assets.agent.backends import GenerationBackend, SamplingParams, TransformersBackend

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from trace_assets.agent.model import load_model

    torch.set_num_threads(2)
    return load_model(str(tiny_model_path))


def _encode(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def _shared(tok: Any, n: int = 5) -> list[list[int]]:
    """Prompts with a ~200-token common system prefix and user turns of different lengths."""
    system = {"role": "system", "content": "You are a careful retail agent. Follow the policy. " * 20}
    return [_encode(tok, [system, {"role": "user", "content": "order #%d " % k + "please " * (3 * k)}]) for k in range(n)]


def _ids(gens) -> list[list[int]]:
    return [g.token_ids for g in gens]


def test_prefix_cached_equals_uncached_and_hf_greedy(tiny):
    model, tok = tiny
    prompts = _shared(tok)
    assert len({len(p) for p in prompts}) == len(prompts)  # differing suffix lengths -> mid padding
    cached = TransformersBackend(model, tok, batch_size=4)
    assert isinstance(cached, GenerationBackend)
    a = cached.generate(prompts, GREEDY)
    assert cached.prefix_computations == 1 and cached.prefix_tokens_computed >= 64
    b = TransformersBackend(model, tok, batch_size=4, prefix_cache=False).generate(prompts, GREEDY)
    c = TransformersBackend(model, tok, batch_size=4, engine="hf").generate(prompts, GREEDY)
    assert _ids(a) == _ids(b) == _ids(c)
    for x, y, z in zip(a, b, c):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
        assert x.logprobs == pytest.approx(z.logprobs, abs=1e-4)
        assert x.text == tok.decode(x.token_ids) and x.finish_reason == z.finish_reason


def test_logprobs_match_a_forward_pass(tiny):
    model, tok = tiny
    prompts = _shared(tok, 3)
    backend = TransformersBackend(model, tok)
    for temperature in (0.0, 0.7):
        gens = backend.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=8, seed=1))
        for prompt, gen in zip(prompts, gens):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + gen.token_ids])).logits[0].float()
            scaled = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
            ref = [scaled[len(prompt) - 1 + i, t].item() for i, t in enumerate(gen.token_ids)]
            assert gen.logprobs == pytest.approx(ref, abs=1e-3)


def test_seeded_sampling_is_reproducible(tiny):
    model, tok = tiny
    prompts = _shared(tok, 4)
    backend = TransformersBackend(model, tok, batch_size=4)
    p = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=7)
    state = torch.random.get_rng_state()
    a, b = backend.generate(prompts, p), backend.generate(prompts, p)
    assert torch.equal(state, torch.random.get_rng_state())  # the global RNG is untouched
    assert _ids(a) == _ids(b)
    # A fresh backend (prefix computed anew, not reused) samples the same.
    assert _ids(TransformersBackend(model, tok, batch_size=4).generate(prompts, p)) == _ids(a)
    c = backend.generate(prompts, SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=8))
    assert _ids(a) != _ids(c)
    assert len({tuple(g.token_ids) for g in a}) > 1  # rows of one batch get different samples


def test_prefix_is_reused_and_extended_across_calls(tiny):
    model, tok = tiny
    prompts = _shared(tok, 4)
    backend = TransformersBackend(model, tok)
    first = backend.generate(prompts, GREEDY)
    built = backend.prefix_tokens_computed
    assert backend.prefix_computations == 1
    # The next "turn": every conversation grew, the shared system prefix did not.
    grown = [p + g.token_ids + _encode(tok, [{"role": "user", "content": "ok"}]) for p, g in zip(prompts, first)]
    backend.generate(grown, GREEDY)
    backend.generate(prompts[1:], GREEDY)
    assert backend.prefix_computations == 1 and backend.prefix_tokens_computed == built
    # One episode left: its whole prompt is the common prefix; only the new tokens are computed.
    alone = backend.generate([grown[0]], GREEDY)
    assert backend.prefix_computations == 2
    assert backend.prefix_tokens_computed == built + (len(grown[0]) - 1 - built)
    ref = TransformersBackend(model, tok, engine="hf").generate([grown[0]], GREEDY)
    assert _ids(alone) == _ids(ref)


def test_weight_updates_invalidate_the_prefix_cache(tiny):
    model, tok = tiny
    prompts = _shared(tok, 2)
    backend = TransformersBackend(model, tok)
    backend.generate(prompts, GREEDY)
    backend.generate(prompts, GREEDY)
    assert backend.prefix_computations == 1
    with torch.no_grad():
        next(model.parameters()).mul_(1.0)  # an in-place update (same values) bumps the version
    backend.generate(prompts, GREEDY)
    assert backend.prefix_computations == 2
    backend.clear_prefix_cache()
    backend.generate(prompts, GREEDY)
    assert backend.prefix_computations == 3


def test_no_cross_talk_when_rows_finish_at_different_steps(tiny):
    model, tok = tiny
    prompts = _shared(tok, 5)
    free = TransformersBackend(model, tok).generate(prompts, GREEDY)
    # Declare a token that row 0 emits early the "stop" token, so rows leave the batch at
    # different steps; every row must still match generating it alone with HF generate.
    stop = free[0].token_ids[3]
    batched = TransformersBackend(model, tok, batch_size=5)
    batched.stop_id = stop
    out = batched.generate(prompts + [prompts[2]], GREEDY)
    assert out[0].finish_reason == "stop" and out[0].token_ids[-1] == stop
    assert len({len(g.token_ids) for g in out}) > 1
    assert out[5].token_ids == out[2].token_ids and out[5].logprobs == pytest.approx(out[2].logprobs, abs=1e-5)
    for prompt, gen in zip(prompts, out):
        alone = TransformersBackend(model, tok, batch_size=1, engine="hf")
        alone.stop_id = stop
        ref = alone.generate([prompt], GREEDY)[0]
        assert gen.token_ids == ref.token_ids and gen.finish_reason == ref.finish_reason
        assert gen.logprobs == pytest.approx(ref.logprobs, abs=1e-4)


def test_prompts_without_a_shared_prefix(tiny):
    model, tok = tiny
    prompts = [tok.encode(t, add_special_tokens=False) for t in ["hi", "tell me a story about a cat", "x " * 40]]
    backend = TransformersBackend(model, tok, batch_size=2)
    a = backend.generate(prompts, GREEDY)
    assert backend.prefix_computations == 0
    ref = TransformersBackend(model, tok, batch_size=2, engine="hf").generate(prompts, GREEDY)
    assert _ids(a) == _ids(ref)
    assert backend.generate([], GREEDY) == []
    with pytest.raises(ValueError):
        backend.generate([[]], GREEDY)


def test_bf16_autocast_runs_and_keeps_fp32_logprobs(tiny):
    model, tok = tiny
    prompts = _shared(tok, 3)
    weights = next(model.parameters()).dtype
    gens = TransformersBackend(model, tok, dtype="bfloat16").generate(prompts, GREEDY)
    assert next(model.parameters()).dtype == weights  # the shared model is not converted
    for gen in gens:
        assert 1 <= len(gen.token_ids) <= GREEDY.max_new_tokens
        assert all(lp <= 0.0 and lp == lp for lp in gen.logprobs)
    assert isinstance(TransformersBackend(model, tok, dtype="auto").bf16, bool)
    with pytest.raises(ValueError):
        TransformersBackend(model, tok, dtype="float16")  # type: ignore[arg-type]


# ---------------------------------------------------------------- the demo model on retail prompts


@pytest.mark.slow
def test_demo_model_retail_prompts_cached_vs_plain():
    """fp32: prefix-cached KV loop == HF ``generate`` token for token on real ~1,150-token prompts.

    bf16 (autocast prefill, fp32 decode): measured on these 4 prompts x 48 greedy tokens, 171/171
    tokens identical to fp32, log-probs within 0.07 nats. Rounding may legitimately flip a near-tie
    later on other prompts, so we assert a looser bound: the first 8 tokens of every prompt, >= 90%
    of all positions, and log-probs within 0.25 on the tokens before the first disagreement.
    """
    from trace_assets.agent.model import ensure_demo_model, load_model
    from trace_assets.envs import get_environment

    model, tok = load_model(str(ensure_demo_model()))
    env = get_environment("retail")
    families = env.families()
    prompts = []
    for i in range(4):
        episode = env.start(env.make_task(families[i % len(families)], 2000 + i))
        text = tok.apply_chat_template(episode.initial_messages(), tools=env.tool_schemas(),
                                       add_generation_prompt=True, tokenize=False)
        prompts.append(tok.encode(text, add_special_tokens=False))
    params = SamplingParams(temperature=0.0, max_new_tokens=48)
    plain = TransformersBackend(model, tok, engine="hf", dtype="float32").generate(prompts, params)
    cached_backend = TransformersBackend(model, tok, dtype="float32")
    cached = cached_backend.generate(prompts, params)
    assert cached_backend.prefix_tokens_computed > 1000
    assert _ids(cached) == _ids(plain)
    for x, y in zip(cached, plain):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-3)

    bf16 = TransformersBackend(model, tok, dtype="bfloat16").generate(prompts, params)
    same = total = 0
    for x, y in zip(bf16, cached):
        assert x.token_ids[:8] == y.token_ids[:8]
        total += max(len(x.token_ids), len(y.token_ids))
        same += sum(a == b for a, b in zip(x.token_ids, y.token_ids))
        k = next((i for i, (a, b) in enumerate(zip(x.token_ids, y.token_ids)) if a != b), len(x.token_ids))
        assert x.logprobs[:k] == pytest.approx(y.logprobs[:k], abs=0.25)
    assert same / total >= 0.9, f"bf16/fp32 token agreement {same}/{total}"
