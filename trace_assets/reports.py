"""Reports read back from the Dagster instance, and the README sections generated from them.

``trace demo`` ends by writing ``reports/demo.md`` under the data folder: the machine and commit it
ran on, each asset's wall time and peak RSS, the base agent, C*, each adapter's held-out synthetic
success before and after training with its promotion, and ``router_eval``'s result tables.
``trace readme`` then replaces the README's generated sections (between ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->``) with the report's, so no figure in the README is typed by hand.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trace_assets import paths

DEMO_REPORT = "demo.md"
DEMO_SECTION = "demo"
SUMMARY_KEYS = ("n_train", "n_test", "demos", "train_time_s", "episodes", "n_d_plus", "n_d_minus", "generated_tokens",
                "generation_backend", "iterations", "rollouts", "success_before", "success_after", "promoted")
"""Metadata entries that the closing table shows as an asset's key figures."""

# router_eval's report sections that the README carries (the rest stays in reports/latest_report.md)
README_REPORT_SECTIONS = ("## TRACE results", "### TRACE routed against each system",
                          "### Each adapter against its null control", "### Rollouts spent")


@dataclass(frozen=True)
class StepRow:
    """One materialized asset (one row per partition) as the closing table shows it.

    ``wall_s`` is the Dagster step's duration when it ran in this demo, None when it was fresh
    (not recomputed); ``peak_rss_gb`` is the step's peak RSS over the demo's process tree."""

    asset: str
    wall_s: float | None
    peak_rss_gb: float | None
    figures: str


def step_rows(defs: Any, instance: Any, run_ids: Sequence[str]) -> list[StepRow]:
    """The closing table's rows, in the asset graph's topological order, each partition apart."""
    from trace_assets.orchestrate import PEAK_RSS_TAG

    durations = step_durations(instance, run_ids)
    rows = []
    for key in defs.resolve_asset_graph().toposorted_asset_keys:
        for partition, entry in _latest_entries(instance, key).items():
            metadata = entry.asset_materialization.metadata
            figures = ", ".join(f"{k}={v.value}" for k, v in metadata.items() if k in SUMMARY_KEYS)
            step = key.to_python_identifier()
            wall = durations.get((entry.run_id, step)) if entry.run_id in run_ids else None
            run = instance.get_run_by_id(entry.run_id)
            peak = json.loads(run.tags.get(PEAK_RSS_TAG, "{}")).get(step) if run else None
            name = key.to_user_string() + (f"[{partition}]" if partition else "")
            rows.append(StepRow(name, wall, None if peak is None else peak / 1024, figures))
    return rows


def step_durations(instance: Any, run_ids: Sequence[str]) -> dict[tuple[str, str], float]:
    """``{(run id, step key): seconds}``: the Dagster step durations of the given runs."""
    from dagster import DagsterEventType

    durations: dict[tuple[str, str], float] = {}
    for run_id in dict.fromkeys(run_ids):
        for entry in instance.all_logs(run_id, of_type=DagsterEventType.STEP_SUCCESS):
            if entry.step_key:
                durations[(run_id, entry.step_key)] = entry.dagster_event.event_specific_data.duration_ms / 1000
    return durations


def phase_rows(instance: Any, keys: Sequence[Any]) -> list[dict[str, Any]]:
    """What each asset of ``keys`` (in that order; those never materialized are left out) cost.

    Over every partition's latest materialization: its Dagster step's duration, summed
    (``wall_s``), fastest and slowest. ``timed`` counts the partitions whose step duration the event
    log holds (a materialization reported outside a step has none). A latest materialization may
    have reused work that an earlier one did (stored test episodes, a finished training), so it can
    take minutes where the work took hours: ``materializations`` and ``all_s`` count and sum the
    step durations of EVERY materialization of the asset's partitions, earlier ones included (which
    in turn overcounts work redone after a code change). The report shows both."""
    history = {key: entries for key in keys if (entries := _partition_entries(instance, key))}
    # one event-log read per run: a run often materializes several of the assets (a seed's env and adapter)
    durations = step_durations(instance, [e.run_id for entries in history.values() for es in entries.values() for e in es])
    rows = []
    for key, entries in history.items():
        step = key.to_python_identifier()
        walls = [durations[(es[0].run_id, step)] for es in entries.values() if (es[0].run_id, step) in durations]
        every = [durations[(e.run_id, step)] for es in entries.values() for e in es if (e.run_id, step) in durations]
        rows.append({"asset": key.to_user_string(), "partitions": len(entries), "timed": len(walls), "wall_s": sum(walls),
                     "min_s": min(walls, default=None), "max_s": max(walls, default=None),
                     "materializations": len(every), "all_s": sum(every)})
    return rows


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU model, cores, native bf16, memory, commit."""
    cpu, flags = platform.processor() or platform.machine(), ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = re.search(r"model name\s*:\s*(.+)", info).group(1).strip()  # type: ignore[union-attr]
        flags = re.search(r"flags\s*:\s*(.+)", info).group(1)  # type: ignore[union-attr]
    except (OSError, AttributeError):
        pass
    try:
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        memory_gb = float("nan")
    try:
        commit = subprocess.run(["git", "-C", str(paths.REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or "unknown"
        dirty = bool(subprocess.run(["git", "-C", str(paths.REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "unknown", False
    return {"cpu": cpu, "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags.split(),
            "memory_gb": round(memory_gb, 1), "commit": commit + ("+local changes" if dirty else "")}


def wall_text(seconds: float | None) -> str:
    if seconds is None:
        return "fresh"
    return f"{seconds:.0f} s" if seconds < 90 else f"{int(seconds // 60)} min {seconds % 60:02.0f} s"


def _partition_entries(instance: Any, key: Any) -> dict[str | None, list[Any]]:
    """The event log entries of each partition's materializations of ``key``, newest first (the
    key None when unpartitioned), in partition order."""
    from dagster import AssetRecordsFilter

    entries: dict[str | None, list[Any]] = {}
    for record in instance.fetch_materializations(AssetRecordsFilter(asset_key=key), limit=1000).records:
        entries.setdefault(record.partition_key, []).append(record.event_log_entry)  # newest first
    return {p: entries[p] for p in sorted(entries, key=lambda p: p or "")}


def _latest_entries(instance: Any, key: Any) -> dict[str | None, Any]:
    """The event log entry of each partition's latest materialization of ``key`` (the key None
    when unpartitioned), in partition order."""
    return {p: entries[0] for p, entries in _partition_entries(instance, key).items()}


def _latest(instance: Any, name: str) -> list[Any]:
    """Every partition's latest materialization of asset ``name`` (one element when unpartitioned)."""
    from dagster import AssetKey

    return [entry.asset_materialization for entry in _latest_entries(instance, AssetKey(name)).values()]


def _md(materialization: Any, entry: str) -> str | None:
    value = materialization.metadata.get(entry)
    return None if value is None else str(value.value)


def report_sections(markdown: str, wanted: Sequence[str]) -> str:
    """The sections of a report (split at headings) whose heading starts with one of ``wanted``."""
    parts = re.split(r"\n(?=#{2,3} )", "\n" + markdown.strip())
    return "\n\n".join(p.strip() for p in parts if any(p.strip().startswith(w) for w in wanted))


def demo_markdown(defs: Any, instance: Any, run_ids: Sequence[str], wall_s: float, *,
                  now: _dt.datetime | None = None, host: Mapping[str, Any] | None = None) -> str:
    """``reports/demo.md``: what one ``trace demo`` ran, measured and concluded. ``host`` defaults
    to :func:`machine` now (pass the one taken when the run started if the checkout moved since)."""
    host = host or machine()
    rows = step_rows(defs, instance, run_ids)
    when = (now or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y-%m-%d %H:%M UTC")
    recomputed = sum(r.wall_s is not None for r in rows)
    lines = [
        "# TRACE demo report",
        f"Generated by `trace demo` on {when}, commit `{host['commit']}`, data folder `{paths.data_dir()}`. "
        f"Machine: {host['cpu']}, {host['cores']} cores, {host['memory_gb']} GB RAM, native bf16 (AVX-512 BF16): "
        f"{'yes' if host['avx512_bf16'] else 'no'}. This run recomputed {recomputed} of {len(rows)} materializations "
        f"in {len(run_ids)} Dagster runs; wall time {wall_text(wall_s)}.",
        "### Wall time and peak RSS per asset",
        "Dagster step durations; peak RSS is sampled over the demo's process tree (vLLM engines included); "
        "`fresh`: not recomputed by this run.",
        "\n".join([
            "| asset | wall time | peak RSS (GB) | key figures |", "|---|---|---|---|",
            *(f"| {r.asset} | {wall_text(r.wall_s)} | {'' if r.peak_rss_gb is None else f'{r.peak_rss_gb:.1f}'} | {r.figures} |"
              for r in rows),
            f"| **full loop** | **{wall_text(wall_s)}** | **{max((r.peak_rss_gb or 0 for r in rows), default=0):.1f}** | |",
        ]),
    ]
    for name, entry, title in (("base_trajectories", "success_by_family", "### Base agent: success by family"),
                               ("selected_capabilities", "selection", "### Step 1: capabilities, Δ, Cov and C*")):
        for mat in _latest(instance, name):
            if (text := _md(mat, entry)) is not None:
                lines += [title, text]
    adapters = _latest(instance, "lora_adapter")
    if adapters:
        table = ["| capability | iterations | rollouts | success before → after | reward before → after | null success "
                 "| promoted | why | fidelity |", "|---|---|---|---|---|---|---|---|---|"]
        for mat in adapters:
            m = {k: v.value for k, v in mat.metadata.items()}
            table.append(f"| {mat.partition} | {m.get('iterations')} | {m.get('rollouts')} | "
                         f"{_num(m.get('success_before'))} → {_num(m.get('success_after'))} | "
                         f"{_num(m.get('reward_before'))} → {_num(m.get('reward_after'))} | {_num(m.get('success_null'))} | "
                         f"{'yes' if m.get('promoted') else 'no'} | {m.get('promotion_reason', '')} | {m.get('fidelity', '')} |")
        lines += ["### Adapters on held-out synthetic seeds of their own environment (greedy), before and after GRPO",
                  "\n".join(table)]
    for mat in _latest(instance, "router_eval"):
        if (text := _md(mat, "report")) is not None:
            lines.append(text)
    return "\n\n".join(lines) + "\n"


def _num(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def write_report(name: str, markdown: str) -> Path:
    """Write ``reports/<name>`` under the data folder atomically (``paths.atomic_write``)."""
    return paths.atomic_write(paths.sub("reports") / name, markdown)


ADMISSION_REPORT = "episode_admission.json"
ADMISSION_SECTION = "admission"
_ADMISSION_KEY = ("agent", "dtype", "kv_tokens", "episodes", "variant")


def record_admission(entry: Mapping[str, Any]) -> Path:
    """Add one variant's figures from ``benchmarks/episode_admission.py`` to
    ``reports/episode_admission.json``, with the machine it ran on, replacing the entry with the
    same agent, dtype, cache size, episode count and variant (the others are kept)."""
    path = paths.sub("reports") / ADMISSION_REPORT
    entries = json.loads(path.read_text())["entries"] if path.exists() else []
    key = tuple(entry[k] for k in _ADMISSION_KEY)
    entries = [e for e in entries if tuple(e[k] for k in _ADMISSION_KEY) != key]
    entries.append({**entry, "machine": machine(), "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat()})
    return paths.atomic_write(path, json.dumps({"entries": entries}, indent=1))


def admission_section(report: Mapping[str, Any]) -> str:
    """The README's "Episodes in flight" table from ``reports/episode_admission.json``: a row per
    episode count, a column per variant, one table per machine, dtype and cache size."""
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for e in report["entries"]:
        m = e["machine"]
        cpu = f"{m['cores']}-core {m['cpu']} ({'native' if m['avx512_bf16'] else 'no native'} bf16)"
        groups.setdefault((cpu, e["dtype"], e["kv_gb"], e["kv_tokens"]), []).append(e)
    parts = []
    for (cpu, dtype, kv_gb, kv_tokens), entries in groups.items():
        variants = [v for v in ("unbounded", "admitted") if any(e["variant"] == v for e in entries)]
        title = {"unbounded": "all at once", "admitted": "admitted"}
        lines = [f"vLLM {dtype}, {kv_gb:g} GiB KV cache = {kv_tokens:,} tokens, {cpu}:", "",
                 "| episodes | " + " | ".join(title[v] for v in variants) + " | same episodes |",
                 "|---" * (len(variants) + 2) + "|"]
        for n in sorted({e["episodes"] for e in entries}):
            row = {e["variant"]: e for e in entries if e["episodes"] == n}
            cells = [_admission_cell(row[v]) if v in row else "not measured" for v in variants]
            compared = len(row) > 1 and all(e["finished"] for e in row.values())
            same = ("token-identical" if len({e["episodes_hash"] for e in row.values()}) == 1 else "differ") if compared else "n/a"
            lines.append(f"| {n} | " + " | ".join(cells) + f" | {same} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _admission_cell(e: Mapping[str, Any]) -> str:
    hits = e["cached_tokens"] / max(e["prompt_tokens"], 1)
    if not e["finished"]:
        return (f"not finished after {e['wall_s'] / 60:.0f} min: {e['rounds']} rounds of at most "
                f"{e['peak_round_tokens']:,} tokens, {hits:.1%} prefix-cache hits so far")
    return (f"{e['wall_s']:,.0f} s, {e['rounds']} rounds of at most {e['most_in_a_round']} episodes and "
            f"{e['peak_round_tokens']:,} tokens, {hits:.1%} prefix-cache hits, {e['successes']}/{e['episodes']} success")


def readme_section(report: str) -> str:
    """The README's generated demo section from ``reports/demo.md``: its header, the per-asset
    table, the adapters, and router_eval's system, paired and null-control tables."""
    head, _, rest = report.partition("\n### ")
    rest = "### " + rest
    keep = report_sections(rest, ("### Wall time", "### Step 1", "### Adapters", *README_REPORT_SECTIONS))
    body = head.removeprefix("# TRACE demo report").strip()
    return f"{body}\n\n{keep}".replace("\n## TRACE results", "\n### TRACE results")


class ReadmeSectionError(ValueError):
    """The README lacks a generated section's markers, or has them out of order."""


def splice(text: str, name: str, body: str, *, source: str = "README.md") -> str:
    """``text`` with everything between ``<!-- name:begin -->`` and ``<!-- name:end -->`` replaced by
    ``body``. Raises :class:`ReadmeSectionError` naming the file and the missing marker."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < 0 or j < i:
        missing = begin if i < 0 else end
        raise ReadmeSectionError(f"{source}: the generated section {name!r} needs {begin} ... {end}; "
                                 f"{missing} is missing or out of order")
    return f"{text[: i + len(begin)]}\n{body.strip()}\n{text[j:]}"


def update_readme(readme: Path, sections: Mapping[str, str], *, write: bool = True) -> bool:
    """Splice each ``sections[name]`` into ``readme``; return whether its text differs (and, with
    ``write``, write the new text)."""
    text = readme.read_text()
    new = text
    for name, body in sections.items():
        new = splice(new, name, body, source=str(readme))
    if write and new != text:
        paths.atomic_write(readme, new)
    return new != text
