"""Trajectory records: validation against the documented JSON Schema, and the file importer.

The schema is ``trace_assets/schemas/trajectory.schema.json`` (v1). The importer contract:

* every line (JSONL) or row (Parquet) is validated on its own; an error names ``file:line`` and the
  offending field;
* valid lines are stored, invalid ones are not, and nothing already stored is touched;
* a file with any error is quarantined (copied, or moved for the landing folder) next to a
  ``.reason.json`` that lists every error;
* re-importing a file adds nothing twice (ids are explicit or derived from the content).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pyarrow.parquet as pq

from trace_assets import paths

SUPPORTED_SUFFIXES = (".jsonl", ".parquet")


@cache
def trajectory_schema() -> dict[str, Any]:
    return json.loads(resources.files("trace_assets.schemas").joinpath("trajectory.schema.json").read_text())


@cache
def _validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(
        trajectory_schema(), format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )


@dataclass(frozen=True)
class RecordError:
    """One bad line: where it is and what is wrong with which field."""

    file: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: field '{self.field}': {self.message}"


@dataclass
class ImportReport:
    file: str
    n_lines: int = 0
    n_valid: int = 0
    n_inserted: int = 0
    errors: list[RecordError] = field(default_factory=list)
    quarantined_to: str | None = None

    @property
    def ok(self) -> bool:
        return not self.errors

    def summary(self) -> str:
        text = (
            f"{self.file}: {self.n_lines} lines, {self.n_valid} valid, {self.n_inserted} new, "
            f"{len(self.errors)} errors"
        )
        if self.quarantined_to:
            text += f"; quarantined to {self.quarantined_to}"
        return text


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


def trajectory_id(task_id: str, env: str, policy: str, messages: list[dict[str, Any]], salt: str = "") -> str:
    """The content-derived id: stable across re-imports of the same conversation."""
    blob = json.dumps([task_id, env, policy, messages, salt], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def normalize(raw: dict[str, Any], *, file: str, line: int, source: str, now: str) -> dict[str, Any]:
    """Validate one raw record and fill defaults. Raises ``RecordErrors`` naming file:line:field."""
    record = dict(raw)
    # Parquet and some loggers store nested fields as JSON strings.
    for key in ("messages", "info"):
        if isinstance(record.get(key), str):
            try:
                record[key] = json.loads(record[key])
            except json.JSONDecodeError as exc:
                raise RecordErrors([RecordError(file, line, key, f"not valid JSON: {exc.msg}")]) from None
    if record.get("info") is None:
        record.pop("info", None)
    for key in [k for k, v in record.items() if v is None and k not in ("messages",)]:
        record.pop(key)  # Parquet fills absent optional columns with nulls
    errors = [
        RecordError(file, line, ".".join(str(p) for p in err.absolute_path) or _missing_field(err), err.message)
        for err in sorted(_validator().iter_errors(record), key=lambda e: list(map(str, e.absolute_path)))
    ]
    if errors:
        raise RecordErrors(errors)
    record.setdefault("split", "train")
    record.setdefault("policy", "base")
    record.setdefault("info", {})
    record.setdefault("source", source)
    record.setdefault("created_at", now)
    record.setdefault("success", record["reward"] >= 1.0)
    record["messages"] = [_normalize_message(m) for m in record["messages"]]
    record.setdefault(
        "trajectory_id",
        trajectory_id(record["task_id"], record["env"], record["policy"], record["messages"]),
    )
    return record


def _missing_field(err: jsonschema.ValidationError) -> str:
    if err.validator == "required":
        return err.message.split("'")[1] if "'" in err.message else "<root>"
    if err.validator == "additionalProperties":
        return err.message.split("'")[1] if "'" in err.message else "<root>"
    return "<root>"


def _normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    """Tool-call arguments become dicts (the HF convention this project uses everywhere)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        fn = dict(call["function"])
        if isinstance(fn["arguments"], str):
            try:
                fn["arguments"] = json.loads(fn["arguments"] or "{}")
            except json.JSONDecodeError:
                pass  # keep the raw string: it is what the agent produced
        calls.append({**call, "function": fn})
    return {**message, "tool_calls": calls}


class RecordErrors(ValueError):
    def __init__(self, errors: list[RecordError]):
        super().__init__("; ".join(map(str, errors)))
        self.errors = errors


def read_raw(path: Path) -> Iterator[tuple[int, dict[str, Any] | RecordError]]:
    """Yield ``(line_number, record_or_error)`` for a JSONL or Parquet file (1-based lines/rows)."""
    name = str(path)
    if path.suffix == ".jsonl":
        with path.open("r", encoding="utf-8", errors="strict") as fh:
            try:
                for line_no, line in enumerate(fh, start=1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as exc:
                        yield line_no, RecordError(name, line_no, "<line>", f"not valid JSON: {exc.msg} at column {exc.colno}")
                        continue
                    if not isinstance(obj, dict):
                        yield line_no, RecordError(name, line_no, "<line>", "a trajectory must be a JSON object")
                        continue
                    yield line_no, obj
            except UnicodeDecodeError as exc:
                yield 0, RecordError(name, 0, "<file>", f"not UTF-8 text: {exc.reason}")
    elif path.suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises many types for corrupt files
            yield 0, RecordError(name, 0, "<file>", f"unreadable Parquet: {exc}")
            return
        for row_no, row in enumerate(table.to_pylist(), start=1):
            yield row_no, row
    else:
        yield 0, RecordError(name, 0, "<file>", f"unsupported file type {path.suffix!r}; use {SUPPORTED_SUFFIXES}")


def validate_file(path: Path) -> tuple[list[dict[str, Any]], list[RecordError], int]:
    """All valid normalised records of a file, the errors, and the number of lines read."""
    records: list[dict[str, Any]] = []
    errors: list[RecordError] = []
    n_lines = 0
    now = now_iso()
    for line_no, item in read_raw(path):
        if isinstance(item, RecordError):
            errors.append(item)
            n_lines += line_no > 0
            continue
        n_lines += 1
        try:
            records.append(normalize(item, file=str(path), line=line_no, source=path.name, now=now))
        except RecordErrors as exc:
            errors.extend(exc.errors)
    return records, errors, n_lines


def quarantine(path: Path, errors: list[RecordError], *, move: bool, folder: Path | None = None) -> Path:
    """Copy (or move) ``path`` into the quarantine folder beside a ``.reason.json``; never delete."""
    folder = folder or paths.quarantine_dir()
    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    target = folder / f"{stamp}_{path.name}"
    reason = {
        "file": str(path),
        "quarantined_at": now_iso(),
        "errors": [str(e) for e in errors],
    }
    (folder / f"{target.name}.reason.json").write_text(json.dumps(reason, indent=2))
    if move:
        shutil.move(str(path), target)
    else:
        shutil.copy2(path, target)
    return target


def batch_name(path: Path) -> str:
    """A path-safe, content-addressed name for the Parquet copy of a file's new rows."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in path.stem)[:48]
    return f"import_{stem}_{digest}"


def import_file(path: str | Path, store: Any, *, move_bad: bool = False, quarantine_folder: Path | None = None) -> ImportReport:
    """Validate ``path`` and store its valid records in ``store`` (a ``TraceStore``)."""
    path = Path(path)
    report = ImportReport(file=str(path))
    if not path.is_file():
        report.errors.append(RecordError(str(path), 0, "<file>", "no such file"))
        return report
    records, errors, report.n_lines = validate_file(path)
    report.n_valid = len(records)
    report.errors = errors
    if records:
        report.n_inserted = store.insert_trajectories(records, batch_name=batch_name(path))
    if errors:
        report.quarantined_to = str(quarantine(path, errors, move=move_bad, folder=quarantine_folder))
    return report


def render_markdown(messages: list[dict[str, Any]], *, max_chars: int = 4000) -> str:
    """A readable transcript for asset metadata: one line per message, tool calls inlined."""
    lines = []
    for message in messages:
        role = message["role"]
        if role == "system":
            lines.append(f"**system**: _{len(message.get('content') or '')} characters of policy_")
            continue
        text = (message.get("content") or "").strip().replace("\n", " ")
        for call in message.get("tool_calls") or []:
            fn = call["function"]
            args = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"])
            text += f" `{fn['name']}({args})`"
        lines.append(f"**{role}**: {text.strip()}")
    out = "\n\n".join(lines)
    return out if len(out) <= max_chars else out[: max_chars - 20] + "\n\n_…truncated…_"
