"""Trajectory records: validation against the documented JSON Schema, and the file importer.

The schema is ``trace_assets/schemas/trajectory.schema.json`` (v1). The importer contract:

* every line (JSONL) or row (Parquet) is validated on its own; an error names ``file:line`` and the
  offending field;
* valid lines are stored, invalid ones are not, and nothing already stored is touched;
* a file with any error is quarantined (copied, or moved for the landing folder) next to a
  ``.reason.json`` that lists every error; the quarantine is keyed by content hash, so the same
  file is stored there once however often it is re-imported;
* re-importing a file adds nothing twice (ids are explicit or derived from the content);
* a record whose id is already taken (earlier in the file, or in the store) by *different* content
  is not stored and is reported as a warning with both content hashes; the stored one is never
  overwritten;
* a bad record never stops the rest of its file: each line is decoded (UTF-8) and parsed on its own,
  and any error while reading one record (bad bytes, nesting too deep, NaN, an unexpected exception)
  becomes that line's error;
* every echoed value is cut to ``settings.ECHO_LIMIT`` characters (saying the full length).
"""

from __future__ import annotations

import hashlib
import json
import math
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
from trace_assets.paths import atomic_path, atomic_write
from trace_assets.settings import clip, schema_error_text

SUPPORTED_SUFFIXES = (".jsonl", ".parquet")
MAX_DEPTH = 64
"""Records nested deeper than this (containers within containers) are rejected: nothing real needs
it, and deeper ones crash recursive code (``json``, ``jsonschema``) with ``RecursionError``."""
CONTENT_FIELDS = ("task_id", "env", "split", "policy", "messages", "reward", "success", "info")
"""What a conflicting duplicate is compared on (not the import-time ``source`` / ``created_at``)."""
_BOMS = ((b"\xef\xbb\xbf", "UTF-8"), (b"\xff\xfe", "UTF-16 LE"), (b"\xfe\xff", "UTF-16 BE"))


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

    def __post_init__(self) -> None:  # the field and message may echo untrusted input
        object.__setattr__(self, "field", clip(self.field, 100))
        object.__setattr__(self, "message", clip(self.message, 300))

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: field '{self.field}': {self.message}"


@dataclass
class ImportReport:
    file: str
    n_lines: int = 0
    n_valid: int = 0
    n_inserted: int = 0
    errors: list[RecordError] = field(default_factory=list)
    warnings: list[RecordError] = field(default_factory=list)
    quarantined_to: str | None = None

    @property
    def ok(self) -> bool:
        return not self.errors

    def summary(self) -> str:
        text = (
            f"{self.file}: {self.n_lines} lines, {self.n_valid} valid, {self.n_inserted} new, "
            f"{len(self.errors)} errors"
        )
        if self.warnings:
            text += f", {len(self.warnings)} warnings"
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
            except RecursionError:
                raise RecordErrors([RecordError(file, line, key, f"nested deeper than {MAX_DEPTH} levels")]) from None
    problem = _shape_problem(record)
    if problem:
        raise RecordErrors([RecordError(file, line, *problem)])
    if record.get("info") is None:
        record.pop("info", None)
    for key in [k for k, v in record.items() if v is None and k not in ("messages",)]:
        record.pop(key)  # Parquet fills absent optional columns with nulls
    errors = [
        RecordError(file, line, ".".join(str(p) for p in err.absolute_path) or _missing_field(err), schema_error_text(err))
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


def _shape_problem(record: dict[str, Any]) -> tuple[str, str] | None:
    """``(field, message)`` for nesting deeper than ``MAX_DEPTH`` or a non-finite number (JSON
    Schema's bounds never fire on NaN), else None. Iterative, so it cannot itself recurse too deep."""
    stack: list[tuple[Any, tuple, int]] = [(record, (), 0)]
    while stack:
        value, where, depth = stack.pop()
        name = ".".join(map(str, where)) or "<root>"
        if isinstance(value, float) and not math.isfinite(value):
            return name, f"{value} is not a finite number"
        if isinstance(value, (dict, list)):
            if depth >= MAX_DEPTH:
                return name, f"nested deeper than {MAX_DEPTH} levels"
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend((v, (*where, k), depth + 1) for k, v in items)
    return None


def content_hash(record: dict[str, Any]) -> str:
    """A hash of what a trajectory says (``CONTENT_FIELDS``), to tell a re-import from a conflict."""
    blob = json.dumps({k: record.get(k) for k in CONTENT_FIELDS}, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


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
    """Yield ``(line_number, record_or_error)`` for a JSONL or Parquet file (1-based lines/rows).

    JSONL is read as bytes and decoded line by line, so a bad byte costs only its line. A UTF-8
    byte-order mark is skipped; a UTF-16 one (or NUL bytes, its other tell-tale) is named, since
    JSONL is UTF-8.
    """
    name = str(path)
    if path.suffix == ".jsonl":
        with path.open("rb") as fh:
            head = fh.read(3)
            fh.seek(0)
            for bom, encoding in _BOMS:
                if head.startswith(bom):
                    if encoding != "UTF-8":
                        yield 1, RecordError(name, 1, "<file>", f"the file is {encoding} (it starts with a {encoding} "
                                             "byte-order mark); JSONL must be UTF-8: convert it, e.g. "
                                             "`iconv -f UTF-16 -t UTF-8`")
                        return
                    fh.seek(len(bom))
            for line_no, raw in enumerate(fh, start=1):
                item = _parse_line(raw, name, line_no)
                if item is not None:
                    yield line_no, item
    elif path.suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises many types for corrupt files
            yield 0, RecordError(name, 0, "<file>", f"unreadable Parquet: {exc}")
            return
        for row_no, row in enumerate(table.to_pylist(), start=1):
            yield row_no, _drop_struct_nulls(row)
    else:
        yield 0, RecordError(name, 0, "<file>", f"unsupported file type {path.suffix!r}; use {SUPPORTED_SUFFIXES}")


def _parse_line(raw: bytes, name: str, line_no: int) -> dict[str, Any] | RecordError | None:
    """One JSONL line: its object, its error, or None for a blank line."""
    if b"\x00" in raw:
        return RecordError(name, line_no, "<line>", "NUL bytes: is the file UTF-16? JSONL must be UTF-8")
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return RecordError(name, line_no, "<line>", f"not UTF-8 text: {exc.reason} at byte {exc.start} "
                           f"(0x{raw[exc.start]:02x}); JSONL must be UTF-8")
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return RecordError(name, line_no, "<line>", f"not valid JSON: {exc.msg} at column {exc.colno}")
    except RecursionError:
        return RecordError(name, line_no, "<line>", f"nested deeper than {MAX_DEPTH} levels")
    if not isinstance(obj, dict):
        return RecordError(name, line_no, "<line>", "a trajectory must be a JSON object")
    return obj


def _drop_struct_nulls(row: dict[str, Any]) -> dict[str, Any]:
    """Natively nested Parquet (``messages`` as ``list<struct>``) gives every message every struct
    field, ``None`` where a message had none. Drop those, so the row reads like the JSON it encodes;
    ``content: null`` is meaningful (a tool-call turn) and stays."""
    messages = row.get("messages")
    if isinstance(messages, list):
        row = {**row, "messages": [_without_nulls(m, keep=("content",)) if isinstance(m, dict) else m for m in messages]}
    return row


def _without_nulls(message: dict[str, Any], keep: tuple[str, ...] = ()) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if v is not None or k in keep}
    if isinstance(out.get("tool_calls"), list):
        out["tool_calls"] = [
            {**_without_nulls(c), **({"function": _function_without_nulls(c["function"])} if isinstance(c.get("function"), dict) else {})}
            if isinstance(c, dict) else c
            for c in out["tool_calls"]
        ]
    return out


def _function_without_nulls(function: dict[str, Any]) -> dict[str, Any]:
    """Object arguments become one struct over every call's keys: a call's absent keys read None.
    (Parquet cannot tell an explicit null from an absent key; absent is by far the common case.)"""
    out = _without_nulls(function)
    if isinstance(out.get("arguments"), dict):
        out["arguments"] = _without_nulls(out["arguments"])
    return out


def validate_file(path: Path) -> tuple[list[dict[str, Any]], list[RecordError], int, list[RecordError], dict[str, int]]:
    """All valid normalised records of a file, the errors, the number of lines read, the warnings
    (an id repeated with different content: the first is kept, the repeat is not), and the line of
    each kept record by id."""
    records: list[dict[str, Any]] = []
    errors: list[RecordError] = []
    warnings: list[RecordError] = []
    seen: dict[str, tuple[int, str]] = {}
    n_lines = 0
    now = now_iso()
    for line_no, item in read_raw(path):
        if isinstance(item, RecordError):
            errors.append(item)
            n_lines += line_no > 0
            continue
        n_lines += 1
        try:
            record = normalize(item, file=str(path), line=line_no, source=path.name, now=now)
        except RecordErrors as exc:
            errors.extend(exc.errors)
            continue
        except Exception as exc:  # noqa: BLE001 - one record must never stop its file
            errors.append(RecordError(str(path), line_no, "<line>", f"cannot read this record: {type(exc).__name__}: {exc}"))
            continue
        tid, digest = record["trajectory_id"], content_hash(record)
        if tid in seen:
            first_line, first_digest = seen[tid]
            if first_digest == digest:
                records.append(record)  # an exact repeat: valid, and stored once
            else:
                warnings.append(RecordError(
                    str(path), line_no, "trajectory_id",
                    f"id {tid!r} repeats line {first_line} with different content (content hash {digest} vs "
                    f"{first_digest}); kept line {first_line}, not this one",
                ))
            continue
        seen[tid] = (line_no, digest)
        records.append(record)
    return records, errors, n_lines, warnings, {tid: line for tid, (line, _) in seen.items()}


def store_conflicts(records: list[dict[str, Any]], store: Any, file: str, lines: dict[str, int]) -> tuple[list[dict[str, Any]], list[RecordError]]:
    """Split ``records`` into those that are new or identical to the stored ones, and warnings for
    those whose id the store already holds with different content (those are not inserted)."""
    stored = {r["trajectory_id"]: content_hash(r) for r in store.trajectories_by_id([r["trajectory_id"] for r in records])}
    keep, warnings = [], []
    for record in records:
        tid = record["trajectory_id"]
        digest = content_hash(record)
        if tid in stored and stored[tid] != digest:
            warnings.append(RecordError(
                file, lines.get(tid, 0), "trajectory_id",
                f"id {tid!r} is already stored with different content (content hash {stored[tid]} stored vs "
                f"{digest} here); the stored one is kept",
            ))
            continue
        keep.append(record)
    return keep, warnings


def quarantine(path: Path, errors: list[RecordError], *, move: bool, folder: Path | None = None) -> Path:
    """Copy (or move) ``path`` into the quarantine folder beside a ``.reason.json``; never delete.

    The copy is named by its content hash, so the same bytes quarantined again (under any name) are
    stored once: its
    reason file is refreshed (``first_quarantined_at`` kept, ``times`` counted) and a moved source,
    whose bytes are already there, is removed.
    """
    folder = folder or paths.quarantine_dir()
    folder.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    earlier = sorted(p for p in folder.glob(f"{digest}_*") if not p.name.endswith(".reason.json"))
    target = earlier[0] if earlier else folder / f"{digest}_{path.name}"  # same bytes, any name: one copy
    reason_path = folder / f"{target.name}.reason.json"
    previous: dict[str, Any] = {}
    if reason_path.exists():
        try:
            previous = json.loads(reason_path.read_text())
        except (OSError, ValueError):
            previous = {}
    now = now_iso()
    reason = {
        "file": str(path),
        "sha256_16": digest,
        "first_quarantined_at": previous.get("first_quarantined_at", now),
        "quarantined_at": now,
        "times": int(previous.get("times", 0)) + 1,
        "errors": [str(e) for e in errors],
    }
    atomic_write(reason_path, json.dumps(reason, indent=2))
    if target.exists():
        if move:
            path.unlink()
    elif move:
        shutil.move(str(path), target)
    else:
        with atomic_path(target) as partial:
            shutil.copy2(path, partial)
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
    records, errors, report.n_lines, report.warnings, lines = validate_file(path)
    report.n_valid = len(records)
    report.errors = errors
    if records:
        records, conflicts = store_conflicts(records, store, str(path), lines)
        report.warnings.extend(conflicts)
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
