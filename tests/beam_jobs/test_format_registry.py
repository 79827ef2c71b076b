"""The Beam job's input formats and record kinds come from their registries (beam_jobs.records)."""

from __future__ import annotations

import pytest

from beam_jobs import inputs, readers, records
from beam_jobs.chat_image_records import ChatImageRecordConverter
from beam_jobs.image_records import ImageRecordConverter, ImageSpec


def test_every_format_the_options_accept_has_a_registered_reader():
    # --format's choices (inputs.FORMATS) and the readers registered by beam_jobs/formats/ agree.
    assert sorted(records._FORMATS) == sorted(inputs.FORMATS)


@pytest.mark.parametrize("chat,images,expected", [
    (None, None, records.RecordConverter),
    (None, ImageSpec(), ImageRecordConverter),
    ("chat", ImageSpec(), ChatImageRecordConverter),
])
def test_the_converter_follows_the_kind_of_record(chat, images, expected):
    spec = records.RecordSpec(chat=chat, images=images)
    assert records._CONVERTERS[records.record_kind(spec)] is expected
    assert readers.RecordSpec is records.RecordSpec  # the old import path


def test_webdataset_is_read_only_by_image_jobs(tmp_path):
    path = tmp_path / "shard.tar"
    path.write_bytes(b"")
    input_file = inputs.InputFile(str(path), "shard.tar", 0, "webdataset", "none")
    with pytest.raises(ValueError, match="unknown input format 'webdataset'"):
        records.format_reader(input_file, records.RecordSpec())
    assert records.format_reader(input_file, records.RecordSpec(images=ImageSpec())).__name__ == "read_webdataset"


def test_a_format_is_registered_once():
    with pytest.raises(ValueError, match="input format 'jsonl' is registered twice"):
        records.register_format("jsonl")(lambda input_file, converter: iter(()))
