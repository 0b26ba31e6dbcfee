"""Tables and plots for humans: polars frames as markdown, PNG charts, for asset metadata, the CLI and MLflow."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import polars as pl


def to_markdown(frame: pl.DataFrame, *, float_precision: int = 3) -> str:
    """A GitHub-flavoured markdown table of ``frame`` (all rows)."""
    with pl.Config(
        tbl_formatting="MARKDOWN", tbl_hide_column_data_types=True, tbl_hide_dataframe_shape=True,
        tbl_rows=-1, tbl_cols=-1, float_precision=float_precision, fmt_str_lengths=200,
        tbl_width_chars=10_000,
    ):
        return str(frame)


def success_by_family(records: Iterable[dict[str, Any]]) -> pl.DataFrame:
    """Per (split, family): episodes, success rate and mean reward, plus an ``ALL`` row per split."""
    rows = [
        {"split": r["split"], "family": r["info"].get("family", "?"), "success": bool(r["success"]), "reward": float(r["reward"])}
        for r in records
    ]
    if not rows:
        return pl.DataFrame(schema={"split": pl.String, "family": pl.String, "n": pl.UInt32, "success_rate": pl.Float64, "mean_reward": pl.Float64})
    frame = pl.DataFrame(rows)
    agg = [pl.len().alias("n"), pl.col("success").mean().alias("success_rate"), pl.col("reward").mean().alias("mean_reward")]
    by_family = frame.group_by("split", "family").agg(agg)
    overall = frame.group_by("split").agg(agg).with_columns(pl.lit("ALL").alias("family")).select(by_family.columns)
    return pl.concat([by_family, overall]).sort("split", pl.col("family") == "ALL", "family")


def delta_cov_scatter(summary: pl.DataFrame, *, delta: float | None = None, rho: float | None = None, title: str = "") -> bytes:
    """PNG scatter of mean Delta (x) against mean Cov (y), one labelled point per capability,
    with the delta and rho threshold lines when given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.8), dpi=100)
    for row in summary.iter_rows(named=True):
        selected = row.get("selected")
        ax.scatter(row["delta_mean"], row["cov_mean"], s=60,
                   color="tab:green" if selected else ("tab:gray" if selected is False else "tab:blue"))
        ax.annotate(row["capability"], (row["delta_mean"], row["cov_mean"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    if delta is not None:
        ax.axvline(delta, color="tab:red", linestyle="--", label=f"δ = {delta}")
    if rho is not None:
        ax.axhline(rho, color="tab:orange", linestyle="--", label=f"ρ = {rho}")
    ax.set_xlabel("Δ = ER− − ER+ (mean over runs)")
    ax.set_ylabel("Cov = LACKING_F / |F| (mean over runs)")
    ax.set_xlim(min(-0.05, summary["delta_mean"].min() or 0) - 0.05, 1.05)
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    if delta is not None or rho is not None:
        ax.legend(loc="lower right")
    ax.set_title(title or "capabilities: contrast against coverage")
    return _png(fig)


def _png(fig: Any) -> bytes:
    """``fig`` laid out and rendered as PNG bytes; the figure is closed."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    if fig.get_layout_engine() is None:  # a figure made with its own layout engine keeps it
        fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def png_metadata(png: bytes, name: str) -> dict[str, Any]:
    """Save ``png`` under ``<data>/reports/`` and return Dagster metadata: its path and an inline
    markdown image (the UI renders data-URI images)."""
    import base64
    import hashlib

    from dagster import MetadataValue

    from trace_assets import paths

    path = paths.sub("reports") / f"{name}_{hashlib.sha256(png).hexdigest()[:10]}.png"
    paths.atomic_write(path, png)  # content-named: two runs may write the same one at once
    encoded = base64.b64encode(png).decode()
    return {
        f"{name}_png": MetadataValue.path(str(path)),
        f"{name}": MetadataValue.md(f"![{name}](data:image/png;base64,{encoded})"),
    }


def reward_histogram(rewards: list[float], *, title: str = "") -> bytes:
    """PNG histogram of episode rewards in [0, 1] (10 bins)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    ax.hist(rewards, bins=[i / 10 for i in range(11)], color="tab:blue", edgecolor="white")
    ax.set_xlabel("episode reward")
    ax.set_ylabel("episodes")
    ax.set_title(title or f"{len(rewards)} episodes")
    return _png(fig)


def heatmap(values: list[list[float]], rows: list[str], columns: list[str], *, title: str = "") -> bytes:
    """PNG heatmap of ``values`` in [0, 1] (rows x columns), each cell annotated with its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * len(columns), 1.4 + 0.45 * len(rows)), dpi=100)
    image = ax.imshow(values, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(columns)), columns, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7)
    fig.colorbar(image, ax=ax, fraction=0.03)
    ax.set_title(title, fontsize=9)
    return _png(fig)


def forest_plot(panels: dict[str, list[dict[str, Any]]], **kwargs: Any) -> bytes:
    """:func:`forest_figure` as PNG bytes."""
    return _png(forest_figure(panels, **kwargs))


def forest_figure(panels: dict[str, list[dict[str, Any]]], *, reference: dict[str, float] | None = None,
                  xlabels: dict[str, str] | None = None, title: str = "") -> Any:
    """The matplotlib figure of a forest plot: one panel per ``panels`` entry (side by side), one row per item, top to bottom
    in the given order; each item ``{"label", "estimate", "low", "high"}`` (fractions, drawn x100)
    is a point with its interval. ``reference[panel]`` (a fraction) draws a dashed vertical line,
    e.g. 0 for differences; an interval that excludes it is drawn in a stronger colour.
    ``xlabels[panel]`` names a panel's axis (default: percentage points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(panels)
    rows = max((len(v) for v in panels.values()), default=1)
    # constrained layout sizes the panels around every tick label, the values' included
    fig, axes = plt.subplots(1, len(names), figsize=(6.4 * len(names), 1.1 + 0.42 * max(rows, 1)), dpi=100,
                             squeeze=False, layout="constrained")
    for ax, name in zip(axes[0], names):
        items = panels[name]
        ref = (reference or {}).get(name)
        for y, item in enumerate(reversed(items)):
            est, low, high = (100.0 * item[k] for k in ("estimate", "low", "high"))
            strong = ref is not None and (item["low"] > ref or item["high"] < ref)
            color = "tab:red" if strong else "tab:blue"
            ax.plot([low, high], [y, y], color=color, linewidth=2)
            ax.plot([est], [y], marker="o", color=color)
        ax.set_yticks(range(len(items)), [item["label"] for item in reversed(items)], fontsize=8)
        # each row's value, as a right-hand tick label: inside the figure whatever the interval's end
        values = ax.twinx()
        values.set_ylim(ax.get_ylim())
        values.set_yticks(range(len(items)), [
            "{:.1f} [{:.1f}, {:.1f}]".format(*(100.0 * item[k] for k in ("estimate", "low", "high")))
            for item in reversed(items)], fontsize=7)
        if ref is not None:
            ax.axvline(100.0 * ref, color="tab:gray", linestyle="--", linewidth=1)
        ax.set_xlabel((xlabels or {}).get(name, "percentage points"))
        ax.set_title(name, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        ax.margins(x=0.08)
        values.set_ylim(ax.get_ylim())
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
