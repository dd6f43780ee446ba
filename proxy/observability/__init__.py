"""Observability that is not a metric definition: the dashboard's live feed and why a worker is in its state.

Metric definitions stay in proxy/observability/metrics.py; nothing here is on the request path.
"""
