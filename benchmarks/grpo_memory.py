"""Peak RSS and time of one GRPO optimizer step under its memory options, each in a fresh process.

The parent plays one iteration of G x K episodes once (the demo's GRPO recipe on a template
synthetic environment, which starts at a decision point, so a task's samples share a long prompt;
or, with ``--capability target``, on the retail target as the GRPO-on-target baseline plays it) and
pickles the optimizer's samples. Each variant's child loads the same model with the same LoRA init,
runs ``GRPOTrainer.optimize`` on those samples (one step) and prints its own ``ru_maxrss``, the
step's time and the gradient's norm; a ``load`` child that stops before the step gives the baseline.
The reward alternates 0/1 so that every sample has a non-zero advantage (the worst case for memory),
but under ``--expert-guidance``, whose rewards are the environment's own. Execution fields vary:
a variant's name joins ``seqsN`` (``micro_batch_size``, default the demo's), ``tokensN``
(``micro_batch_tokens``), ``ckpt`` (``gradient_checkpointing``), ``pack`` (``pack_suffixes`` true:
every micro-batch packed) and ``autopack`` (``"auto"``: packed where estimated cheaper) with ``+``.
One recipe field can vary too: ``fp32`` trains without bf16 autocast (``bf16 = false``; otherwise
the trainer's ``auto``), a precision change, not an execution one, whose effect the
gradient cosine shows. Each line also counts the forward positions the step runs against the tokens
they hold (the rest is padding). ``--keep-samples`` keeps the played iteration, so that a later run
steps on the very same samples. ``engine`` plays an
iteration through the pipeline's vLLM engine in the child first, so that the step runs beside the
engine's KV cache and threads as in training. The gradient must agree across variants (its cosine to
the first variant's is printed). ``--spec`` plays a stored EnvSpec instead of the template's, and
``--expert-guidance`` adds the expert's play to each group, as ``benchmarks/learning_curve.py``
trains (a group is then K + 1 samples, so ``seqs5`` runs each task's prompt once where the demo's 4
runs it twice).

    .venv/bin/python benchmarks/grpo_memory.py --model demo [--agent <data>/models/base_agent/<key>]
    .venv/bin/python benchmarks/grpo_memory.py --agent <agent> --variants tokens2048+ckpt,tokens4096+ckpt,tokens4096
    .venv/bin/python benchmarks/grpo_memory.py --agent <agent> --spec docs/transfer/heldout_v12.envspec.json \
        --expert-guidance --variants tokens4096+ckpt,tokens4096+ckpt+engine,seqs5+tokens8192,seqs5+tokens8192+engine
    .venv/bin/python benchmarks/grpo_memory.py --agent <agent> --spec docs/transfer/heldout_v12.envspec.json \
        --expert-guidance --variants seqs5+tokens8192,seqs5+tokens8192+fp32,tokens4096+ckpt+fp32
    .venv/bin/python benchmarks/grpo_memory.py --agent <agent> --spec docs/transfer/heldout_v12.envspec.json \
        --expert-guidance --keep-samples /tmp/v12_guided.pkl --variants seqs5+tokens8192+fp32,seqs5+tokens8192+fp32+pack
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

VARIANTS = "tokens6144,tokens4096,tokens2048,tokens6144+ckpt,tokens4096+ckpt,tokens2048+ckpt"


def variant_fields(name: str) -> dict:
    """The execution fields a variant's name sets: ``seqs4+tokens4096+ckpt`` -> micro_batch_size 4,
    micro_batch_tokens 4096, gradient_checkpointing on; an unnamed field keeps the demo's value but
    the checkpointing and the packing, which are off unless named (``pack``: ``pack_suffixes`` true,
    ``autopack``: ``"auto"``).
    ``fp32`` sets ``bf16 = false``. ``engine`` sets no field: that child first plays one iteration
    through the pipeline's vLLM engine, so the step runs beside it as in training."""
    fields: dict = {"gradient_checkpointing": False, "pack_suffixes": False}
    for part in name.split("+"):
        if part == "engine":
            continue  # not a field: the child plays an iteration through the vLLM engine first
        if part == "ckpt":
            fields["gradient_checkpointing"] = True
        elif part == "fp32":
            fields["bf16"] = False
        elif part == "pack":
            fields["pack_suffixes"] = True
        elif part == "autopack":
            fields["pack_suffixes"] = "auto"
        elif part.startswith("seqs") and part[4:].isdigit():
            fields["micro_batch_size"] = int(part[4:])
        elif part.startswith("tokens") and part[6:].isdigit():
            fields["micro_batch_tokens"] = int(part[6:])
        else:
            raise SystemExit(f"variant {name!r}: {part!r} is none of seqsN, tokensN, ckpt, pack, autopack, fp32, engine")
    return fields


def forward_positions(samples: list, config, model_config) -> tuple[int, int]:
    """``(positions, tokens)`` of one optimizer step on ``samples`` under ``config``: the positions
    its forward passes run, as ``agent.lora.token_logprobs`` pads them (widths rounded up to
    ``SHAPE_BUCKET``, a shared prefix rounded down to it and run once, the rest packed into one
    sequence where ``agent.lora.packs`` says so for the model of ``model_config``), and the tokens they hold
    (each micro-batch's shared prefix counted once). The difference is padding."""
    from trace_assets.agent.lora import SHAPE_BUCKET, packed_width, packs, prefix_run
    from trace_assets.train.grpo import common_prefix_len, training_plan

    active, chunks = training_plan(samples, config)
    positions = tokens = 0
    for chunk in chunks:
        rows = [active[i].token_ids for i in chunk]
        width = -(-max(map(len, rows)) // SHAPE_BUCKET) * SHAPE_BUCKET
        shared = min((common_prefix_len(rows[0], r) for r in rows[1:]), default=0)
        prefix = prefix_run(shared, width)
        suffixes = [len(r) - prefix for r in rows]
        if prefix and packs(config.pack_suffixes, suffixes, prefix, width, model_config):
            positions += prefix + packed_width(suffixes)  # the rows after the prefix as one sequence
        else:
            positions += prefix + len(rows) * (width - prefix)
        tokens += shared + sum(len(r) - shared for r in rows)
    return positions, tokens


def _config(args: argparse.Namespace):
    from trace_assets.settings import DEMO_GRPO

    return replace(DEMO_GRPO, groups=args.groups, samples_per_group=args.samples, iterations=1,
                   expert_guidance=args.expert_guidance)


def _env(capability: str, spec: str | None = None):
    """The template synthetic environment of ``capability`` (or the stored EnvSpec ``spec``), or with
    ``"target"`` the retail target itself, played from the first turn as GRPO-on-target plays it
    (its samples are the longest)."""
    from trace_assets.envs import get_environment
    from trace_assets.synthesize import SyntheticEnv, load_spec, template_spec

    target = get_environment("retail")
    if spec:
        return SyntheticEnv(load_spec(Path(spec), target), target)
    if capability == "target":
        from trace_assets.envs.splits import TaskPoolEnv

        return TaskPoolEnv(target, [target.make_task(f, 10_000 + i) for i, f in enumerate(target.families())])
    return SyntheticEnv(template_spec({"name": capability, "description": capability}, target), target)


def _trainer(args: argparse.Namespace, config, out: str, *, engine: bool = False):
    """The trainer; with ``engine``, generating through the pipeline's policy backend (vLLM with
    weight sync in this process where vLLM runs, float32) as ``benchmarks/learning_curve.py`` does."""
    from trace_assets.agent.model import load_model
    from trace_assets.train.grpo import GRPOTrainer

    agent = args.agent or args.model
    model, tokenizer = load_model(agent)
    counter = itertools.count()
    # Guidance scores the expert with the environment's own reward, so the rewards are real then.
    reward_fn = None if config.expert_guidance else (lambda r: float(next(counter) % 2))
    factory = None
    if engine:
        from trace_assets.definitions import build_resources
        from trace_assets.settings import load_settings

        factory = build_resources(load_settings())["models"].exact().policy_backend_factory(agent)
    return GRPOTrainer(model, tokenizer, _env(args.capability, args.spec), config, out, reward_fn=reward_fn,
                       **({"backend_factory": factory} if factory else {}))


def child(args: argparse.Namespace) -> None:
    import resource

    import torch

    config = replace(_config(args), **(variant_fields(args.child) if args.child != "load" else {}))
    samples = pickle.loads(Path(args.samples_file).read_bytes())
    engine = "engine" in args.child.split("+")
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(args, config, out, engine=engine)
        report: dict = {}
        if engine:  # the engine, its KV cache and a weight sync live in this process, as in training
            start = time.perf_counter()
            trainer.collect(1)
            report["played_s"] = round(time.perf_counter() - start, 1)
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
    ap.add_argument("--spec", default=None, help="play this stored EnvSpec instead of the template's")
    ap.add_argument("--expert-guidance", action="store_true", help="add the expert's play to each group")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--keep-samples", default=None, metavar="PATH",
                    help="play the iteration once and keep its samples here; later runs read them instead of playing")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--samples-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--grad-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        samples_file = Path(args.keep_samples) if args.keep_samples else Path(tmp) / "samples.pkl"
        if samples_file.exists():  # the same samples as an earlier run: steps compare across runs too
            samples = pickle.loads(samples_file.read_bytes())
            print(f"{len(samples)} samples from {samples_file}")
        else:
            trainer = _trainer(args, _config(args), tmp)
            start = time.perf_counter()
            _, samples = trainer.collect(1)
            print(f"{len(samples)} samples, {sum(len(s.token_ids) for s in samples)} tokens "
                  f"({sum(sum(s.loss_mask) for s in samples)} generated), played in {time.perf_counter() - start:.0f} s",
                  flush=True)
            del trainer
            samples_file.write_bytes(pickle.dumps(samples))
        from transformers import AutoConfig

        from trace_assets.agent.model import resolve_model

        model_config = AutoConfig.from_pretrained(resolve_model(args.agent or args.model))
        first, first_s = None, None
        names = [v.strip() for v in args.variants.split(",") if v.strip()]
        for name in names:
            variant_fields(name)  # a bad name fails before any child runs
        for name in ["load", *names]:
            grad_file = Path(tmp) / f"{name}.pt"
            cmd = [sys.executable, __file__, "--child", name, "--samples-file", str(samples_file), "--grad-file", str(grad_file),
                   "--model", args.model, "--capability", args.capability, "--groups", str(args.groups), "--samples", str(args.samples)]
            cmd += ["--agent", args.agent] if args.agent else []
            cmd += ["--spec", args.spec] if args.spec else []
            cmd += ["--expert-guidance"] if args.expert_guidance else []
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            row = json.loads(out)
            line = f"{name:29s} peak RSS {row['peak_rss_mb']:6d} MB"
            if name != "load":
                positions, tokens = forward_positions(samples, replace(_config(args), **variant_fields(name)), model_config)
                line += f"  forward {positions} positions ({tokens} tokens)"
                grad = torch.load(grad_file).double()
                first = grad if first is None else first
                first_s = first_s or row["step_s"]
                cosine = float(torch.nn.functional.cosine_similarity(grad, first, dim=0))
                line += (f"  step {row['step_s']:6.1f} s (x{first_s / row['step_s']:.2f} the first's speed)"
                         f"  |grad| {float(grad.norm()):.4g}  cosine to first {cosine:.6f}")
            if "played_s" in row:
                line += f"  (played an iteration through the engine first: {row['played_s']:.0f} s)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
