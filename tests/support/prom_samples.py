"""A server's /metrics read whole: every sample keyed by its name plus labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def metrics(http) -> dict[str, float]:
    """Every sample of /metrics, keyed by name plus labels."""
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples
