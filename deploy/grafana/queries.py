"""The PromQL of a Grafana dashboard's panels, with Grafana's template variables filled in, so that each
can be run against a real Prometheus (a test's, or yours):

    python deploy/grafana/queries.py [deploy/grafana/infercache.json] [--model REGEX]

    from queries import panel_queries   # deploy/grafana/ on sys.path
    for title, expr in panel_queries(json.load(open("deploy/grafana/infercache.json"))): ...

Filled in: the dashboard's own variables ($model, ${model}, ${model:regex}, [[model]]; `model` by the
given regex, others by `variables`), and Grafana's built-ins $__rate_interval, $__interval,
$__interval_ms, $__range, $__range_s, $__range_ms. Anything else is left as it is, `$` and all, for
the caller to notice.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent / "infercache.json"

# ${name}, ${name:format}, [[name]], $name: longest names first, so $__range_ms is not read as $__range + "_ms"
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)(?::\w+)?\]\]|\$(\w+)")


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m|h|d)", duration)
    if not match:
        raise ValueError(f"not a duration: {duration!r} (like 30s, 1m, 6h)")
    number, unit = int(match.group(1)), match.group(2)
    return number * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}[unit]


def builtins(rate_interval: str = "1m", interval: str = "15s", range_: str = "1h") -> dict[str, str]:
    return {
        "__rate_interval": rate_interval,
        "__interval": interval,
        "__interval_ms": str(int(_seconds(interval) * 1000)),
        "__range": range_,
        "__range_s": str(int(_seconds(range_))),
        "__range_ms": str(int(_seconds(range_) * 1000)),
    }


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """expr with each known variable replaced; unknown ones stay."""
    def one(match: re.Match) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        return values.get(name, match.group(0))
    return _VARIABLE.sub(one, expr)


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, rows' collapsed panels included (a collapsed row holds its panels)."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def panel_queries(dashboard: dict, model: str = ".*", *, rate_interval: str = "1m", interval: str = "15s",
                  range_: str = "1h", variables: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every Prometheus query of every panel, variables filled in; a panel with
    several queries gives several pairs, a panel without any (rows, text) none."""
    values = {**builtins(rate_interval, interval, range_), "model": model, **(variables or {})}
    found = []
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            expr = target.get("expr", "")
            if expr.strip():
                found.append((panel.get("title", ""), substitute(expr, values)))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dashboard", nargs="?", type=Path, default=DASHBOARD)
    parser.add_argument("--model", default=".*", help="regex for $model (default .*)")
    args = parser.parse_args(argv)
    for title, expr in panel_queries(json.loads(args.dashboard.read_text()), args.model):
        print(f"# {title}\n{expr}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
