"""I/O: manifests and lane files, local or ``gs://``, checked against what the manifest promises.

* :mod:`loader.io.storage`     paths and byte access for local directories and ``gs://`` buckets
* :mod:`loader.io.gcs`         Google Cloud Storage reads with retries
* :mod:`loader.io.cache`       a local, verified cache of remote lane files
* :mod:`loader.io.manifest`    the dataset manifest: the contract between the Beam job and the loader
* :mod:`loader.io.lane_reader` one lane of one source as a positional token stream
"""
