"""``tests.deploy.promql_names.metric_names``: the names a PromQL expression selects, and nothing
that only looks like one."""

from __future__ import annotations

import pytest

from tests.deploy.promql_names import metric_names

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("expr, names", [
    ("up", ["up"]),
    ('up{role=~"encoder|prefill", job!="x"} == 0', ["up"]),
    ("histogram_quantile(0.99, sum by (le) (rate(epd_router_time_to_first_token_seconds_bucket[5m])))",
     ["epd_router_time_to_first_token_seconds_bucket"]),
    ("sum(rate(a_total[1m])) by (role, instance) / sum without (le) (rate(b_count[1m]))", ["a_total", "b_count"]),
    ("epd_kv_blocks_used / epd_kv_blocks_total", ["epd_kv_blocks_used", "epd_kv_blocks_total"]),
    ("a > bool 0.9 and on (instance) group_left (role) b unless ignoring (x) c or d",
     ["a", "b", "c", "d"]),
    ("deriv(q[5m]) > 0 and q > 8", ["q"]),
    ("rate(x[5m] offset 1h30m) * 1e3 + 0x1F - Inf + NaN", ["x"]),
    ("max_over_time(rate(x[1m])[10m:30s])", ["x"]),
    ("epd:kv_pool_use:ratio > 0.9", ["epd:kv_pool_use:ratio"]),
    ('{__name__="epd_cache_bytes", role="encoder"}', ["epd_cache_bytes"]),
    ('label_replace(m, "dst", "{$1} by (x) rate(y)", "src", "(.*)")', ["m"]),
    ('m{path="a}b", q=\'sum(z)\'}', ["m"]),
    ("topk(3, sum by (stage) (increase(s_bucket[1h])))", ["s_bucket"]),
    ('count_values("v", build_info) + quantile(0.5, x)', ["build_info", "x"]),
    ("vector(1) + time() + scalar(s)", ["s"]),
    ("by_role_total + on_call + bool_flag + offset_seconds", ["by_role_total", "on_call", "bool_flag",
                                                              "offset_seconds"]),
    ("x @ start() + y @ 1609746000", ["x", "y"]),
])
def test_names(expr, names):
    assert metric_names(expr) == names


def test_each_name_once_in_first_seen_order():
    assert metric_names("b + a + b{x=\"1\"} + rate(a[1m])") == ["b", "a"]


def test_grafana_variables_must_be_substituted_first():
    with pytest.raises(ValueError, match=r"substitute the Grafana variables first: 'rate\(x\[\$__rate_interval\]\)'"):
        metric_names("rate(x[$__rate_interval])")
    with pytest.raises(ValueError, match="substitute the Grafana variables first"):
        metric_names('x{role="$role"}')
