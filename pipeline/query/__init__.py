"""SQL over the lake: DuckDB views named after the tables (duck.py is the adapter)."""
