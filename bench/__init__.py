"""Benchmarks (run with `make bench-echo`); never part of the test suite."""
