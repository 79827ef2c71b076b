"""Zephon's offline half: Apache Beam jobs that write lane-sharded Parquet datasets."""
