"""Peak RSS and time of one GRPO optimizer step under its memory options, each in a fresh process.

The parent plays one iteration of G x K episodes once (the demo's GRPO recipe on a template
synthetic environment, which starts at a decision point, so a task's samples share a long prompt;
or, with ``--capability target``, on the retail target as the GRPO-on-target baseline plays it)
and pickles the optimizer's samples. Each variant's child loads the same model with the same LoRA
init, runs ``GRPOTrainer.optimize`` on those samples (one step) and prints its own ``ru_maxrss``,
the step's time and the gradient's norm; a ``load`` child that stops before the step gives the
baseline. The reward alternates 0/1 so that every sample has a non-zero advantage (the worst case
for memory). Only execution fields vary (``micro_batch_tokens``, ``gradient_checkpointing``): the
gradient must agree across variants (its cosine to the first variant's is printed).

    .venv/bin/python benchmarks/grpo_memory.py --model demo [--agent <data>/models/base_agent/<key>]
    .venv/bin/python benchmarks/grpo_memory.py --agent <agent> --variants tokens2048+ckpt,tokens4096+ckpt,tokens4096
"""

from __future__ import annotations

import argparse
import itertools
import json
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = {  # name: (micro_batch_tokens, gradient_checkpointing)
    "tokens6144": (6144, False),
    "tokens4096": (4096, False),
    "tokens2048": (2048, False),
    "tokens6144+ckpt": (6144, True),
    "tokens4096+ckpt": (4096, True),
    "tokens2048+ckpt": (2048, True),
}


def _config(args: argparse.Namespace):
    from trace_assets.settings import DEMO_GRPO

    return replace(DEMO_GRPO, groups=args.groups, samples_per_group=args.samples, iterations=1)


def _env(capability: str):
    """The template synthetic environment of ``capability``, or with ``"target"`` the retail target
    itself, played from the first turn as GRPO-on-target plays it (its samples are the longest)."""
    from trace_assets.envs import get_environment
    from trace_assets.synthesize import SyntheticEnv, template_spec

    target = get_environment("retail")
    if capability == "target":
        from trace_assets.envs.splits import TaskPoolEnv

        return TaskPoolEnv(target, [target.make_task(f, 10_000 + i) for i, f in enumerate(target.families())])
    return SyntheticEnv(template_spec({"name": capability, "description": capability}, target), target)


def _trainer(args: argparse.Namespace, config, out: str):
    from trace_assets.agent.model import load_model
    from trace_assets.train.grpo import GRPOTrainer

    model, tokenizer = load_model(args.agent or args.model)
    counter = itertools.count()
    return GRPOTrainer(model, tokenizer, _env(args.capability), config, out, reward_fn=lambda r: float(next(counter) % 2))


def child(args: argparse.Namespace) -> None:
    import resource

    import torch

    tokens, ckpt = VARIANTS.get(args.child, (6144, False))
    config = replace(_config(args), micro_batch_tokens=tokens, gradient_checkpointing=ckpt)
    samples = pickle.loads(Path(args.samples_file).read_bytes())
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(args, config, out)
        report: dict = {}
        if args.child != "load":
            grads = []
            trainer.optimizer.step = lambda: grads.append(torch.cat([p.grad.flatten() for p in trainer.params]))
            start = time.perf_counter()
            trainer.optimize(samples, 1)
            report["step_s"] = round(time.perf_counter() - start, 1)
            torch.save(grads[0], args.grad_file)
    report["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(report))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--agent", default=None, help="a warm-started agent folder (default: the model itself)")
    ap.add_argument("--capability", default="confirm_before_writing", help='a capability, or "target"')
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--samples-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--grad-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(args, _config(args), tmp)
        start = time.perf_counter()
        _, samples = trainer.collect(1)
        print(f"{len(samples)} samples, {sum(len(s.token_ids) for s in samples)} tokens "
              f"({sum(sum(s.loss_mask) for s in samples)} generated), played in {time.perf_counter() - start:.0f} s", flush=True)
        del trainer
        samples_file = Path(tmp) / "samples.pkl"
        samples_file.write_bytes(pickle.dumps(samples))
        first, first_s = None, None
        for name in ["load", *[v.strip() for v in args.variants.split(",") if v.strip()]]:
            grad_file = Path(tmp) / f"{name}.pt"
            cmd = [sys.executable, __file__, "--child", name, "--samples-file", str(samples_file), "--grad-file", str(grad_file),
                   "--model", args.model, "--capability", args.capability, "--groups", str(args.groups), "--samples", str(args.samples)]
            if args.agent:
                cmd += ["--agent", args.agent]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            row = json.loads(out)
            line = f"{name:16s} peak RSS {row['peak_rss_mb']:6d} MB"
            if name != "load":
                grad = torch.load(grad_file).double()
                first = grad if first is None else first
                first_s = first_s or row["step_s"]
                cosine = float(torch.nn.functional.cosine_similarity(grad, first, dim=0))
                line += (f"  step {row['step_s']:6.1f} s (x{first_s / row['step_s']:.2f} the first's speed)"
                         f"  |grad| {float(grad.norm()):.4g}  cosine to first {cosine:.6f}")
            print(line, flush=True)


if __name__ == "__main__":
    main()
