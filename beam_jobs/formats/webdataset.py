"""WebDataset tar shards as input of the sharding job (``--format webdataset``, or a ``.tar`` name).

A shard is a tar file read as a stream (local or remote, through :mod:`beam_jobs.job_files`);
consecutive members with the same *sample key* form one sample, as in WebDataset: a member
``dir/000123.0.jpg`` has key ``dir/000123`` and extension ``0.jpg`` (everything after the
first dot of the file name, lower-cased). Directories and other non-file members are
skipped. Each sample is one record (its record index is the sample's 0-based position in the
shard, so its key without ``--id-field`` is ``<shard path>#<index>``):

* text: the ``.txt`` member (UTF-8), else the ``--text-field`` value of the ``.json`` member;
* ``.json``: an object whose fields serve ``--id-field``, ``--keep-fields`` and an interleaved
  layout: with ``--image-field F``, ``json[F]`` (a list naming members, e.g. ``"0.jpg"``)
  and ``json[--text-field]`` (a list of the same length) interleave as in
  :mod:`beam_jobs.image_records`;
* otherwise the sample's one image member (extension ``jpg``, ``jpeg``, ``png`` or ``webp``,
  possibly after a prefix such as ``0.``) and its text make an image-caption pair. A sample
  with no image member is ``missing_image_field``; one with several and no ``.json`` order is
  ``invalid_image_field`` (their order would be a guess).

A shard that cannot be read to its end (cut inside a member or a header, a damaged header,
no end-of-archive block) yields the samples before the failure plus one ``unreadable_file``
rejection, like every input format (:mod:`beam_jobs.readers`); the sample being read when it
failed is never a document. A shard must end with tar's all-zero end-of-archive block (every
tar writer writes it), so a cut even at a member boundary is found.

An image member whose tar header gives a size above ``--max-image-mb`` is never read into
memory (the stream skips it block by block): its sample is an ``image_too_large`` reject and
the samples after it are read as usual.
"""

from __future__ import annotations

import json
import tarfile
from typing import Iterator, Optional, Union

from beam_jobs import job_files
from beam_jobs.image_records import ImageRecordConverter, _MISSING, _Reject
from beam_jobs.inputs import InputFile
from beam_jobs.records import _guarded, _ReadFailure, _unreadable, register_format

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
Sample = tuple  # (sample key, {extension: bytes or OversizeMember}) in member order


class OversizeMember:
    """An image member left unread: its header's size is above the image limit."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size


def split_member_name(name: str) -> tuple[str, str]:
    """``(sample key, extension)`` of a member name, WebDataset's rule (module docstring)."""
    directory, _, base = name.rpartition("/")
    stem, dot, extension = base.partition(".")
    key = f"{directory}/{stem}" if directory else stem
    return key, extension.lower() if dot else ""


class _StrictTarInfo(tarfile.TarInfo):
    """A header reader that makes a cut or damaged header an error.

    ``tarfile`` ends the archive silently at a header it cannot read past the first one (0
    bytes left, a partial block, a bad checksum), which would drop the rest of a damaged
    shard without a trace; only the all-zero end-of-archive block ends it here.
    """

    @classmethod
    def fromtarfile(cls, archive):
        try:
            return super().fromtarfile(archive)
        except tarfile.EOFHeaderError:
            raise  # the end-of-archive marker: a whole shard
        except (tarfile.EmptyHeaderError, tarfile.TruncatedHeaderError, tarfile.InvalidHeaderError) as exc:
            raise tarfile.ReadError(f"no readable tar header at byte {archive.offset} ({exc}): the shard is cut "
                                    "or damaged (a whole tar ends with its all-zero end-of-archive block)") from None


def iter_samples(stream, max_image_bytes: Optional[int] = None) -> Iterator[Sample]:
    """The samples of a tar stream, in member order; raises on a damaged or cut shard. An image
    member above ``max_image_bytes`` (by its header) is an :class:`OversizeMember`, unread."""
    key, members = None, {}
    with tarfile.open(fileobj=stream, mode="r|", tarinfo=_StrictTarInfo) as archive:
        for member in archive:
            if not member.isfile():
                continue
            member_key, extension = split_member_name(member.name)
            if key is not None and member_key != key:
                yield key, members
                members = {}
            key = member_key
            if max_image_bytes is not None and _is_image_member(extension) and member.size > max_image_bytes:
                members[extension] = OversizeMember(member.size)  # tarfile skips its data on the next member
                continue
            handle = archive.extractfile(member)
            members[extension] = handle.read() if handle is not None else b""
    if key is not None:
        yield key, members


def _is_image_member(extension: str) -> bool:
    return extension.rsplit(".", 1)[-1] in IMAGE_EXTENSIONS


def _member_source(key: str, members: dict, max_image_bytes: Optional[int]):
    def read_member(name: str) -> bytes:
        candidates = (name.lower(), split_member_name(name)[1] if name.startswith(key + ".") else None)
        for candidate in candidates:
            if candidate is not None and candidate in members:
                value = members[candidate]
                if isinstance(value, OversizeMember):
                    raise _Reject("image_too_large", f"member {key}.{candidate}: {value.size} bytes by its tar header, "
                                  f"above the limit of {max_image_bytes} (--max-image-mb); not read")
                return value
        raise _Reject("image_missing", f"sample {key!r} has no member {name!r} (members: {', '.join(sorted(members))})")

    return read_member


def sample_record(key: str, members: dict[str, bytes], converter: ImageRecordConverter) -> tuple[dict, object, bytes]:
    """``(record fields, image value, raw excerpt)`` of a sample, or raises ``_Reject``."""
    spec = converter.spec
    record: dict = {}
    raw = members.get("json") or members.get("txt") or key.encode("utf-8")
    if "json" in members:
        try:
            parsed = json.loads(members["json"].decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise _Reject("invalid_utf8", f"member {key}.json: byte {exc.start}: {exc.reason}") from None
        except ValueError as exc:
            raise _Reject("malformed_json", f"member {key}.json: {exc}") from None
        if not isinstance(parsed, dict):
            raise _Reject("malformed_json", f"member {key}.json must hold a JSON object")
        record.update(parsed)
    if "txt" in members:
        try:
            record[spec.text_field] = members["txt"].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _Reject("invalid_utf8", f"member {key}.txt: byte {exc.start}: {exc.reason}") from None
    image_field = converter.images.image_field
    if image_field is not None and image_field in record:
        return record, record[image_field], raw
    images = [extension for extension in members if _is_image_member(extension)]
    if not images:
        raise _Reject("missing_image_field", f"sample {key!r} has no {'/'.join(IMAGE_EXTENSIONS)} member "
                      f"(members: {', '.join(sorted(members)) or 'none'})")
    if len(images) > 1:
        raise _Reject("invalid_image_field", f"sample {key!r} has {len(images)} image members "
                      f"({', '.join(images)}) and no order for them; list them in the .json's --image-field")
    return record, images[0], raw


@register_format("webdataset", images_only=True)
def read_webdataset(input_file: InputFile, converter: ImageRecordConverter) -> Iterator[tuple[bool, tuple]]:
    """Every sample of one shard as ``(True, document)`` or ``(False, rejection)``."""
    def samples() -> Iterator[Sample]:
        with job_files.open_read(input_file.path, converter.spec.storage) as handle:
            yield from iter_samples(handle, max_image_bytes)

    max_image_bytes = converter.images.limits.max_bytes
    record_index = -1
    for item in _guarded(samples()):
        if isinstance(item, _ReadFailure):
            yield False, _unreadable(converter, record_index + 1, item.error)
            return
        record_index += 1
        key, members = item
        raw: Union[bytes, str] = key
        try:
            record, image_value, raw = sample_record(key, members, converter)
        except _Reject as rejected:
            yield False, converter.reject(record_index, rejected.reason, rejected.detail, raw)
            continue
        yield converter.convert_parts(record, record_index, raw, image_value if image_value is not None else _MISSING,
                                      _member_source(key, members, max_image_bytes))
