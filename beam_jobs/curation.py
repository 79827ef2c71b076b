"""The curation steps of the sharding job: ``--transform`` then ``--dedup``, between reading and lanes.

::

    documents -> Transform (beam_jobs.transform_steps) -> DedupExact (beam_jobs.dedup) -> documents
                      |                                       |
                      +-- outcome counts --+-- removed, groups, list files
                                           v
                                   CurationReport (one dict, a side input of CommitManifest)

With ``--transform`` every document leaves Transform with a last element ``(dropped_by, layout
text bytes)`` and a dropped one stays as a tombstone (:mod:`beam_jobs.transform_steps`);
``DedupExact`` sees the live documents only. The report is the manifest's ``transforms`` list (each transform's spec with its ``dropped``
and ``changed`` counts) and ``dedup`` entry (mode, normalisation, ``removed``,
``duplicate_groups``, where the list is), kept apart from ``rejected``: every input record is
either a document, a rejection, dropped by a transform or removed as a duplicate.
Without either option the job's graph is unchanged.
"""

from __future__ import annotations

from typing import Optional, Sequence

import apache_beam as beam
from apache_beam.pvalue import AsDict, AsList, AsSingleton

from beam_jobs.dedup import DedupExact, dedup_report
from beam_jobs.transform_steps import COUNTS_TAG, TransformDocumentsFn, is_live, transforms_report
from loader.io.storage_options import StorageOptions
from loader.transforms.spec import TransformSpec


def _report(_: None, outcome_counts: Optional[dict], specs: Sequence[TransformSpec], removed: Optional[int],
            groups: Optional[int], list_files: Optional[list]) -> dict:
    del list_files  # a side input only so that the report waits for the list files
    report: dict = {}
    if specs:
        report["transforms"] = transforms_report(specs, outcome_counts or {})
    if removed is not None:
        report["dedup"] = dedup_report(removed, groups or 0)
    return report


class CurateDocuments(beam.PTransform):
    """documents -> ``(curated documents, report)``; ``report`` holds one dict (see the module docstring)."""

    def __init__(self, specs: Sequence[TransformSpec], dedup: Optional[str], *, seed: int, source: str,
                 keep_fields: Sequence[str], output: str, text_is_fixed: bool = False,
                 storage_options: StorageOptions = StorageOptions(), label=None):
        super().__init__(label)
        self.specs = tuple(specs)  # every --transform (the report's); the text-stage ones run here
        self.dedup = dedup
        self.seed, self.source, self.keep_fields = seed, source, tuple(keep_fields)
        self.output = output
        self.text_is_fixed = text_is_fixed
        self.storage_options = storage_options  # the _dedup/ list is written with them

    def expand(self, documents):
        side_inputs: dict = {"outcome_counts": None, "removed": None, "groups": None, "list_files": None}
        tombstones = None
        if self.specs:
            text_specs = tuple(spec for spec in self.specs if spec.stage == "text")  # the tokens ones: WriteLaneFiles
            transformed = documents | "Transform" >> beam.ParDo(TransformDocumentsFn(
                text_specs, seed=self.seed, source=self.source, keep_fields=self.keep_fields,
                text_is_fixed=self.text_is_fixed)).with_outputs(COUNTS_TAG, main="documents")
            documents = transformed.documents
            side_inputs["outcome_counts"] = AsDict(
                transformed[COUNTS_TAG] | "CountTransformOutcomes" >> beam.combiners.Count.PerElement())
            if self.dedup:  # tombstones are no text to compare: they pass the dedup untouched
                documents, tombstones = documents | "SplitTombstones" >> beam.Partition(
                    lambda document, _: 0 if is_live(document) else 1, 2)
        if self.dedup == "exact":
            documents, removed, groups, list_files = documents | "DedupExact" >> DedupExact(self.output, storage_options=self.storage_options)
            side_inputs.update(removed=AsSingleton(removed), groups=AsSingleton(groups), list_files=AsList(list_files))
        if tombstones is not None:
            documents = (documents, tombstones) | "RejoinTombstones" >> beam.Flatten()
        report = (
            documents.pipeline
            | "CurationStart" >> beam.Create([None])
            | "CurationReport" >> beam.Map(_report, specs=self.specs, **side_inputs)
        )
        return documents, report
