"""Reading a test server's Prometheus endpoint (``serve --metrics-port 0``): the one place
the tests fetch and parse ``/metrics`` text."""

from __future__ import annotations

import re
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def metrics_url(server: Any) -> str:
    """The /metrics address the server printed when it started."""
    for line in server.stdout_lines:
        if match := re.search(r"metrics on (http://\S+/metrics)", line):
            return match.group(1)
    raise AssertionError(f"no metrics line in the server's output: {server.stdout_lines}")


def samples(server: Any) -> list[Sample]:
    """Every sample the server's /metrics exposes now (one scrape)."""
    with urllib.request.urlopen(metrics_url(server), timeout=5) as response:
        text = response.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def metric(server: Any, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(
        sample.value
        for sample in samples(server)
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def sessions_ended(server: Any, reason: str) -> float:
    """Sessions the server counts as ended for ``reason`` (e.g. "cancelled"): its
    ``openenv_session_duration_seconds`` count, recorded when the server is done with the
    session's stream (an env still in a call may be closed later)."""
    return metric(server, "openenv_session_duration_seconds_count", reason=reason)
