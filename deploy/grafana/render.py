"""The dashboard's panels drawn as one PNG from a real Prometheus, laid out by their gridPos: what the
README shows, without a Grafana. Time series as lines (one per series, named by legendFormat), stats
as their last value, the heatmap as its buckets' rates, tables as bars, text panels as their text.

    from render import render          # deploy/grafana/ on sys.path
    render(query_range, dashboard, start, end, Path("dashboard.png"))

`query_range(expr, start, end, step)` is any function answering like Prometheus' /api/v1/query_range
(tests.prometheus_server.PrometheusProcess.query_range). Needs matplotlib (`pip install
infercache[eval]`).
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Callable
from pathlib import Path

from queries import builtins, panels, substitute

_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
COLUMNS, ROW_INCHES, COLUMN_INCHES = 24, 0.42, 0.75


def _legend(target: dict, labels: dict) -> str:
    fmt = target.get("legendFormat") or ""
    if fmt and fmt != "__auto":
        return _LEGEND.sub(lambda m: labels.get(m.group(1), ""), fmt)
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__") or "value"


def render(query_range: Callable, dashboard: dict, start: float, end: float, out: Path, *, model: str = ".*",
           step: float | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    span = end - start
    step = step or max(1.0, span / 240)
    values = {**builtins(rate_interval=f"{max(4 * int(step), 60)}s", interval=f"{int(step)}s",
                         range_=f"{max(1, int(span))}s"), "model": model}
    laid = [p for p in panels(dashboard) if p.get("type") != "row"]
    top = min(p["gridPos"]["y"] for p in laid) - 2  # two grid rows above the panels for the title
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in laid) - top
    figure = plt.figure(figsize=(COLUMNS * COLUMN_INCHES, rows * ROW_INCHES), dpi=80)
    title = dashboard.get("title", "dashboard")
    figure.suptitle(f"{title}: {span / 60:.0f} minutes of a test run", fontsize=16, y=1 - 0.6 / rows)
    for panel in laid:
        grid = panel["gridPos"]
        left, bottom = grid["x"] / COLUMNS, 1 - (grid["y"] - top + grid["h"]) / rows
        axes = figure.add_axes((left + 0.035, bottom + 0.25 / rows, grid["w"] / COLUMNS - 0.05,
                                (grid["h"] - 1.4) / rows * 0.93))
        axes.set_title(panel.get("title", ""), fontsize=10, loc="left")
        kind = panel.get("type")
        if kind == "text":
            axes.axis("off")
            text = re.sub(r"[`#*]", "", panel.get("options", {}).get("content", ""))
            axes.text(0, 1, "\n".join(textwrap.wrap(" ".join(text.split()), 90))[:700], va="top", fontsize=8)
            continue
        series = []
        for target in panel.get("targets", []):
            expr = substitute(target.get("expr", ""), values)
            for found in query_range(expr, start, end, step):
                points = [(float(t) - end, float(v)) for t, v in found["values"] if math.isfinite(float(v))]
                if points:
                    series.append((_legend(target, found["metric"]), points))
        if not series:
            axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes)
            axes.set_xticks([])
            axes.set_yticks([])
            continue
        if kind == "stat":
            axes.axis("off")
            last = series[0][1][-1][1]
            unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
            shown = f"{100 * last:.1f}%" if unit in ("percentunit",) else f"{last:,.3g}"
            axes.text(0.5, 0.4, shown + (" s" if unit == "s" else ""), ha="center", va="center", fontsize=26)
        elif kind == "table":
            names = [name for name, _ in series][:10]
            axes.barh(names, [points[-1][1] for _, points in series][:10])
            axes.tick_params(labelsize=7)
        else:
            for name, points in series[:12]:
                axes.plot([t / 60 for t, _ in points], [v for _, v in points], label=name, linewidth=1.2)
            axes.set_xlabel("minutes ago", fontsize=7)
            axes.tick_params(labelsize=7)
            axes.grid(alpha=0.3)
            axes.legend(fontsize=6, loc="upper left", ncol=2, framealpha=0.6)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    plt.close(figure)
    return out
