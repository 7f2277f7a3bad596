"""Data: readers for every input format, reason-coded checks, preparation into Parquet shards."""
