"""The landing-folder sensor: import new trajectory files once, then ask for a re-identification.

``new_trajectories_sensor`` watches the landing folder (``TRACE_LANDING_DIR``, else
``<data>/landing``) for ``*.jsonl`` / ``*.parquet`` files. Each new file goes through the same
importer as ``trace import`` (``trace_assets.trajectories.import_file``). A good file is moved to
``landing/imported/``; a file with any bad line is moved to the quarantine folder beside a
``.reason.json`` (its valid lines are stored, as ``trace import`` does). A file that makes the
importer raise (a locked database, a disk error) stays in place and is retried on the next tick;
after ``MAX_ATTEMPTS`` failures it is quarantined with the error as reason. The sensor never
raises because of a file. Its cursor (JSON) records every processed file by content hash, with
name, size and mtime, so the same content is never imported twice, even after a restart or when a
copy lands under another name. When new trajectories landed it requests one ``reidentify`` run
whose run key is derived from the content hashes.
Producers should write under a hidden or ``.tmp`` name and rename when done; files modified less
than ``settle_s`` seconds ago are left for the next tick.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from dagster import DefaultSensorStatus, RunRequest, SensorEvaluationContext, SensorResult, SkipReason, sensor

from resources.store import TraceStore
from trace_assets import paths
from trace_assets.settings import clip
from trace_assets.trajectories import SUPPORTED_SUFFIXES, RecordError, import_file, quarantine

SENSOR_NAME = "new_trajectories_sensor"
MAX_ATTEMPTS = 3
CURSOR_MAX_FILES = 5000  # the oldest entries are dropped beyond this; imports stay idempotent anyway


def landing_folder(override: str | os.PathLike | None = None) -> Path:
    """The watched folder: ``override``, else ``TRACE_LANDING_DIR``, else ``<data>/landing``."""
    chosen = override or os.environ.get("TRACE_LANDING_DIR")
    if chosen:
        folder = Path(chosen).expanduser().resolve()
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    return paths.landing_dir()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_cursor(raw: str | None) -> dict[str, Any]:
    """``{"files": {sha256: {name, size, mtime, status, n_inserted, at}}, "attempts": {sha256: n}}``."""
    try:
        cursor = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        cursor = {}
    cursor.setdefault("files", {})
    cursor.setdefault("attempts", {})
    return cursor


def dump_cursor(cursor: dict[str, Any]) -> str:
    files = cursor["files"]
    if len(files) > CURSOR_MAX_FILES:
        keep = sorted(files, key=lambda h: files[h].get("at", 0))[-CURSOR_MAX_FILES:]
        cursor["files"] = {h: files[h] for h in keep}
    return json.dumps(cursor, sort_keys=True)


def _candidates(folder: Path, settle_s: float) -> list[Path]:
    now = time.time()
    out = []
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.name.startswith(".") or path.suffix not in SUPPORTED_SUFFIXES:
            continue
        try:
            if now - path.stat().st_mtime < settle_s:
                continue  # possibly still being written
        except FileNotFoundError:
            continue
        out.append(path)
    return out


def _move_unique(path: Path, folder: Path, digest: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / path.name
    if target.exists():
        target = folder / f"{path.stem}.{digest[:12]}{path.suffix}"
    if target.exists():  # same name and same content already there: keep the first copy only
        path.unlink()
        return target
    shutil.move(str(path), target)
    return target


def process_landing(
    folder: Path, store: TraceStore, cursor: dict[str, Any], log: Any, *, settle_s: float = 0.0,
    quarantine_folder: Path | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Import every settled file in ``folder`` once. Returns (this tick's results, new cursor).

    Never raises because of a file: a bad file is quarantined, an importer error is retried later.
    """
    results = []
    imported_dir = folder / "imported"
    for path in _candidates(folder, settle_s):
        try:
            stat = path.stat()
            digest = file_sha256(path)
        except OSError as exc:
            log.warning(f"landing: cannot read {path.name}: {exc}; retrying on the next tick")
            continue
        entry = {"name": path.name, "size": stat.st_size, "mtime": stat.st_mtime, "at": time.time()}
        if digest in cursor["files"]:
            first = cursor["files"][digest]
            moved = _move_unique(path, imported_dir, digest)
            log.info(f"landing: {path.name} has the content of {first['name']} (already processed); "
                     f"not imported again, moved to {moved}")
            results.append({**entry, "sha256": digest, "status": "duplicate", "n_inserted": 0})
            continue
        try:
            report = import_file(path, store, move_bad=True, quarantine_folder=quarantine_folder)
        except Exception as exc:  # noqa: BLE001 - the sensor must keep running
            attempts = cursor["attempts"].get(digest, 0) + 1
            cursor["attempts"][digest] = attempts
            log.error(f"landing: importing {path.name} failed (attempt {attempts}/{MAX_ATTEMPTS}): {clip(repr(exc))}")
            if attempts >= MAX_ATTEMPTS:
                try:
                    target = quarantine(path, [RecordError(str(path), 0, "<file>", f"importer error: {exc!r}")],
                                        move=True, folder=quarantine_folder)
                except OSError as q_exc:
                    log.error(f"landing: could not quarantine {path.name}: {q_exc!r}")
                    continue
                cursor["attempts"].pop(digest, None)
                cursor["files"][digest] = {**entry, "status": "quarantined", "n_inserted": 0, "to": str(target)}
                results.append({**entry, "sha256": digest, "status": "quarantined", "n_inserted": 0})
            continue
        cursor["attempts"].pop(digest, None)
        if report.ok:
            try:
                target = str(_move_unique(path, imported_dir, digest))
            except OSError as exc:  # it is recorded in the cursor, so it will not be imported again
                log.warning(f"landing: imported {path.name} but could not move it: {exc!r}")
                target = str(path)
            status = "imported"
        else:
            target, status = report.quarantined_to, "quarantined"
            log.warning(f"landing: {report.summary()}; first errors: {[str(e) for e in report.errors[:5]]}")
        if report.ok:
            log.info(f"landing: {report.summary()} -> {target}")
        cursor["files"][digest] = {**entry, "status": status, "n_inserted": report.n_inserted, "to": target}
        results.append({**entry, "sha256": digest, "status": status, "n_inserted": report.n_inserted,
                        "n_valid": report.n_valid, "n_errors": len(report.errors)})
    return results, cursor


def reidentify_run_key(digests: list[str]) -> str:
    if len(digests) == 1:
        return f"landed-{digests[0]}"
    return "landed-" + hashlib.sha256("\n".join(sorted(digests)).encode()).hexdigest()


def build_new_trajectories_sensor(
    job, *, landing_dir: str | None = None, settle_s: float = 1.0, minimum_interval_seconds: int = 30,
    default_status: DefaultSensorStatus = DefaultSensorStatus.RUNNING,
):
    """The landing-folder sensor. ``landing_dir`` overrides ``TRACE_LANDING_DIR``."""

    @sensor(
        name=SENSOR_NAME, job=job, minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description="Imports new *.jsonl / *.parquet trajectory files from the landing folder and "
                    "requests a re-identification run when new trajectories landed.",
    )
    def new_trajectories_sensor(context: SensorEvaluationContext, store: TraceStore):
        folder = landing_folder(landing_dir)
        cursor = load_cursor(context.cursor)
        start = time.perf_counter()
        results, cursor = process_landing(folder, store, cursor, context.log, settle_s=settle_s)
        new_cursor = dump_cursor(cursor)
        if not results:
            return SensorResult(skip_reason=SkipReason(f"no new files in {folder}"), cursor=new_cursor)
        landed = [r for r in results if r["n_inserted"] > 0]
        context.log.info(f"landing: {len(results)} file(s) processed in {time.perf_counter() - start:.2f} s; "
                         f"{sum(r['n_inserted'] for r in landed)} new trajectories")
        if not landed:
            return SensorResult(
                skip_reason=SkipReason(f"{len(results)} file(s) processed, no new trajectories"), cursor=new_cursor,
            )
        request = RunRequest(
            run_key=reidentify_run_key([r["sha256"] for r in landed]),
            tags={
                "trace/trigger": "landing",
                "trace/files": ",".join(r["name"] for r in landed)[:200],
                "trace/new_trajectories": str(sum(r["n_inserted"] for r in landed)),
            },
        )
        return SensorResult(run_requests=[request], cursor=new_cursor)

    return new_trajectories_sensor
