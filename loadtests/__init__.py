"""Locust load tests of the HTTP API, with latency SLO gates."""
