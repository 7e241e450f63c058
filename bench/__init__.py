"""Benchmarks: `python -m bench.run --quick|--full` (openenv-grpc against OpenEnv and the
bare grpc.aio floor, side by side) and `python -m bench.echo_load`. Numbers go to
docs/benchmarks.md; the test suite only smoke-runs them (tests/test_bench_smoke.py) and
never asserts a speed."""
