"""Where runtime data lives. One git-ignored folder, set by ``TRACE_DATA_DIR`` (default ``./data``).

Everything the pipeline writes goes below it: the Dagster storage, the DuckDB file, the MLflow
store, the model cache, adapters and synthetic environments. Deleting it resets the project.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
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
