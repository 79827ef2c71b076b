"""Zephon's offline half: Apache Beam jobs that write lane-sharded Parquet datasets."""

from beam_jobs import quiet

quiet.install()  # Beam's import-time apitools notice (beam_jobs.quiet); imports no Beam
