"""Synthetic data and fixtures for tests and benchmarks. Runtime code never
imports this package (tests/test_layout.py checks it).

- :mod:`pipeline.testing.trajectories`: rows in the ingest contract, deterministic for a seed;
- :mod:`pipeline.testing.train_fixtures`: a tiny published policy and synthetic snapshots for the trainer;
- :mod:`pipeline.testing.health_lake`: a lake with every table the health report reads.
"""
