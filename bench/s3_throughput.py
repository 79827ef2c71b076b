"""Tokens/s through the loader from s3:// (a moto S3 server) against local disk, in one run.

    python bench/s3_throughput.py [--repeats 3] [--loader-mtokens 6] [--clients]

The s3:// twin of ``bench/gcs_throughput.py --only loader``, on its shared harness
(:func:`bench.gcs_throughput.time_callable`, the same generated pre-tokenized dataset, the same
loader config: ``num_workers=0``, W=1, concat packing). The dataset is written locally and
uploaded object by object (manifest last) to moto's S3 server, started as its own process
(``python -m moto.server``) on 127.0.0.1 so the server does not share the loader's GIL. Setups:

* ``loader_local``         the dataset on local disk (page cache)
* ``loader_s3_nocache``    ``cache_dir`` unset: files over 4 MiB through ``RangedReader``
  (8 MiB windows, each GET pinned by ``If-Match``)
* ``loader_s3_cold``       ``cache_dir`` emptied before each repeat
* ``loader_s3_warm``       ``cache_dir`` filled by the cold runs (sha256 of each copy on open)
* ``loader_s3_warm_nosha`` the same with ``verify_checksums=False``

Repeats go round-robin over the setups; medians, with each setup's fastest and slowest run,
and ratios to ``loader_local``. moto is a Python (werkzeug) server: the s3:// numbers measure
boto3 plus that server on loopback, a floor rather than a forecast for AWS or MinIO.

``--clients`` adds a client-level comparison: the bytes of every lane file fetched in ranged
GETs of 1 MiB (about a row group: what an uncached loader asks for) and 8 MiB (the read-ahead
window; whole objects here) by boto3 (the backend's own pinned ``S3Object.fetch``) and, when
it is installed, by ``obstore`` (Rust ``object_store``, also with ``if_match``), against the
same server.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.gcs_throughput import (  # noqa: E402
    add_loader_args,
    build_pretokenized_dataset,
    describe_loader_run,
    loader_config,
    loader_steps,
    loader_tokens,
    print_round_robin,
    serving,
    start_local_server,
)
from loader.io import s3, storage  # noqa: E402
from loader.io.retries import RetryPolicy  # noqa: E402
from loader.io.storage import StorageOptions  # noqa: E402

BUCKET = "zephon-bench"
CLIENT_WINDOWS = (1024**2, 8 * 1024**2)


def start_moto() -> tuple[subprocess.Popen, str]:
    return start_local_server(lambda port: [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              "/moto-api/", "moto.server (pip install 'moto[server]')")


def upload(local_dir: str, remote_dir: str, manifest) -> None:
    for entry in manifest.files:
        with open(os.path.join(local_dir, entry.path), "rb") as fh:
            storage.write_atomically(storage.join(remote_dir, entry.path), fh.read())
    with open(os.path.join(local_dir, "manifest.json"), "rb") as fh:  # last, as the Beam job does
        storage.write_atomically(storage.join(remote_dir, "manifest.json"), fh.read())


def run_loader_bench(work: str, args) -> None:
    local_dir, remote_dir = os.path.join(work, "loader-local"), f"s3://{BUCKET}/loader"
    manifest, total = build_pretokenized_dataset(local_dir, int(args.loader_mtokens * 1e6), args.loader_lanes)
    upload(local_dir, remote_dir, manifest)
    steps = loader_steps(manifest, args)
    print(describe_loader_run(manifest, total, steps, args))
    cache_dir = os.path.join(work, "loader-cache")
    size = dict(seq_len=args.seq_len, global_batch=args.global_batch)
    local_cfg = loader_config(local_dir, **size)
    setups = [
        ("loader_local", local_cfg, lambda: None),
        ("loader_s3_nocache", loader_config(remote_dir, **size), lambda: None),
        ("loader_s3_cold", loader_config(remote_dir, cache_dir=cache_dir, **size),
         lambda: shutil.rmtree(cache_dir, ignore_errors=True)),
        ("loader_s3_warm", loader_config(remote_dir, cache_dir=cache_dir, **size), lambda: None),
        ("loader_s3_warm_nosha", loader_config(remote_dir, cache_dir=cache_dir, verify_checksums=False, **size),
         lambda: None),
    ]
    loader_tokens(local_cfg, min(steps, 2))  # warm-up: imports, tokenizer, pyarrow pools, page cache
    loader_tokens(setups[1][1], min(steps, 2))  # and boto3's client, credentials, connection pool
    print_round_robin([(label, functools.partial(loader_tokens, config, steps), setup)
                       for label, config, setup in setups], args.repeats)
    if args.clients:
        run_client_bench(remote_dir, manifest, args.repeats)


def run_client_bench(remote_dir: str, manifest, repeats: int) -> None:
    """Every lane file in ranged GETs: boto3 (the backend) and obstore, if installed."""
    options = StorageOptions()
    policy = RetryPolicy.from_options(options)
    urls = [storage.join(remote_dir, e.path) for e in manifest.files]
    sizes = [e.bytes for e in manifest.files]

    def with_boto3(window: int) -> dict[str, float]:
        moved = 0
        for url in urls:
            obj = s3.S3Backend().open_input(url, options).obj  # HEAD: the pin
            for start in range(0, obj.size, window):
                moved += len(obj.fetch(start, min(obj.size, start + window), policy))
        return {"bytes": float(moved)}

    clients = [("boto3", with_boto3)]
    try:
        import obstore  # optional: only for this comparison, never a dependency
        from obstore.store import S3Store
    except ImportError:
        print("obstore not installed: pip install obstore to compare it")
    else:
        store = S3Store(BUCKET, endpoint=os.environ["AWS_ENDPOINT_URL"], region=os.environ["AWS_DEFAULT_REGION"],
                        client_options={"allow_http": True})
        keys = [url.split("/", 3)[3] for url in urls]

        def with_obstore(window: int) -> dict[str, float]:
            moved = 0
            for key, size in zip(keys, sizes):
                etag = obstore.head(store, key)["e_tag"]
                for start in range(0, size, window):
                    moved += len(obstore.get(store, key, options={
                        "range": (start, min(size, start + window)), "if_match": etag}).bytes())
            return {"bytes": float(moved)}

        clients.append(("obstore", with_obstore))
    print(f"\nclients: {len(urls)} lane files, {sum(sizes) / 1e6:.1f} MB in ranged GETs (If-Match); "
          f"median of {repeats}, round-robin")
    for window in CLIENT_WINDOWS:
        print_round_robin([(f"{name}_{window >> 20}MiB", functools.partial(fn, window), lambda: None)
                           for name, fn in clients], repeats, seconds_format=".3f")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_loader_args(parser)
    parser.add_argument("--clients", action="store_true", help="also compare boto3 and obstore ranged GETs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    def credentials(endpoint: str) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                "AWS_DEFAULT_REGION": "us-east-1"}

    with serving(start_moto, credentials, "zephon-s3-bench-") as work:
        options = StorageOptions()
        s3.client(options, RetryPolicy.from_options(options)).create_bucket(Bucket=BUCKET)
        run_loader_bench(work, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
