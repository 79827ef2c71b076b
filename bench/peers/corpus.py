"""The benchmark corpus: two text sources generated from a fixed seed, tokenized once.

Source ``web`` (A) is lowercase English-like text, source ``caps`` (B) the same kind of text
in capitals. Document i of both sources is built for the same target token count, so the
two sources have the same length distribution and a document-level weight is a token-level
weight. Their word tokens are disjoint, which lets :class:`common.ShareMeter` recover each
batch's source mix from the delivered token ids alone, for every loader alike.

Written under ``<data_dir>/corpus``:

    web/part-0000.jsonl ...   {"id": "web-00000001", "text": "..."}      (input of every format)
    flat/web.tokens.npy       int32 ids of all documents, concatenated (no EOS)
    flat/web.offsets.npy      int64 document boundaries, len = docs + 1
    parquet/web/text-0000.parquet, parquet/web/ids-0000.parquet
    info.json                 tokenizer path, EOS id, counts, share tables

The generator is ``random.Random(seed)`` (its stream is stable across Python versions).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from typing import Optional

import numpy as np

from bench.peers.common import SOURCES, Layout

_WORDS = (
    "the of and to in is was for on that with as by at from his her an which are be this had "
    "not but were they have one their all been has there who more when will would after two "
    "first new other time year years also into some its only many most people state during "
    "over such city between these world under about him where while through later known then "
    "three well since part made both before national school used area may university river "
    "family season age found music team early including series life government around work "
    "each city war north south east west long being second back same due small great around "
    "number high century country found within population game public days film band album "
    "house water light power early history station company church village following played "
    "named became called several based general local near major member group system order "
    "record development support building english french german island language county common "
    "british american district court named line field level point market health design road"
).split()


def _word_tokens(tokenizer, words: list[str]) -> list[int]:
    return [len(tokenizer.encode(" " + w, add_special_tokens=False).ids) for w in words]


def _doc_lengths(rng: random.Random, n: int) -> list[int]:
    # log-normal token lengths, median ~200, clipped to [16, 4096]
    return [int(min(4096, max(16, math.exp(rng.gauss(5.3, 0.8))))) for _ in range(n)]


def _make_text(rng: random.Random, words: list[str], costs: list[int], target: int) -> str:
    out: list[str] = []
    total = 0
    since_stop = 0
    n = len(words)
    while total < target:
        i = rng.randrange(n)
        out.append(words[i])
        total += costs[i]
        since_stop += 1
        if since_stop >= 8 and rng.random() < 0.15:
            out[-1] += "." if rng.random() < 0.8 else ","
            since_stop = 0
            if rng.random() < 0.1:
                out[-1] += "\n"
    return " ".join(out)


def make_corpus(data_dir: str, *, num_docs: int, tokenizer_path: str, seed: int = 0,
                files_per_source: int = 4, sources: tuple[str, ...] = SOURCES) -> dict:
    """Generate, tokenize and lay out the corpus; returns (and writes) info.json.

    ``sources``: ``("web",)`` for runs without the mix (half the work on a large corpus);
    the share tables then cover ``web`` only. Texts are tokenized in chunks so that a large
    corpus is never held as Python lists of ids all at once."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    layout = Layout(data_dir)
    t0 = time.perf_counter()
    tok = Tokenizer.from_file(tokenizer_path)
    eos = None
    for cand in ("<|endoftext|>", "</s>", "<eos>"):
        eos = tok.token_to_id(cand)
        if eos is not None:
            break
    if eos is None:
        raise ValueError(f"{tokenizer_path}: no EOS token among <|endoftext|>, </s>, <eos>")
    words = {"web": list(_WORDS), "caps": [w.upper() for w in _WORDS]}
    costs = {s: _word_tokens(tok, words[s]) for s in SOURCES}
    lengths = _doc_lengths(random.Random(seed), num_docs)
    info: dict = {"seed": seed, "num_docs_per_source": num_docs, "tokenizer": os.path.abspath(tokenizer_path),
                  "eos_id": int(eos), "vocab_size": tok.get_vocab_size(), "sources": {}}
    seen: dict[str, np.ndarray] = {}
    unknown = set(sources) - set(SOURCES)
    if unknown or not sources or sources[0] != "web":
        raise ValueError(f"sources must start with 'web' and be among {SOURCES} (got {sources=})")
    info["files_per_source"] = files_per_source
    for si, source in enumerate(sources):
        rng = random.Random(f"{seed}:{source}")
        texts = [_make_text(rng, words[source], costs[source], n) for n in lengths]
        ids = []
        for lo in range(0, len(texts), 8192):
            ids += [np.asarray(e.ids, dtype=np.int32)
                    for e in tok.encode_batch_fast(texts[lo:lo + 8192], add_special_tokens=False)]
        counts = np.array([len(x) for x in ids], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)
        os.makedirs(os.path.dirname(layout.flat(source)), exist_ok=True)
        np.save(layout.flat(source) + ".tokens.npy", flat)
        np.save(layout.flat(source) + ".offsets.npy", offsets)
        jdir = layout.source_jsonl_dir(source)
        pdir = os.path.join(layout.corpus, "parquet", source)
        os.makedirs(jdir, exist_ok=True)
        os.makedirs(pdir, exist_ok=True)
        per = math.ceil(num_docs / files_per_source)
        for f in range(files_per_source):
            lo, hi = f * per, min(num_docs, (f + 1) * per)
            keys = [f"{source}-{i:08d}" for i in range(lo, hi)]
            with open(os.path.join(jdir, f"part-{f:04d}.jsonl"), "w") as fh:
                for k, t in zip(keys, texts[lo:hi]):
                    fh.write(json.dumps({"id": k, "text": t}) + "\n")
            pq.write_table(pa.table({"id": keys, "text": texts[lo:hi]}),
                           os.path.join(pdir, f"text-{f:04d}.parquet"), row_group_size=1024)
            pq.write_table(
                pa.table({"id": keys, "input_ids": pa.array([x.tolist() for x in ids[lo:hi]],
                                                              type=pa.list_(pa.int32()))}),
                os.path.join(pdir, f"ids-{f:04d}.parquet"), row_group_size=1024)
        seen[source] = np.bincount(flat, minlength=tok.get_vocab_size())
        info["sources"][source] = {"docs": num_docs, "tokens": int(offsets[-1]),
                                   "text_bytes": int(sum(len(t.encode()) for t in texts)),
                                   "mean_doc_tokens": float(counts.mean())}
    a = seen["web"]
    b = seen.get("caps", np.zeros_like(a))
    a_ids = np.flatnonzero((a > 0) & (b == 0))
    b_ids = np.flatnonzero((b > 0) & (a == 0))
    info["share"] = {
        "vocab_size": tok.get_vocab_size(),
        "a_ids": a_ids.tolist(), "b_ids": b_ids.tolist(),
        # EOS is shared, so coverage is over tokens incl. one EOS per document
        "a_coverage": float(a[a_ids].sum() / (a.sum() + num_docs)),
        "b_coverage": float(b[b_ids].sum() / (b.sum() + num_docs)),
    }
    info["seconds"] = round(time.perf_counter() - t0, 2)
    with open(layout.info_path, "w") as fh:
        json.dump(info, fh)
    return info


def default_tokenizer() -> str:
    """The shipped tokenizer (loader.samples.default_tokenizer_path), if present."""
    try:
        from loader.samples import default_tokenizer_path

        path = default_tokenizer_path()
        if os.path.exists(path):
            return path
    except Exception:  # noqa: BLE001 - the module may be mid-edit by another engineer
        pass
    raise FileNotFoundError("beam_jobs/assets/tokenizer.json not found; pass --tokenizer")


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("data_dir")
    p.add_argument("--num-docs", type=int, required=True)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--files-per-source", type=int, default=4)
    p.add_argument("--sources", default=",".join(SOURCES), help="comma-separated, 'web' first")
    a = p.parse_args(argv)
    info = make_corpus(a.data_dir, num_docs=a.num_docs, tokenizer_path=a.tokenizer or default_tokenizer(), seed=a.seed,
                       files_per_source=a.files_per_source, sources=tuple(a.sources.split(",")))
    print(json.dumps({k: v for k, v in info.items() if k != "share"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
