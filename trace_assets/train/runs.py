"""The folder protocol of a trained adapter: train once, reuse after.

An adapter folder (``<data>/adapters/<name>/<key>``, the key hashing everything that shapes the
weights) holds the GRPO run's checkpoints and adapter and, once everything after training is done
too (evaluation, registration), its manifest ``trace_adapter.json``: the value of the asset that
made it. :func:`train_or_reuse` returns a manifest's value when it is still good, and otherwise
produces the value (training resumes from the folder's checkpoints) and writes the manifest
atomically, last, so a manifest always describes a finished run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trace_assets.paths import atomic_write

MANIFEST = "trace_adapter.json"


def train_or_reuse(out_dir: Path, produce: Callable[[], dict[str, Any]], *,
                   reusable: Callable[[dict[str, Any]], bool] = lambda value: True) -> tuple[dict[str, Any], bool]:
    """``(value, reused)``: the manifest's value in ``out_dir`` when there is one and ``reusable``
    says it still holds, else ``produce()``'s, written as the new manifest."""
    manifest = Path(out_dir) / MANIFEST
    if manifest.exists():
        value = json.loads(manifest.read_text())
        if reusable(value):
            return value, True
    value = produce()
    atomic_write(manifest, json.dumps(value, indent=2, default=str))
    return value, False
