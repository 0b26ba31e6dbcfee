"""Content hashes that name things: code versions, data versions, cache keys, manifest keys."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def stable_hash(obj: Any, n: int = 16) -> str:
    """sha256 of the canonical JSON of ``obj``, truncated to ``n`` hex characters."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:n]
