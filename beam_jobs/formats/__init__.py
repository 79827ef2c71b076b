"""Input formats of the sharding job, one module each; each registers its reader with
:func:`beam_jobs.records.register_format` when imported (:mod:`beam_jobs.readers` imports them all).

* :mod:`~beam_jobs.formats.jsonl`      one JSON object per line
* :mod:`~beam_jobs.formats.parquet`    one row per record
* :mod:`~beam_jobs.formats.text`       one document per file
* :mod:`~beam_jobs.formats.webdataset` tar shards of samples (image jobs)
"""
