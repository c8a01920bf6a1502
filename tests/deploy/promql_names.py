"""The metric names a PromQL expression selects, without a PromQL parser: Prometheus 2.42 (Debian
bookworm's) has no ``/api/v1/parse_query`` and promtool no ``promql`` command, so this reads the
expression's tokens. Tested on every construct the rules and the dashboard use, and on the ones
that look like names but are not (functions, aggregations, keywords, grouping labels, durations,
strings, label names and values) in tests/deploy/test_prometheus_promql.py.

``metric_names(expr) -> list[str]``: the names in order of first appearance, each once; a selector
written ``{__name__="x"}`` counts as ``x``. Grafana variables (``$__rate_interval``) must be
substituted first (``ValueError`` for a ``$`` outside a function's string argument, so none is
silently read as part of a name).
"""

from __future__ import annotations

import re

AGGREGATIONS = frozenset({"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                          "bottomk", "topk", "quantile", "limitk", "limit_ratio"})
KEYWORDS = frozenset({"and", "or", "unless", "atan2", "bool", "offset", "inf", "nan"})
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_STRING = r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`'
_LEX = re.compile(rf"""
    (?P<string>{_STRING})
  | (?P<matchers>\{{(?:[^{{}}"'`]|{_STRING})*\}})
  | (?P<range>\[[^\]]*\])
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+)(?![\w:.])
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<space>\s+)
  | (?P<other>.)
""", re.X | re.S)
_NAME_MATCHER = re.compile(r'(?:^|[{,\s])__name__\s*=\s*"((?:[^"\\]|\\.)*)"')


def metric_names(expr: str) -> list[str]:
    tokens = [(m.lastgroup, m.group()) for m in _LEX.finditer(expr) if m.lastgroup != "space"]
    if any("$" in text for kind, text in tokens if kind != "string"):
        raise ValueError(f"substitute the Grafana variables first: {expr!r}")
    found: list[str] = []
    skip_to_close = False
    for i, (kind, text) in enumerate(tokens):
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if skip_to_close:  # the label list of by/without/on/ignoring/group_left/group_right
            skip_to_close = text != ")"
        elif kind == "matchers":
            found += _NAME_MATCHER.findall(text)
        elif kind == "name" and text in GROUPING:
            skip_to_close = following == "("
        elif kind == "name" and following != "(" and text not in AGGREGATIONS and text.lower() not in KEYWORDS:
            found.append(text)
    return list(dict.fromkeys(found))
