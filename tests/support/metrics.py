"""Reading a test server's Prometheus endpoint (``serve --metrics-port 0``)."""

from __future__ import annotations

import re
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def metrics_url(server: Any) -> str:
    """The /metrics address the server printed when it started."""
    return next(
        match.group(1)
        for line in server.stdout_lines
        if (match := re.search(r"metrics on (http://\S+/metrics)", line))
    )


def sessions_ended(server: Any, reason: str) -> float:
    """Sessions the server counts as ended for ``reason`` (e.g. "cancelled"): its
    ``openenv_session_duration_seconds`` count, recorded when the server is done with the
    session's stream (an env still in a call may be closed later)."""
    with urllib.request.urlopen(metrics_url(server), timeout=5) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "openenv_session_duration_seconds_count"
        and sample.labels.get("reason") == reason
    )
