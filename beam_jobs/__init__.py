"""Zephon's offline half: Apache Beam jobs that write lane-sharded Parquet datasets."""

from beam_jobs import quiet
from loader import moved

quiet.install()  # Beam's import-time apitools notice (beam_jobs.quiet); imports no Beam
moved.install()  # old paths of moved modules (beam_jobs.sample_data), also before loader is imported
