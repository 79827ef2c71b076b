"""I/O: manifests and lane files, local or remote, checked against what the manifest promises.

* :mod:`loader.io.storage`     paths and byte access: the facade over the storage backends
* :mod:`loader.io.backends`    the storage backend protocol and its registry by URL scheme
* :mod:`loader.io.local`       local paths
* :mod:`loader.io.gcs`         ``gs://``: Google Cloud Storage, pinned by generation
* :mod:`loader.io.s3`          ``s3://``: S3 and S3-compatible stores, pinned by version id or ETag
* :mod:`loader.io.cache`       a local, verified cache of remote lane files
* :mod:`loader.io.manifest`    the dataset manifest: the contract between the Beam job and the loader
* :mod:`loader.io.lane_reader` one lane of one source as a positional token stream
"""
