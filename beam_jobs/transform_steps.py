"""``zephon shard --transform``: the loader's transforms applied in the Beam job, before lanes.

The ``Transform`` step runs right after ``ReadFiles`` on each valid document, with the same
:class:`loader.transforms.chain.TransformChain` the loader uses online (same functions, same
per-document seeds from ``--seed`` and the key, same determinism check), so a dataset
transformed offline gives the same batches as the untransformed dataset transformed online
(for the first epoch; see README "Transforms"). Everything after it (files per lane, lanes,
order, dedup) sees only the kept documents::

    documents -> Transform -+- kept documents (text and kept fields possibly changed)
                            +- counts: (transform position, "dropped" | "changed")
                                 -> CountTransformOutcomes -> manifest "transforms"

Only text transforms run offline (their documents are the records as read: key, text,
metadata of ``--keep-fields``): tokens do not exist before ``WriteLaneFiles``. A chat job's
conversations may be filtered but not rewritten (their encodings are made before).
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import apache_beam as beam

from loader.transforms.chain import TransformChain, TransformCounts
from loader.transforms.document import Document
from loader.transforms.spec import TransformSpec

COUNTS_TAG = "transform_counts"
OUTCOMES = ("dropped", "changed")


def _encode_kept(value) -> Optional[str]:
    from beam_jobs.readers import _encode_kept as encode

    return encode(value)


class TransformDocumentsFn(beam.DoFn):
    """Document tuple -> the transformed document (or nothing), plus tagged outcome counts."""

    def __init__(self, specs: Sequence[TransformSpec], *, seed: int, source: str, keep_fields: Sequence[str],
                 text_is_fixed: bool = False):
        self.specs = tuple(specs)
        self.seed = seed
        self.source = source
        self.keep_fields = tuple(keep_fields)
        self.text_is_fixed = text_is_fixed  # chat jobs: the text is a rendering of the conversation
        self.chain: Optional[TransformChain] = None

    def setup(self) -> None:
        # pretokenized=True makes the chain refuse text changes (chat: the conversation is the content).
        self.chain = TransformChain(self.specs, seed=self.seed, source=self.source, pretokenized=self.text_is_fixed)

    def process(self, document: tuple) -> Iterator:
        key, text, _text_nbytes, kept_values, *encoded = document
        counts = TransformCounts.zeros(len(self.specs))
        metadata = tuple(zip(self.keep_fields, kept_values))
        result = self.chain.apply(Document(key, text=text, metadata=metadata, seed_base=self.seed), counts)
        for position, (dropped, changed) in enumerate(counts.counts):
            if dropped:
                yield beam.pvalue.TaggedOutput(COUNTS_TAG, (position, "dropped"))
            if changed:
                yield beam.pvalue.TaggedOutput(COUNTS_TAG, (position, "changed"))
        if result is None:
            return
        if result.text is text and (not result.loaded("metadata") or result._metadata is metadata):
            yield document
            return
        new_text = result.text
        new_kept = kept_values
        if result.loaded("metadata") and result._metadata is not metadata:
            values = result.metadata
            new_kept = tuple(_encode_kept(values.get(name)) for name in self.keep_fields)
        yield (key, new_text, len(new_text.encode("utf-8")), new_kept, *encoded)


def transforms_report(specs: Sequence[TransformSpec], outcome_counts: dict) -> list[dict]:
    """The manifest's ``transforms`` entry: per transform, its spec and what it did."""
    report = []
    for position, spec in enumerate(specs):
        entry = spec.to_entry()
        entry.update(dropped=int(outcome_counts.get((position, "dropped"), 0)),
                     changed=int(outcome_counts.get((position, "changed"), 0)))
        report.append(entry)
    return report
