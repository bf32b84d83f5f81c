"""Helpers for tests and benchmarks only (synthetic workloads); not part of the library's API."""
