"""Where runtime data lives. One git-ignored folder, set by ``TRACE_DATA_DIR`` (default ``./data``).

Everything the pipeline writes goes below it: the Dagster storage, the DuckDB file, the MLflow
store, the model cache, adapters and synthetic environments. Deleting it resets the project.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def data_dir() -> Path:
    """The runtime data folder, created on first use."""
    root = Path(os.environ.get("TRACE_DATA_DIR", REPO_ROOT / "data")).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    return root


def sub(*parts: str) -> Path:
    """A sub-folder of the data folder, created on first use."""
    path = data_dir().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    """The model cache. ``TRACE_MODELS_DIR`` lets several data folders (tests) share one cache."""
    override = os.environ.get("TRACE_MODELS_DIR")
    if override:
        path = Path(override).expanduser().resolve()
        path.mkdir(parents=True, exist_ok=True)
        return path
    return sub("models")


def duckdb_path() -> Path:
    return data_dir() / "trace.duckdb"


def trajectories_dir() -> Path:
    return sub("trajectories")


def quarantine_dir() -> Path:
    return sub("quarantine")


def landing_dir() -> Path:
    return sub("landing")


def temp_beside(path: Path) -> Path:
    """A fresh hidden name in ``path``'s folder (same filesystem, so a rename is atomic), unique per
    process and call: two writers of one file never share a temporary (``.<name>.tmp-<pid>-<rand>``;
    hidden, so the landing sensor never picks one up)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for a writer that needs a file name (DuckDB's
    ``COPY ... TO``, ``shutil.copy2``). When the block ends, the file written there is fsynced and
    replaces ``path`` in one ``os.replace``: a reader sees the old file or the new one, never part
    of one, and of two writers at once the later replace wins whole. On an error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_beside(path)
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)  # the rename itself survives a crash


def atomic_write(path: Path, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically (:func:`atomic_path`). Returns ``path``."""
    with atomic_path(path) as tmp:
        with open(tmp, "xb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
    return Path(path)


@contextlib.contextmanager
def atomic_folder(final: Path) -> Iterator[Path]:
    """Yield a new empty folder beside ``final`` to fill; when the block ends it takes ``final``'s
    place (:func:`swap_in_folder`), and on an error it is removed. Unique per call, like
    :func:`temp_beside`: two builds of one folder at once never write into each other's."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_beside(final)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    swap_in_folder(tmp, final)


def swap_in_folder(tmp: Path, final: Path) -> Path:
    """Move a fully written ``tmp`` folder to ``final`` (same filesystem), replacing an older one.

    The old folder is renamed aside before the new one takes its place, so a reader never sees a
    half-written folder; a failure removes ``tmp`` and re-raises.
    """
    try:
        if final.exists():
            trash = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def folder_checksum(folder: Path) -> str:
    """sha256 over the weight files of a saved model folder (names and bytes)."""
    digest = hashlib.sha256()
    for file in sorted(folder.glob("*.safetensors")):
        digest.update(file.name.encode())
        with file.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
