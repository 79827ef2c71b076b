"""What ``zephon audit`` costs where it must replay (issue 20): documents/s on lengths, CPU time.

    python bench/audit_replay.py [--steps 400] [--repeats 3]

Data: ``tests.dataset_factory.synthetic_texts(6000, seed=3, max_words=300)`` pre-tokenized
into 2 lanes, row groups of 256 documents (cached under ``bench/_work/audit_replay/``);
seq_len 512, B = 16, best_fit_open_bins 8. For each method the audit of one sequence
(``--sequence 0``: one lane replayed) is run at step 10 and at ``--steps``, and the documents
the lane took between the two are divided by the CPU time between them (so the loader's setup
and the step's own report cancel out). Methods:

* ``best_fit``: the integer replay (``loader.commands.audit_replay``, what the audit uses);
* ``best_fit_lane``: the per-sequence replay through the audit's lane (what it used before);
* ``concat``: a concat lane forced to replay (it seeks; for scale).

Then ``--seek-index`` (best fit, one sequence): CPU seconds of the audit of step ``--steps + 5``
without an index, of step ``--steps`` with a fresh one (the replay from 0, keeping its points),
and of step ``--steps + 5`` from that index.

Medians of ``--repeats`` runs; CPU time (``time.process_time``), as the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DATA = os.path.join(ROOT, "bench", "_work", "audit_replay", "data")


def dataset() -> str:
    if not os.path.exists(os.path.join(DATA, "manifest.json")):
        from loader.samples import default_tokenizer_path
        from loader.stages.tokenizer import load_tokenizer
        from tests.dataset_factory import synthetic_texts, write_dataset

        write_dataset(DATA, synthetic_texts(6000, seed=3, max_words=300), num_lanes=2, seed=1,
                      tokenizer=load_tokenizer(default_tokenizer_path()), row_group_rows=256)
    return DATA


def measure(method: str, steps: int) -> tuple[int, float]:
    """(documents, CPU seconds) the replay of one lane takes from step 10 to ``steps``."""
    from loader.samples import default_tokenizer_path
    from loader.commands import audit, audit_replay
    from loader.config import LoaderConfig
    from loader.io.provenance import ProvenanceStream

    counted = [0]
    take, take_rows = ProvenanceStream.take, ProvenanceStream.take_rows
    lengths_taken = audit_replay._Cursor.take

    def counting(original):
        def wrapped(self, *args, **kwargs):
            chunk = original(self, *args, **kwargs)
            if chunk is not None:
                counted[0] += len(chunk.doc_starts)
            return chunk
        return wrapped

    def counting_cursor(self, n):
        piece = lengths_taken(self, n)
        if piece is not None and piece[2]:
            counted[0] += 1
        return piece

    patches = [(ProvenanceStream, "take", counting(take)), (ProvenanceStream, "take_rows", counting(take_rows)),
               (audit_replay._Cursor, "take", counting_cursor)]
    if method == "best_fit_lane":
        patches.append((audit_replay, "replayed_lane_state", lambda *args, **kwargs: None))
    if method == "concat":
        patches.append((audit, "choose_method", lambda *args: "replay"))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        config = LoaderConfig(datasets=({"path": dataset()},), seq_len=512, global_batch_size=16, micro_batch_size=16,
                              seed=2, tokenizer=default_tokenizer_path(), num_workers=0, best_fit_open_bins=8,
                              packing="concat" if method == "concat" else "best_fit")
        audit.audit_step(config, 1, sequence=0)  # imports and first-use caches, outside the measure
        results = []
        for step in (10, steps):
            counted[0] = 0
            start = time.process_time()
            audit.audit_step(config, step, sequence=0)
            results.append((counted[0], time.process_time() - start))
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
    (d0, t0), (d1, t1) = results
    return d1 - d0, t1 - t0


def measure_seek_index(steps: int) -> tuple[float, float, float]:
    """CPU seconds: (no index at steps + 5, fresh index at steps, from the index at steps + 5)."""
    import tempfile

    from loader.samples import default_tokenizer_path
    from loader.commands import audit
    from loader.config import LoaderConfig

    config = LoaderConfig(datasets=({"path": dataset()},), seq_len=512, global_batch_size=16, micro_batch_size=16,
                          seed=2, tokenizer=default_tokenizer_path(), num_workers=0, best_fit_open_bins=8,
                          packing="best_fit")
    audit.audit_step(config, 1, sequence=0)  # imports and first-use caches, outside the measure
    seconds = []
    with tempfile.TemporaryDirectory() as index:
        for step, kept in ((steps + 5, None), (steps, index), (steps + 5, index)):
            start = time.process_time()
            audit.audit_step(config, step, sequence=0, seek_index=kept)
            seconds.append(time.process_time() - start)
    return tuple(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dataset()
    for method in ("best_fit", "best_fit_lane", "concat"):
        runs = [measure(method, args.steps) for _ in range(args.repeats)]
        documents = runs[0][0]
        rate = statistics.median(d / t for d, t in runs)
        print(f"{method:14s} {documents} documents (steps 10 -> {args.steps}, one lane): "
              f"{rate:,.0f} documents/s CPU (runs: {', '.join(f'{d / t:,.0f}' for d, t in runs)})")
    runs = [measure_seek_index(args.steps) for _ in range(args.repeats)]
    plain, fresh, seeked = (statistics.median(r[i] for r in runs) for i in range(3))
    print(f"--seek-index   step {args.steps + 5} without an index {plain:.3f} s CPU; step {args.steps} with a fresh "
          f"index {fresh:.3f} s; step {args.steps + 5} from it {seeked:.3f} s ({plain / seeked:.0f}x less)")


if __name__ == "__main__":
    main()
