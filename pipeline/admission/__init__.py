"""Admission: comparability, freshness, signal and bucketing checks over GRPO
groups; receipts; immutable, content-addressed snapshot materialization."""
