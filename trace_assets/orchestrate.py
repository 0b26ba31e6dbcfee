"""The demo's orchestrator: materialize what is missing or stale, in waves, until all is fresh.

``trace demo`` (``cli.py``) calls :func:`run_stale` inside :func:`demo_lock` on the persistent
Dagster instance. A wave is planned from the stale status of every (asset, partition) item
(:func:`stale_items`, :func:`plan_wave`); items downstream of a failure (:func:`blocked_items`) and
the partitions of capabilities that left C* (:func:`departed_items`) are left alone. Nothing here
prints: progress goes to a ``log(kind, message)`` callable, ``kind`` one of ``"run"`` (a run
starts), ``"failed"`` (a run failed) and ``"recovered"`` (a killed demo's run was cleaned up).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from trace_assets import paths

DEMO_PID_TAG = "trace/demo_pid"
PEAK_RSS_TAG = "trace/peak_rss_mb"
"""Run tag: JSON ``{step_key: MB}``, the peak resident memory of the demo process tree during each step."""


def _dagster_private() -> SimpleNamespace:
    """Every private Dagster API the orchestrator uses, in one place. Written against dagster 1.13.27.

    Dagster has no public API for the stale status the UI shows (``CachingStaleStatusResolver``,
    ``StaleStatus``); the resolver wants a loading context, and ``LoadingContextForTest`` is the
    plain one that needs no request scope. On a Dagster upgrade, check this function first.
    """
    from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
    from dagster._core.events import RunFailureReason
    from dagster._core.loader import LoadingContextForTest
    from dagster._core.storage.tags import RUN_FAILURE_REASON_TAG

    def stale_status_resolver(instance, graph):
        """``status_of(asset_key, partition_key=None) -> StaleStatus`` over ``graph`` in ``instance``."""
        return CachingStaleStatusResolver(instance, asset_graph=graph, loading_context=LoadingContextForTest(instance)).get_status

    def reconstructable_job(job_name: str):
        """The job ``job_name`` of ``trace_assets.definitions.defs``, as a process of its own rebuilds
        it (what ``dagster.execute_job`` and the multiprocess executor need)."""
        from dagster._core.definitions.reconstruct import ReconstructableRepository

        repository = ReconstructableRepository.for_module("trace_assets.definitions", "defs", working_directory=os.getcwd())
        return repository.get_reconstructable_job(job_name)

    def interrupted(instance, run_id: str) -> bool:
        """Whether run ``run_id`` ended because this process was interrupted (SIGINT, SIGTERM).

        ``execute_job`` and ``execute_in_process`` capture the signal (``capture_interrupts``), stop
        the run's steps, record the run failed with reason ``UNEXPECTED_TERMINATION`` and return
        normally, so the caller never sees a ``KeyboardInterrupt``; the run's tag is what is left."""
        run = instance.get_run_by_id(run_id)
        return run is not None and run.tags.get(RUN_FAILURE_REASON_TAG) == RunFailureReason.UNEXPECTED_TERMINATION.value

    return SimpleNamespace(StaleStatus=StaleStatus, stale_status_resolver=stale_status_resolver,
                           reconstructable_job=reconstructable_job, interrupted=interrupted)


def _print_log(kind: str, message: str) -> None:
    print(f"[{kind}] {message}", flush=True)


def tree_rss_bytes(pid: int | None = None) -> int | None:
    """Resident memory of process ``pid`` (default: this one) plus all its descendants (e.g. a vLLM
    engine process), from ``/proc``; None where there is no ``/proc`` (macOS)."""
    root = pid or os.getpid()
    proc = Path("/proc")
    if not (proc / str(root) / "statm").exists():
        return None
    children: dict[int, list[int]] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    page, total, todo = os.sysconf("SC_PAGE_SIZE"), 0, [root]
    while todo:
        current = todo.pop()
        try:
            total += int((proc / str(current) / "statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
        todo.extend(children.get(current, []))
    return total


class RssSampler:
    """Samples :func:`tree_rss_bytes` every ``interval_s`` in a daemon thread while in ``with``.

    Sampled, not exact: a spike shorter than ``interval_s`` can be missed (training and engine
    memory stay up for seconds, so the peaks that matter are caught).
    """

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = tree_rss_bytes()
            if rss is None:
                return
            self.samples.append((time.time(), rss))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def peak_mb(self, start: float, end: float) -> int | None:
        """The largest sample in ``[start, end]`` (UNIX seconds) in MB. A step shorter than the
        interval (a reused result) gets the nearest sample, one interval either side at most; None
        when there is none."""
        inside = [rss for t, rss in self.samples if start <= t <= end]
        if not inside:
            near = [(min(abs(t - start), abs(t - end)), rss) for t, rss in self.samples
                    if start - self.interval_s <= t <= end + self.interval_s]
            inside = [min(near)[1]] if near else []
        return round(max(inside) / 2**20) if inside else None


def step_peaks_mb(instance, run_id: str, sampler: RssSampler) -> dict[str, int]:
    """``{step_key: peak MB}`` of one finished run, from its step start/end events and the samples."""
    from dagster import DagsterEventType

    ends = {DagsterEventType.STEP_SUCCESS, DagsterEventType.STEP_FAILURE}
    starts: dict[str, float] = {}
    peaks: dict[str, int] = {}
    for entry in instance.all_logs(run_id, of_type={DagsterEventType.STEP_START, *ends}):
        if entry.dagster_event.event_type in ends and entry.step_key in starts:
            peak = sampler.peak_mb(starts[entry.step_key], entry.timestamp)
            if peak is not None:
                peaks[entry.step_key] = peak
        else:
            starts[entry.step_key] = entry.timestamp
    return peaks


def job_asset_keys(defs, target) -> set:
    """The asset keys ``target`` names: a job's name (what it materializes) or an ``AssetSelection``
    (for assets of several partitionings, which no single Dagster asset job may hold)."""
    if isinstance(target, str):
        return set(defs.resolve_job_def(target).asset_layer.selected_asset_keys)
    return set(target.resolve(defs.resolve_asset_graph()))


def stale_items(defs, instance, job_name=None) -> dict[tuple, object]:
    """``{(asset_key, partition_key | None): StaleStatus}`` for every materializable asset
    (every registered partition of a partitioned one); only those of ``job_name`` (a job's name or
    an ``AssetSelection``, :func:`job_asset_keys`) when given: ``trace_main`` leaves the
    experiment's assets alone, the experiment the demo's Step 4."""
    graph = defs.resolve_asset_graph()
    status_of = _dagster_private().stale_status_resolver(instance, graph)
    keys = graph.materializable_asset_keys if job_name is None else graph.materializable_asset_keys & job_asset_keys(defs, job_name)
    out = {}
    for key in keys:
        partitions_def = graph.get(key).partitions_def
        if partitions_def is None:
            out[(key, None)] = status_of(key)
        else:
            for pk in partitions_def.get_partition_keys(dynamic_partitions_store=instance):
                out[(key, pk)] = status_of(key, pk)
    return out


def plan_wave(defs, statuses: dict) -> list[tuple[str | None, list]]:
    """The next runs: ``[(partition_key, asset_keys)]``. Unpartitioned work comes first, unless it
    waits on stale partitions; missing assets run together with their missing descendants;
    otherwise only the roots of staleness run, because a re-materialization that reproduces the
    same data version leaves everything below it fresh. A partitioned asset whose ancestors are
    partitioned another way (the experiment's seeds read every capability's partitions) waits until
    those ancestors are fresh, as an unpartitioned one does."""
    StaleStatus = _dagster_private().StaleStatus

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

    def waits_across(k) -> bool:
        own = graph.get(k).partitions_def
        return any(a in stale_keys and graph.get(a).partitions_def is not None and graph.get(a).partitions_def != own
                   for a in graph.get_ancestor_asset_keys(k) - {k})

    unpartitioned = {(k, pk): s for (k, pk), s in stale.items() if pk is None and not waits(k)}
    if unpartitioned:
        return [(None, pick(unpartitioned))]
    runs = []
    for pk in sorted({pk for k, pk in stale if pk is not None and not waits_across(k)}):
        runs.append((pk, pick({(k, p): s for (k, p), s in stale.items() if p == pk and not waits_across(k)})))
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

    def capability_of(k, pk) -> str | None:
        partitions_def = graph.get(k).partitions_def
        if getattr(partitions_def, "name", None) == "capability":
            return pk
        by_dimension = getattr(pk, "keys_by_dimension", None)  # a (capability, seed) key of the experiment
        return by_dimension.get("capability") if by_dimension else None

    return {(k, pk) for (k, pk) in items
            if pk is not None and graph.get(k).partitions_def is not None
            and capability_of(k, pk) is not None and capability_of(k, pk) not in c_star
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


ONE_STEP_AT_A_TIME = {"execution": {"config": {"multiprocess": {"max_concurrent": 1}}},
                      "loggers": {"console": {"config": {"log_level": "INFO"}}}}
"""Run config of an isolated run: each step in a process of its own, one after another (pool
``train`` already keeps trainings apart; two model-loading steps at once would only fight for RAM).
The console shows the steps' INFO lines (their progress), not Dagster's DEBUG events, which the
event log still holds in full."""


def _check_rebuilt_the_same(defs) -> None:
    """An isolated step runs in a process that rebuilds ``trace_assets.definitions.defs`` from the
    environment's settings; ``defs`` built from other settings (a test's) would run other code
    there. Compare the code versions (settings hashes) and refuse rather than run the wrong thing."""
    from trace_assets.definitions import build_definitions

    def versions(d) -> dict:
        graph = d.resolve_asset_graph()
        return {k: graph.get(k).code_version for k in graph.get_all_asset_keys()}

    if versions(defs) != versions(build_definitions()):
        raise ValueError("isolate_steps=True needs the definitions that trace_assets.definitions builds from this "
                         "environment's settings (TRACE_CONFIG, TRACE_PROFILE); these were built from others")


def _execute(job, defs, instance, keys, partition_key, isolate: bool):
    """One run of ``keys`` (for ``partition_key``): in this process, or each step in a process of its
    own through Dagster's multiprocess executor. Returns ``(run_id, success)``."""
    tags = {DEMO_PID_TAG: str(os.getpid())}
    if not isolate:
        result = job.execute_in_process(instance=instance, asset_selection=keys, partition_key=partition_key,
                                        raise_on_error=False, tags=tags)
        return result.run_id, result.success
    from dagster import execute_job

    if partition_key is not None:
        tags.update(job.get_tags_for_partition_key(partition_key, selected_asset_keys=keys))
    with execute_job(_dagster_private().reconstructable_job(job.name), instance, run_config=ONE_STEP_AT_A_TIME,
                     tags=tags, asset_selection=list(keys), raise_on_error=False) as result:
        return result.run_id, result.success


def run_stale(defs, instance, job_name: str, *, max_waves: int = 50, isolate_steps: bool = False,
              log: Callable[[str, str], None] = _print_log) -> tuple[list[str], list[str]]:
    """Materialize the missing/stale assets of ``job_name`` (a job's name, whose job runs them, or an
    ``AssetSelection``, run through Dagster's implicit asset job, which allows several partitionings)
    in waves until they are all fresh.

    Returns the run ids and a description of every failed run. ``log(kind, message)`` hears of
    each run before it starts and of each failure (``cli`` presents them).

    A run that fails (or whose blocking check fails) is reported and not retried in this
    invocation; its partition's siblings and unrelated assets go on. A run that Ctrl-C or SIGTERM
    ended stops the whole invocation (``KeyboardInterrupt``): Dagster reports it as an ordinary
    failed run, and going on with the next wave would ignore the user.

    ``isolate_steps``: run every step in a process of its own (``make demo``, ``make experiment``).
    A long-lived process keeps what each step's torch, tokenizers and vLLM engine left in its heap,
    so one process running the whole loop grows from step to step; a step's process returns it all
    when it exits. It costs each step a fresh import (seconds) and needs ``defs`` to be what
    ``trace_assets.definitions`` builds from the environment (checked).
    """
    if isolate_steps:
        _check_rebuilt_the_same(defs)
    job = defs.resolve_job_def(job_name) if isinstance(job_name, str) else defs.resolve_implicit_global_asset_job_def()
    graph = defs.resolve_asset_graph()
    run_ids: list[str] = []
    failures: list[str] = []
    failed: set[tuple] = set()
    with RssSampler() as sampler:  # peak memory per step, for the closing table
        for _ in range(max_waves):
            statuses = stale_items(defs, instance, job_name)
            blocked = blocked_items(graph, statuses, failed) | departed_items(graph, instance, statuses)
            runs = plan_wave(defs, {item: s for item, s in statuses.items() if item not in blocked})
            runs = [(pk, keys) for pk, keys in runs if keys]
            if not runs:
                break
            for partition_key, keys in runs:
                where = f" [{partition_key}]" if partition_key else ""
                log("run", f"materializing {', '.join(k.to_user_string() for k in keys)}{where}")
                run_id, success = _execute(job, defs, instance, keys, partition_key, isolate_steps)
                run_ids.append(run_id)
                peaks = step_peaks_mb(instance, run_id, sampler)
                if peaks:  # the closing table reads it; the UI shows it with the run's tags
                    instance.add_run_tags(run_id, {PEAK_RSS_TAG: json.dumps(peaks, sort_keys=True)})
                if not success:
                    if _dagster_private().interrupted(instance, run_id):
                        log("failed", f"run {run_id} was interrupted: stopping here; run the same command again "
                            "to resume where it stopped")
                        raise KeyboardInterrupt
                    failed.update((k, partition_key) for k in keys)
                    failures.append(f"run {run_id}: {[k.to_user_string() for k in keys]}{where}")
                    log("failed", f"run {run_id} failed for {[k.to_user_string() for k in keys]}{where}; "
                        f"see `make ui` for the logs. Continuing with the rest.")
    return run_ids, failures


@contextlib.contextmanager
def demo_lock(instance, log: Callable[[str, str], None] = _print_log):
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
    reap_dead_runs(instance, lambda message: log("recovered", message))
    lock.write_text(str(os.getpid()))
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
    return True


