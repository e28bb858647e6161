"""Benchmarks: run as modules, e.g. ``python -m benchmarks.engine``; not part of the tests."""
