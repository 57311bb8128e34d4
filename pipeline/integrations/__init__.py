"""Adapters from other RL systems' rollout formats to the ingest contract
(schemas/trajectories.yaml). Each adapter imports its system lazily: the
system is an optional extra, never a dependency of the lake."""
