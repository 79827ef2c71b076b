"""What best-fit piece origins (checkpoint version 2, issue 20) cost per sequence, in instructions.

    python bench/piece_origin_cost.py VARIANT SEQUENCES        # one run; VARIANT below
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=cg.VARIANT.N \\
        python bench/piece_origin_cost.py VARIANT N              # for N = 0 and N = 2000

Per sequence = (instructions of the N = 2000 run - those of the N = 0 run) / 2000: the lanes'
setup cancels out, and instruction counts do not depend on the other work of a shared machine.
Two lanes of ``bench/audit_replay.py``'s dataset (6000 documents of up to 300 words), best fit,
seq_len 512, 8 open bins, ``Lane.next_sequence`` in-process (the packer is most of in-process
best-fit replay: the loader's per-sequence CPU was 1.0-1.4x this loop's). Variants, each
``LaneTokenStream.take`` and ``BestFitPacker.next_sequence`` recompiled from today's source:

* ``origins``: as they are;
* ``no_origins``: without the lines that keep ``last_origin`` (pieces get None);
* ``chunk_copy``: also copying bin pieces into a frozen ``Chunk``, as before ``_Piece``.

Measured with valgrind 3.19 and CPython 3.11, instructions per sequence, three pairs of
runs (N = 2000, 2000, 6000): origins 390.0K / 391.8K / 400.9K against no_origins 388.9K /
389.0K / 397.8K, so the origins cost 1.1-3.1K (0.3-0.8%; the spread is the method's, the
same code recompiled moved by 1.4K); chunk_copy 412.6K / 412.8K (N = 2000): with origins,
best fit runs 5% fewer instructions than before the change.
"""

from __future__ import annotations

import inspect
import os
import pickle
import re
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SPEC = os.path.join(ROOT, "bench", "_work", "piece_origins", "spec.pkl")
VARIANTS = ("origins", "no_origins", "chunk_copy")
_NO_ORIGINS = [(r"\n\s*if not pieces:\n\s*self\.last_origin = \(self\.epoch, self\.block_index, offset\)", ""),
               (r"\n\s*self\.last_origin = \(self\.epoch, self\.block_index, offset\)", ""),
               (r"self\.stream\.last_origin if self\._has_origins else None", "None")]
_CHUNK_COPY = [(r"_Piece\((piece\.tokens\.copy\(\)), (piece\.doc_starts\.copy\(\)),[^\n]*\n\s*(\{.*?NO_FEATURES),\n\s*None\)",
                r"Chunk(tokens=\1, doc_starts=\2, features=\3)")]


def recompile(variant: str) -> None:
    import loader.io.lane_reader as lane_reader
    import loader.stages.packing as packing

    patterns = {"origins": [], "no_origins": _NO_ORIGINS, "chunk_copy": _NO_ORIGINS + _CHUNK_COPY}[variant]
    for module, cls, name in ((lane_reader, lane_reader.LaneTokenStream, "take"),
                              (packing, packing.BestFitPacker, "next_sequence")):
        source = textwrap.dedent(inspect.getsource(getattr(cls, name)))
        for pattern, replacement in patterns:
            source = re.sub(pattern, replacement, source)
        body = source.split('"""')[-1]
        if variant != "origins" and "origin" in body or variant == "chunk_copy" and "_Piece" in body:
            raise SystemExit(f"{name}: the {variant} variant no longer matches today's source; update the patterns")
        namespace = dict(vars(module))
        exec(source, namespace)  # noqa: S102 - today's own source, minus the lines measured
        setattr(cls, name, namespace[name])


def lane_spec():
    if not os.path.exists(SPEC):
        from bench.audit_replay import dataset
        from loader.samples import default_tokenizer_path
        from loader.config import LoaderConfig
        from loader.pipeline import ZephonLoader

        config = LoaderConfig(datasets=({"path": dataset()},), seq_len=512, global_batch_size=16, micro_batch_size=16,
                              seed=2, tokenizer=default_tokenizer_path(), packing="best_fit", best_fit_open_bins=8,
                              num_workers=0, read_ahead=False)
        os.makedirs(os.path.dirname(SPEC), exist_ok=True)
        with ZephonLoader(config) as loader, open(SPEC, "wb") as fh:
            pickle.dump(loader.spec, fh)
    with open(SPEC, "rb") as fh:  # made by this script: the lane spec, without importing torch
        return pickle.load(fh)


def main() -> None:
    variant, sequences = sys.argv[1], int(sys.argv[2])
    if variant not in VARIANTS:
        raise SystemExit(f"VARIANT must be one of {VARIANTS} (got {variant!r})")
    spec = lane_spec()
    recompile(variant)
    from loader.stages.producer import build_lanes

    lanes = build_lanes(spec, [0, 1], {})
    for k in range(64):  # blocks read, caches warm
        lanes[k % 2].next_sequence(k)
    start = time.process_time()
    for k in range(64, 64 + sequences):
        lanes[k % 2].next_sequence(k)
    cpu = time.process_time() - start
    print(f"{variant}: {sequences} sequences, {cpu / max(sequences, 1) * 1e6:.1f} us CPU/sequence")


if __name__ == "__main__":
    main()
