"""Reading input files into documents and rejections (the ``ReadFiles`` step).

One :class:`ReadDocumentsFn` call reads one whole input file, so reading is parallel across
files. Every record becomes exactly one of

* a document, ``(key, text, text_nbytes, kept_values)`` on the main output (a chat record,
  with ``--messages-field``, adds ``(input_ids bytes, loss_mask bytes)``: see
  :mod:`beam_jobs.chat_records`), or
* a rejection, ``(file_index, input_path, record_index, reason, detail, excerpt)`` on
  :data:`REJECTED_TAG`, with ``reason`` one of :data:`loader.io.manifest.REJECT_REASONS`.

Both are plain tuples on purpose: Beam's fast coder handles tuples of str/int/bytes/None
natively and would fall back to pickling for a dataclass.

Records by format
-----------------
Each format is a module of :mod:`beam_jobs.formats` that registers its reader, each kind of
record a converter that registers itself (:mod:`beam_jobs.records`); :func:`read_records`
looks both up.

* ``jsonl`` (:mod:`beam_jobs.formats.jsonl`): one JSON object per line, plain, gzip or zstd;
* ``parquet`` (:mod:`beam_jobs.formats.parquet`): one row per record;
* ``text`` (:mod:`beam_jobs.formats.text`): the whole file is one document;
* ``webdataset``: image jobs only, one sample per record (:mod:`beam_jobs.formats.webdataset`); an
  image job's JSONL/Parquet records are read as above and converted by
  :mod:`beam_jobs.image_records`, whose documents add ``(segments, images)``.

A UTF-8 byte-order mark at the very start of a ``jsonl`` or ``text`` file (after
decompression) is dropped; anywhere else it is data.

Unreadable files (one validation layer for every format)
--------------------------------------------------------
A file that cannot be opened or decoded part-way yields the records decoded before the
failure plus one ``unreadable_file`` rejection whose record index is the first record not
read and whose detail carries the error: the job cannot know how many records the rest
held, so it counts as one. "Decoded before the failure" is the same rule for every codec: a
record is kept only if all its bytes came out of the decoder intact, so the record cut in
half is never a document. The checks:

* gzip and zstd streams never end silently early (:mod:`beam_jobs.input_streams`); a
  compressed file whose data is corrupt rather than cut (a checksum, CRC or block error)
  is decoded once before parsing and keeps nothing, because those codecs check their
  checksum only after handing out the bytes, so the records before the damage may be
  altered;
* jsonl, any codec: a last line without ``\\n`` that is not whole JSON or UTF-8 means the
  file ends inside a record;
* parquet: the ``PAR1`` magic at the start (pyarrow checks only the end), a readable
  footer, page CRCs where the writer stored them, and the rows of every row group against
  the footer's count (a damaged page header can make a row group decode as zero rows).

A cut exactly between two gzip members or zstd frames, or right after a ``\\n`` of an
uncompressed file, leaves a valid, shorter file that no reader can tell from an intact one.
"""

from __future__ import annotations

from typing import Iterator, Optional

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.metrics import Metrics

# The built-in input formats and kinds of record: importing each registers it.
from beam_jobs import chat_image_records, image_records  # noqa: F401
from beam_jobs import progress
from beam_jobs.chat_records import ChatEncoder
from beam_jobs.formats import jsonl, parquet, text, webdataset  # noqa: F401
from beam_jobs.inputs import InputFile
from beam_jobs.records import (  # noqa: F401  (RecordConverter, RecordSpec, ...: also importable from here)
    EXCERPT_CHARS, UTF8_BOM, Document, RecordConverter, RecordSpec, Rejection, _encode_kept, _InvalidUtf8,
    _json_type_name, converter_for, excerpt_of, format_reader, key_of_id,
)

REJECTED_TAG = "rejected"


def read_records(input_file: InputFile, spec: RecordSpec,
                 chat_encoder: Optional[ChatEncoder] = None) -> Iterator[tuple[bool, tuple]]:
    """Every record of one file as ``(True, document)`` or ``(False, rejection)``: the file's
    format reader (:func:`~beam_jobs.records.register_format`) with the converter of the
    spec's kind of record (:func:`~beam_jobs.records.register_converter`)."""
    reader = format_reader(input_file, spec)
    return reader(input_file, converter_for(spec, input_file, chat_encoder))


class ReadDocumentsFn(beam.DoFn):
    """Input file tuple -> documents (main output) and rejections (:data:`REJECTED_TAG`)."""

    def __init__(self, spec: RecordSpec):
        self.spec = spec
        self.documents_counter = Metrics.counter("zephon.shard", "documents_read")
        self.rejected_counter = Metrics.counter("zephon.shard", "records_rejected")
        self.files_counter = Metrics.counter("zephon.shard", "files_read")
        self.chat_encoder: Optional[ChatEncoder] = None

    def setup(self) -> None:
        if self.spec.chat is not None:
            self.chat_encoder = ChatEncoder.load(self.spec.chat, self.spec.storage)

    def process(self, file_tuple: tuple) -> Iterator:
        input_file = InputFile.from_tuple(file_tuple)
        documents = rejected = 0
        for ok, element in read_records(input_file, self.spec, self.chat_encoder):
            if ok:
                documents += 1
                yield element
            else:
                rejected += 1
                yield pvalue.TaggedOutput(REJECTED_TAG, element)
        # Counted once per file: a per-element counter update costs more than the parse.
        self.documents_counter.inc(documents)
        self.rejected_counter.inc(rejected)
        self.files_counter.inc()
        progress.stage("ReadFiles").add(files=1, documents=documents, rejected=rejected)  # beam_jobs.progress
