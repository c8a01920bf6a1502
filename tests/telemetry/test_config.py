"""Tracing's flags and config, the ``traceparent`` parser and the disabled ``Tracing`` (pure)."""

from __future__ import annotations

import argparse

import pytest

from telemetry import NO_SPAN, OFF, SpanSpec, TracingConfig, add_tracing_args, parse_traceparent, start_tracing
from telemetry.config import ENDPOINT_ENV, resolve_endpoint

pytestmark = pytest.mark.unit

TID, SID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
VALID = f"00-{TID}-{SID}-01"


def test_off_by_default_and_a_valid_config():
    assert not TracingConfig().enabled and start_tracing(TracingConfig()) is OFF
    config = TracingConfig(endpoint="https://collector:4318/v1/traces", sample_ratio=0.25, role="prefill")
    assert config.enabled and config.sample_ratio == 0.25


@pytest.mark.parametrize("fields, flag", [
    ({"endpoint": "collector:4318"}, "--otlp-traces-endpoint"),
    ({"endpoint": "grpc://collector:4317"}, "--otlp-traces-endpoint"),
    ({"endpoint": "http://"}, "--otlp-traces-endpoint"),
    ({"sample_ratio": 0.0}, "--otlp-traces-sample-ratio"),
    ({"sample_ratio": 1.5}, "--otlp-traces-sample-ratio"),
    ({"sample_ratio": float("nan")}, "--otlp-traces-sample-ratio"),
    ({"sample_ratio": True}, "--otlp-traces-sample-ratio"),
    ({"role": "gateway"}, "role"),
    ({"export_timeout_s": 0}, "export_timeout_s"),
])
def test_a_bad_config_is_refused_naming_its_flag(fields, flag):
    with pytest.raises(ValueError, match=flag):
        TracingConfig(**fields)


def test_the_flags_and_the_environments_endpoint():
    parser = argparse.ArgumentParser()
    add_tracing_args(parser)
    args = parser.parse_args(["--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces",
                              "--otlp-traces-sample-ratio", "0.5"])
    config = TracingConfig.from_args(args, "decode", "abc", "tiny")
    assert (config.endpoint, config.sample_ratio, config.role, config.instance_id, config.model) == (
        "http://127.0.0.1:4318/v1/traces", 0.5, "decode", "abc", "tiny")
    assert parser.parse_args([]).otlp_traces_sample_ratio == 1.0
    assert resolve_endpoint(None, {}) is None and resolve_endpoint(None, {ENDPOINT_ENV: ""}) is None
    assert resolve_endpoint(None, {ENDPOINT_ENV: "http://c/v1/traces"}) == "http://c/v1/traces"
    assert resolve_endpoint("http://flag/v1/traces", {ENDPOINT_ENV: "http://c/v1/traces"}) == "http://flag/v1/traces"


def test_traceparent_parsing():
    parent = parse_traceparent(VALID)
    assert parent is not None and parent.sampled and f"{parent.trace_id:032x}" == TID and parent.header == VALID
    assert parse_traceparent(f" 00-{TID}-{SID}-00 ").sampled is False  # type: ignore[union-attr]
    assert parse_traceparent(f"01-{TID}-{SID}-01-future") is not None  # a later version may add fields
    for bad in (None, "", "garbage", f"00-{TID}-{SID}-01-extra", f"ff-{TID}-{SID}-01", f"00-{'0' * 32}-{SID}-01",
                f"00-{TID}-{'0' * 16}-01", f"00-{TID.upper()}-{SID}-01", f"00-{TID[:-1]}-{SID}-01"):
        assert parse_traceparent(bad) is None, bad


def test_the_disabled_tracing_does_nothing_and_passes_a_valid_traceparent_through():
    assert OFF.start_span("request", None, 1.0) is NO_SPAN and NO_SPAN.traceparent is None
    assert OFF.start_span("request", "nonsense", 1.0) is NO_SPAN
    span = OFF.start_span("request", VALID, 1.0, {"a": 1})
    assert span.traceparent == VALID and span.child("prefill", 1.1).traceparent == VALID
    span.end(2.0, error="boom")
    assert OFF.record(VALID, [SpanSpec("x", 1.0, 2.0)]) == 0
    assert OFF.record_timeline(VALID, "prefill", [{"event": "queued", "t": 1.0}]) == 0
    assert OFF.flush() and OFF.shutdown(0.1) and not OFF.enabled
