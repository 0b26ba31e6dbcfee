"""The domain stands apart from the asset layer: no module of a step package imports ``trace_assets.assets``.

``trace_assets/assets/*`` is imported only by ``definitions.py`` and by tests. Every import is
read with ``ast`` (module level and inside functions, absolute and relative), so a lazy import
inside a function body counts as much as one at the top.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import trace_assets

PACKAGE_ROOT = Path(trace_assets.__file__).resolve().parent
DOMAIN = ("envs", "agent", "identify", "synthesize", "train", "route", "experiment")
FORBIDDEN = "trace_assets.assets"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` for every import statement in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path, root)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module))
            # `from trace_assets import assets` names the package through its parent
            out.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
    return out


def layering_violations(root: Path = PACKAGE_ROOT) -> list[str]:
    """``file:line imports module`` for each domain module that imports the asset layer."""
    found = []
    for step in DOMAIN:
        for path in sorted((root / step).rglob("*.py")):
            seen_lines = set()
            for line, module in imported_modules(path, root):
                if (module == FORBIDDEN or module.startswith(FORBIDDEN + ".")) and line not in seen_lines:
                    seen_lines.add(line)  # one report per statement
                    found.append(f"{path.relative_to(root.parent)}:{line} imports {module}")
    return found


def test_no_domain_module_imports_the_asset_layer():
    assert layering_violations() == []


def test_a_planted_violation_is_found(tmp_path):
    """The rule can fail: an absolute, a relative and a lazy import of the asset layer are each caught."""
    root = tmp_path / "trace_assets"
    shutil.copytree(PACKAGE_ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    assert layering_violations(root) == []
    (root / "route" / "planted_abs.py").write_text("from trace_assets.assets.route import ALL\n")
    (root / "envs" / "planted_rel.py").write_text("from ..assets import foundation\n")
    (root / "train" / "planted_lazy.py").write_text("def f():\n    import trace_assets.assets.train\n")
    (root / "agent" / "planted_parent.py").write_text("from trace_assets import assets\n")
    found = layering_violations(root)
    assert found == [
        "trace_assets/envs/planted_rel.py:1 imports trace_assets.assets",
        "trace_assets/agent/planted_parent.py:1 imports trace_assets.assets",
        "trace_assets/train/planted_lazy.py:2 imports trace_assets.assets.train",
        "trace_assets/route/planted_abs.py:1 imports trace_assets.assets.route",
    ]
