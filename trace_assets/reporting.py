"""Tables for humans: polars frames rendered as markdown for asset metadata, the CLI and MLflow."""

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
