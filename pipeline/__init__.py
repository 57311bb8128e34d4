"""The trajectory lakehouse: agent RL rollouts -> comparable, fresh, reproducible
training batches on Delta tables -> DeepSpeed training with lineage.

`import pipeline` stays light: heavy dependencies (deltalake, duckdb, dask,
torch, deepspeed, transformers, vllm, great_expectations) are imported only in
their adapter modules, when a stage needs them.
"""

__version__ = "0.1.0"
