"""Adapter fidelity: a realistic small-norm adapter's effect survives every generation path.

Metric (``trace_assets/agent/fidelity.py``): the per-token log-prob shift (adapter minus base) of a
path against PEFT fp32's on the same tokens, over a few hundred assistant tokens of expert
conversations. Tolerance: ``DEFAULT_TOLERANCE`` (correlation >= 0.95, relative error <= 0.40),
passed with a wide margin by fp32 paths (r > 0.999 here) and by the bf16 weight sync on the demo
model; failed by a stale or missing adapter (r = 0) and by a bf16 engine on the tiny random model,
whose delta is far below bf16's rounding step of its weights.

The adapter: 4 AdamW steps at lr 1e-4 (``fidelity.small_norm_adapter``), what a few GRPO iterations
at the demo's lr leave, not a large random one.

Paths: transformers (GRPO sampling, held-out evaluation and ``router_eval`` without vLLM); vLLM
weight sync (the same on CPU with vLLM, and soft compositions); vLLM LoRA requests (``router_eval``
on a LoRA engine; ``trace serve`` serves adapters through the same LoRA kernels).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from trace_assets.agent import fidelity
from trace_assets.agent.backends import TransformersBackend
from trace_assets.envs import get_environment
from trace_assets.envs.retail.expert import demonstrate

ENV = get_environment("retail")
TIGHT = fidelity.FidelityTolerance(min_correlation=0.999, max_rel_rms_error=0.05)
"""What an fp32 path must meet: the same arithmetic up to summation order."""


def _probe(tokenizer: Any, n: int = 2, tokens: int = 300) -> fidelity.Probe:
    tasks = [ENV.make_task(family, 40 + i) for i, family in enumerate(ENV.families()[:n])]
    return fidelity.make_probe(tokenizer, [demonstrate(ENV, t)[0] for t in tasks], ENV.tool_schemas(), max_tokens=tokens)


@pytest.fixture(scope="module")
def realistic(tiny_model_path: Path, tokenizer: Any) -> tuple[Any, fidelity.Probe]:
    from trace_assets.agent.model import load_model

    probe = _probe(tokenizer)
    peft = fidelity.small_norm_adapter(load_model(str(tiny_model_path))[0], probe, steps=4, lr=1e-4)
    return peft, probe


def test_transformers_path_is_exact_for_a_small_adapter(realistic, tokenizer) -> None:
    peft, probe = realistic
    assert probe.n_tokens >= 250
    assert 0 < fidelity.delta_rms(peft) < 1e-3  # the demo's 4-iteration adapter: 4.2e-5; random test ones: ~1e-1
    report = fidelity.check_backend("transformers", peft, TransformersBackend(peft, tokenizer), probe)
    assert report.mean_abs_shift_ref > 1e-4  # small, but a real effect on log-probs
    assert report.passed(TIGHT), report.line()


def test_a_stale_or_missing_adapter_fails(realistic, tokenizer) -> None:
    """The path serves the base where the adapter should be: shift 0, r = 0, error 1."""
    peft, probe = realistic
    backend = TransformersBackend(peft, tokenizer)

    def base():
        with peft.disable_adapter():
            return backend.score(probe.sequences)

    report = fidelity.measure("stale", peft, probe, base, base)
    assert report.correlation == 0.0 and report.rel_rms_error == pytest.approx(1.0)
    assert not report.passed()
    with pytest.raises(fidelity.FidelityError, match="stale.*correlation 0.000"):
        fidelity.require(report, "test")


def test_a_wrong_adapter_fails(realistic, tokenizer, tiny_model_path) -> None:
    """Another adapter of the same size (the null control) has no correlation with this one."""
    peft, probe = realistic
    elsewhere = fidelity.make_probe(tokenizer, [demonstrate(ENV, ENV.make_task(f, 7))[0] for f in ENV.families()[3:5]],
                                    ENV.tool_schemas(), max_tokens=200)
    other = fidelity.small_norm_adapter(_fresh(tiny_model_path), elsewhere, seed=1)
    wrong = TransformersBackend(other, tokenizer)

    def base():
        with other.disable_adapter():
            return wrong.score(probe.sequences)

    report = fidelity.measure("wrong adapter", peft, probe, lambda: wrong.score(probe.sequences), base)
    assert not report.passed(), report.line()


def test_a_control_is_judged_on_the_scale_of_its_twin() -> None:
    """A null's shift (rms ~0.005) below a path's rounding (rms 0.02) fails relative bounds, and
    passes on its twin's scale (0.1 allows 0.04); a path that invents an effect fails on either."""
    gen = torch.Generator().manual_seed(0)
    base = -torch.rand(400, generator=gen) * 3
    shift = torch.randn(400, generator=gen) * 0.005
    rounding = torch.randn(400, generator=gen) * 0.02
    invented = torch.randn(400, generator=gen) * 0.2
    null = fidelity.compare("bf16", base + shift, base, base + shift + rounding, base)
    assert null.rms_error == pytest.approx(float(rounding.pow(2).mean().sqrt()), rel=1e-6)
    assert not null.passed() and null.passed(scale=0.1) and not null.passed(scale=0.03)
    assert fidelity.require(null, "null:c", scale=0.1) is null
    wild = fidelity.compare("bf16", base + shift, base, base + shift + invented, base)
    assert not wild.passed(scale=0.1)
    with pytest.raises(fidelity.FidelityError, match="null:c.*adapter it controls for"):
        fidelity.require(wild, "null:c", scale=0.1)
    # a scale below the system's own shift changes nothing: the relative bounds apply
    twin = fidelity.compare("bf16", base + 20 * shift, base, base + 20 * shift + rounding, base)
    assert twin.passed() and twin.passed(scale=0.01)


def _fresh(path: Path) -> Any:
    from trace_assets.agent.model import load_model

    return load_model(str(path))[0]


vllm_only = pytest.mark.skipif(os.environ.get("TRACE_NO_VLLM") == "1", reason="TRACE_NO_VLLM=1")


@vllm_only
def test_vllm_weight_sync_fp32_is_exact(realistic, tiny_plain_engine) -> None:
    from trace_assets.agent.vllm_backend import VLLMBackend

    peft, probe = realistic
    backend = VLLMBackend(tiny_plain_engine, peft_model=peft, sync="weights")
    report = fidelity.check_backend("vllm weights fp32", peft, backend, probe)
    assert report.passed(TIGHT), report.line()
    assert tiny_plain_engine.weights_tag == "base"  # the base side restored the original weights


@vllm_only
def test_vllm_lora_requests_fp32_are_exact(realistic, tiny_engine, tmp_path) -> None:
    from trace_assets.agent.vllm_backend import VLLMBackend

    peft, probe = realistic
    peft.save_pretrained(tmp_path / "adapter")
    tiny_engine.register_adapter("fidelity_probe", tmp_path / "adapter")
    report = fidelity.check_backend("vllm lora fp32", peft, VLLMBackend(tiny_engine, adapter="fidelity_probe"), probe)
    assert report.passed(TIGHT), report.line()


@vllm_only
def test_soft_composition_through_weight_sync_is_exact(realistic, tokenizer, tiny_model_path, tiny_plain_engine, tmp_path) -> None:
    from trace_assets.agent.vllm_backend import VLLMBackend
    from trace_assets.route.compose import AdapterBank

    peft, probe = realistic
    peft.save_pretrained(tmp_path / "a")
    other = fidelity.small_norm_adapter(_fresh(tiny_model_path), probe, steps=4, lr=1e-4, seed=3)
    other.save_pretrained(tmp_path / "b")
    bank = AdapterBank(_fresh(tiny_model_path), {"a": tmp_path / "a", "b": tmp_path / "b"})
    with bank.composed({"a": 0.6, "b": 0.4}) as mixed:
        report = fidelity.check_backend("soft", mixed, VLLMBackend(tiny_plain_engine, peft_model=mixed, sync="weights"), probe)
    assert report.passed(TIGHT), report.line()


@vllm_only
def test_a_bf16_engine_fails_where_its_rounding_exceeds_the_adapter(realistic, tiny_bf16_engine) -> None:
    """On the tiny random model the delta is far below bf16's step at its weights: the tolerance
    catches it (measured r ~0.84, relative error ~0.45); on the demo model bf16 passes (below)."""
    from trace_assets.agent.vllm_backend import VLLMBackend

    peft, probe = realistic
    report = fidelity.check_backend("vllm weights bf16", peft, VLLMBackend(tiny_bf16_engine, peft_model=peft, sync="weights"), probe)
    assert not report.passed(), report.line()
    assert report.correlation > 0.3  # degraded, not erased: the adapter is applied


@pytest.mark.slow
@vllm_only
def test_demo_model_weight_sync_keeps_a_small_adapter_in_fp32_and_bf16(tokenizer, tmp_path) -> None:
    """The demo model with a realistic adapter through the paths the demo uses (vLLM weight sync in
    the dtype ``auto`` picks): fp32 exact; bf16 within the tolerance (the review measured r 0.976),
    where bf16 is native. Elsewhere ``auto`` never runs bf16, emulated bf16 scoring took 230 s of
    this test's 445 s, and the tiny-model bf16 tests above still run."""
    from trace_assets.agent.lora import bf16_supported, null_adapter
    from trace_assets.agent.model import ensure_demo_model, load_model
    from trace_assets.agent.vllm_backend import VLLMBackend, VLLMEngine

    from conftest import demo_engine_options

    path = str(ensure_demo_model())
    model, demo_tokenizer = load_model(path)
    probe = _probe(demo_tokenizer, n=2, tokens=300)
    peft = fidelity.small_norm_adapter(model, probe, steps=4, lr=1e-4)
    peft.save_pretrained(str(tmp_path / "adapter"))
    peft.load_adapter(str(null_adapter(tmp_path / "adapter", tmp_path / "null")), adapter_name="null")
    dtypes = [("float32", TIGHT)] + ([("bfloat16", fidelity.DEFAULT_TOLERANCE)] if bf16_supported() else [])
    for dtype, tolerance in dtypes:
        engine = VLLMEngine.shared(path, demo_engine_options(dtype))
        peft.set_adapter("default")
        report = fidelity.check_backend(f"vllm weights {dtype}", peft, VLLMBackend(engine, peft_model=peft, sync="weights"), probe)
        assert report.passed(tolerance), report.line()
        # Its null control (random directions, the same delta norm) moves the log-probs less; judged
        # on the twin's scale, the path must get that right to within the error the twin is allowed.
        peft.set_adapter("null")
        null = fidelity.check_backend(f"vllm weights {dtype} (null)", peft, VLLMBackend(engine, peft_model=peft, sync="weights"), probe)
        assert 0 < null.rms_shift_ref < report.rms_shift_ref, (null.line(), report.line())
        assert null.passed(tolerance, scale=report.rms_shift_ref), null.line()
        if dtype == "float32":  # the exact path resolves even the null's small shift
            assert null.passed(fidelity.DEFAULT_TOLERANCE), null.line()
