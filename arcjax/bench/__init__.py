"""Benchmark pieces (burst experiment, cost-model fitting). Needs the `bench` extra; the
engine core never imports this package."""
