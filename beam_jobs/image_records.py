"""Image documents in the sharding job: image-caption pairs and interleaved text/image documents.

An image job (``--image-field``, or WebDataset ``.tar`` input) turns each record into a
document whose images are checked (:func:`loader.vision.images.inspect_image`) and stored as
given, never re-encoded::

    record --document_parts--> [text | image reference, ...] in order
           --resolve + inspect each image--> bytes, format, width, height, SHA-256
                                             (+ visual tokens with --image-policy)
           --encode_segments--> document (key, text, content bytes, kept values, (segments, images))
      | any bad image / field  --> the whole document is a rejection with the image reason

Record shapes (the same for JSONL, Parquet and a WebDataset sample's ``.json``):

=====================================  ==================================================
``--image-field`` value                document
=====================================  ==================================================
one image, text a string               an image-caption pair: ``[image, text]``
a list of images, text a string        ``[image 0, image 1, ..., text]``
a list, text a list of equal length    interleaved (the OBELICS layout): position ``i``
                                       holds an image or a text (exactly one not null),
                                       in that order
=====================================  ==================================================

An image reference is bytes (Parquet ``binary``), a ``{"bytes": ..., "path": ...}`` struct
(the Hugging Face ``Image`` feature; ``path`` is read when ``bytes`` is null) or a string: a
path (JSONL, Parquet), resolved against ``--image-root`` or else the input file's directory
(``gs://`` / ``s3://`` URLs and absolute paths are used as given, URLs read through
:mod:`loader.io.storage`), or, in a WebDataset sample, the name of a member (``"jpg"``,
``"0.png"`` or the full member name).

The document's ``text`` is its text segments concatenated; where the images stand is the
``segments`` list (:mod:`loader.vision.segments`). The third element of an image document,
which sizes the lane files (``--target-file-mb``) and row groups, counts the text bytes plus
the encoded image bytes, so image bytes are what bounds a file and a row group.

Paths are confined (docs/guides/what-is-checked.md): a relative path may not climb out of its
root (``../`` past it: an ``image_unreadable`` reject naming the path, nothing read); only a
path the record writes as absolute (or a URL) is used as given. A local image must be a
regular file (a FIFO or device is refused without being opened for a blocking read) and is
read at most ``--max-image-mb`` + 1 bytes, so a file that grows is refused too. A reject's
detail never quotes the file's bytes.
"""

from __future__ import annotations

import argparse
import io
import os
import posixpath
import stat
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence, Union

from beam_jobs.image_lanes import IMAGE_COLUMNS
from beam_jobs.inputs import InputFile
from beam_jobs.records import IMAGE_RECORDS, RecordConverter, _InvalidUtf8, _json_type_name, register_converter
from loader.errors import ImageOptionError, ImagePolicyError
from loader.io import storage
from loader.io.backends import is_remote
from loader.io.storage_options import StorageOptions
from loader.vision.images import (
    DEFAULT_MAX_ASPECT_RATIO,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_IMAGES_PER_DOCUMENT,
    DEFAULT_MAX_PIXELS,
    ImageLimits,
    inspect_image,
)
from loader.vision.policies import parse_policy_spec, policy_from_dict
from loader.vision.reasons import ImageRejected
from loader.vision.record import ImagesRecord
from loader.vision.segments import IMAGE, encode_segments

WEBDATASET_FORMAT = "webdataset"
# One image of a lane row: (encoded bytes, format, width, height, sha256 hex, visual tokens or None).
ImageTuple = tuple
# The fifth element of an image document / lane row: (segments tuple[int, ...], tuple[ImageTuple, ...]).
ImagePayload = tuple
_MISSING = object()


@dataclass(frozen=True)
class ImageSpec:
    """What an image job needs (the ``--image-*`` options); picklable, sent to the workers."""

    image_field: Optional[str] = None  # JSONL/Parquet field; in a WebDataset .json, the interleaved order
    image_root: Optional[str] = None  # base of relative image paths (default: the input file's directory)
    policy: Optional[dict] = None  # ImagePolicy.to_dict() (--image-policy): visual tokens in the lane
    limits: ImageLimits = field(default_factory=ImageLimits)

    def loaded_policy(self):
        return policy_from_dict(self.policy) if self.policy is not None else None

    def manifest_record(self, images: int) -> ImagesRecord:
        policy = self.loaded_policy()
        return ImagesRecord(images=images, limits=self.limits.to_dict(), policy=self.policy,
                            policy_fingerprint=policy.fingerprint() if policy is not None else None)


def add_image_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``images (vision-language)`` option group of ``zephon shard``."""
    group = parser.add_argument_group(
        "images (vision-language)", "image-caption pairs and interleaved text/image documents "
        "(docs/guides/images.md); WebDataset .tar input is always an image job")
    group.add_argument("--image-field", default=None, metavar="FIELD",
                       help="field/column holding each record's image (a path, bytes or a {bytes, path} struct) "
                            "or list of images; makes the job an image job. In a WebDataset sample's .json: "
                            "the list naming the members of an interleaved document (default: none)")
    group.add_argument("--image-root", default=None, metavar="DIR",
                       help="directory (local, gs:// or s3://) that relative image paths are resolved against "
                            "(default: the directory of the input file naming them); a relative path that climbs "
                            "out of it (../) is rejected, absolute paths and URLs are used as written")
    group.add_argument("--image-policy", default=None, metavar="SPEC",
                       help="image-processing policy whose visual-token count of each image is recorded in "
                            "the lane (image_visual_tokens): 'fixed', 'dynamic' or a JSON object such as "
                            "'{\"kind\": \"dynamic\", \"max_pixels\": 602112}' (default: none)")
    group.add_argument("--max-image-mb", type=float, default=DEFAULT_MAX_BYTES / (1 << 20),
                       help="largest encoded image in MiB; a larger one is image_too_large (default: %(default)g)")
    group.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_PIXELS,
                       help="largest width x height, checked from the header before decoding; a larger image "
                            "is image_too_large (default: %(default)s = 8192^2)")
    group.add_argument("--max-image-aspect-ratio", type=float, default=DEFAULT_MAX_ASPECT_RATIO,
                       help="largest max(w, h) / min(w, h); a longer image is image_extreme_aspect_ratio "
                            "(default: %(default)g, Qwen2-VL's bound)")
    group.add_argument("--max-images-per-document", type=int, default=DEFAULT_MAX_IMAGES_PER_DOCUMENT,
                       help="most images in one document; more is too_many_images (default: %(default)s)")


def image_spec_from_args(known: argparse.Namespace) -> Optional[ImageSpec]:
    """The job's :class:`ImageSpec` from parsed arguments; None when no image option is given
    (WebDataset input still makes an image job: :func:`resolve_image_job`)."""
    defaults = ImageLimits()
    limits_given = (known.max_image_mb != DEFAULT_MAX_BYTES / (1 << 20), known.max_image_pixels != defaults.max_pixels,
                    known.max_image_aspect_ratio != defaults.max_aspect_ratio,
                    known.max_images_per_document != defaults.max_images_per_document)
    if known.image_field is None and known.image_root is None and known.image_policy is None and not any(limits_given):
        return None
    try:
        limits = ImageLimits(max_bytes=max(1, int(known.max_image_mb * (1 << 20))) if known.max_image_mb > 0 else 0,
                             max_pixels=known.max_image_pixels, max_aspect_ratio=known.max_image_aspect_ratio,
                             max_images_per_document=known.max_images_per_document)
    except ValueError as exc:
        raise ImageOptionError(f"--max-image-*: {exc}") from None
    policy = None
    if known.image_policy is not None:
        try:
            policy = parse_policy_spec(known.image_policy).to_dict()
        except ImagePolicyError as exc:
            raise ImageOptionError(str(exc)) from None
    root = known.image_root
    if root is not None and not is_remote(root):  # workers may run elsewhere: never relative to a cwd
        root = os.path.abspath(os.path.expanduser(root))
    return ImageSpec(image_field=known.image_field, image_root=root, policy=policy, limits=limits)


def image_option_problems(options) -> list[str]:
    """What is wrong with the image options of a :class:`beam_jobs.shard.ShardOptions`."""
    spec = options.images
    if spec is None:
        return []
    problems = []
    if spec.image_field is not None and not spec.image_field:
        problems.append("--image-field must not be empty")
    if spec.image_field is not None and spec.image_field == options.text_field:
        problems.append(f"--image-field {spec.image_field!r} must differ from --text-field")
    if spec.image_field in options.keep_fields:
        problems.append(f"--keep-fields must not repeat --image-field {spec.image_field!r}")
    taken = sorted(set(options.keep_fields) & set(IMAGE_COLUMNS))
    if taken:
        problems.append(f"--keep-fields {', '.join(taken)}: these names are the image columns of an image job's lane "
                        f"files ({', '.join(IMAGE_COLUMNS)})")
    if options.chat and spec.image_field is not None:
        problems.append("--image-field with --messages-field: a chat job's images are the image parts of its "
                        "messages ({'type': 'image', 'image': PATH}); drop --image-field")
    if options.chat and options.tokenizer is not None:
        problems.append("--tokenizer with chat and images: conversations with image parts are encoded online (the "
                        "loader expands each image's placeholder and places its image refs); drop --tokenizer")
    elif options.tokenizer is not None:
        problems.append("--tokenizer with images: image documents are tokenized online (their text segments "
                        "around the image placeholders); drop --tokenizer")
    if getattr(options, "transforms", ()) or getattr(options, "dedup", None):
        problems.append("--transform / --dedup apply to text documents; they would cut the text out of line with "
                        "the images of an image document: drop them for an image job")
    return problems


def resolve_image_job(options, input_files: Sequence[InputFile]):
    """``options`` with its :class:`ImageSpec` once the inputs are known: WebDataset input makes an
    image job; an image job's JSONL/Parquet inputs need ``--image-field``; text files cannot be images."""
    webdataset = [f.path for f in input_files if f.format == WEBDATASET_FORMAT]
    spec = options.images
    if spec is None and not webdataset:
        return options
    if webdataset and options.chat:
        raise ImageOptionError(f"WebDataset input ({webdataset[0]}) with --messages-field: chat records with image "
                               "parts are read from JSONL or Parquet (their image parts name the images)")
    if spec is None:
        spec = ImageSpec()
        options = replace(options, images=spec)
        problems = image_option_problems(options)
        if problems:
            raise ImageOptionError(f"WebDataset input ({webdataset[0]}) is an image job: " + "; ".join(problems))
    if spec.image_root is not None and not is_remote(spec.image_root) and not os.path.isdir(spec.image_root):
        raise ImageOptionError(f"--image-root {spec.image_root} is not a directory; pass the folder that relative "
                               "image paths start from")
    if spec.image_root is not None and is_remote(spec.image_root):
        try:
            storage.backend_for(spec.image_root)
        except storage.UnsupportedSchemeError as exc:
            raise ImageOptionError(f"--image-root {exc}") from exc
    text_files = [f.path for f in input_files if f.format == "text"]
    if text_files:
        raise ImageOptionError(f"an image job cannot read text input (e.g. {text_files[0]}): a text file is one "
                               "document without an image; give image records as JSONL, Parquet or WebDataset")
    records = [f.path for f in input_files if f.format in ("jsonl", "parquet")]
    if records and spec.image_field is None and not options.chat:
        raise ImageOptionError(f"JSONL/Parquet input in an image job (e.g. {records[0]}) needs --image-field FIELD "
                               "naming each record's image(s)")
    return options


# ---------------------------------------------------------------------------------------
# Record -> document


class _Reject(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _text_of(value: Any, name: str) -> str:
    if isinstance(value, _InvalidUtf8):
        raise _Reject("invalid_utf8", f"field {name!r}: {value.detail}")
    if not isinstance(value, str):
        raise _Reject("non_string_text", f"field {name!r} is {_json_type_name(value)}, not a string")
    return value


def document_parts(image_value: Any, text_value: Any, image_field: str, text_field: str) -> list:
    """The document's parts in order (``str`` texts, image references) by the table of the module."""
    if image_value is _MISSING or image_value is None:
        raise _Reject("missing_image_field", f"no value for --image-field {image_field!r}")
    if text_value is _MISSING:
        raise _Reject("missing_text_field", f"no field {text_field!r} (set --text-field)")
    if isinstance(image_value, list):
        if isinstance(text_value, list):
            if len(image_value) != len(text_value):
                raise _Reject("invalid_image_field", f"interleaved {image_field!r} holds {len(image_value)} entries "
                              f"but {text_field!r} holds {len(text_value)}; position i is an image or a text")
            parts = []
            for position, (image, text) in enumerate(zip(image_value, text_value)):
                if (image is None) == (text is None):
                    raise _Reject("invalid_image_field", f"interleaved position {position} holds "
                                  f"{'both an image and a text' if image is not None else 'neither image nor text'}")
                parts.append(_text_of(text, f"{text_field}[{position}]") if image is None else ("image", image))
            return parts
        if not image_value:
            raise _Reject("missing_image_field", f"--image-field {image_field!r} is an empty list")
        if any(image is None for image in image_value):
            raise _Reject("invalid_image_field", f"--image-field {image_field!r} lists a null image")
        return [("image", image) for image in image_value] + [_text_of(text_value, text_field)]
    if isinstance(text_value, list):
        raise _Reject("invalid_image_field", f"{text_field!r} is a list (interleaved) but {image_field!r} is not a "
                      "list of the same length")
    return [("image", image_value), _text_of(text_value, text_field)]


ByteSource = Callable[[str], bytes]  # a named image (path or member) -> its bytes, or raises _Reject


def _described(reference: Any) -> str:
    if isinstance(reference, str):
        return repr(reference[:200])
    if isinstance(reference, dict):
        return f"struct (path {reference.get('path')!r:.200})"
    if isinstance(reference, bytes):
        return f"bytes ({len(reference)})"
    return type(reference).__name__


@register_converter(IMAGE_RECORDS)
class ImageRecordConverter(RecordConverter):
    """A :class:`RecordConverter` for image jobs: a record becomes an image document or a rejection."""

    def __init__(self, spec, input_file: InputFile, chat_encoder=None):
        super().__init__(spec, input_file, chat_encoder)
        self.images = spec.images
        self.policy = self.images.loaded_policy()
        self.image_root = self.images.image_root or _directory_of(input_file.path)

    def convert(self, record: dict, record_index: int, raw: Union[bytes, str]) -> tuple[bool, tuple]:
        """A JSONL or Parquet record; named images are files."""
        field_name = self.images.image_field
        return self.convert_parts(record, record_index, raw, record.get(field_name, _MISSING), self.read_file)

    def convert_parts(self, record: dict, record_index: int, raw: Union[bytes, str], image_value: Any,
                      read_named: ByteSource) -> tuple[bool, tuple]:
        text_field = self.spec.text_field
        try:
            parts = document_parts(image_value, record.get(text_field, _MISSING),
                                   self.images.image_field or "<image member>", text_field)
            references = [part[1] for part in parts if isinstance(part, tuple)]
            if len(references) > self.images.limits.max_images_per_document:
                raise _Reject("too_many_images", f"{len(references)} images, more than --max-images-per-document "
                              f"{self.images.limits.max_images_per_document}")
            images = tuple(self._image(index, reference, read_named) for index, reference in enumerate(references))
            text, segments = encode_segments([IMAGE if isinstance(part, tuple) else part for part in parts])
            if not text.strip():
                raise _Reject("empty_text", f"the text of field {text_field!r} is empty or whitespace only")
        except _Reject as rejected:
            return False, self.reject(record_index, rejected.reason, rejected.detail, raw)
        ok, element = self._document(record, record_index, raw, text, (tuple(segments), images))
        if not ok:
            return ok, element
        key, text, text_nbytes, kept, payload = element
        return True, (key, text, text_nbytes + sum(len(image[0]) for image in images), kept, payload)

    def _image(self, index: int, reference: Any, read_named: ByteSource) -> ImageTuple:
        where = f"image {index} ({_described(reference)})"
        try:
            data = self._bytes_of(reference, read_named)
            info = inspect_image(data, self.images.limits)
            tokens = self.policy.visual_tokens(info.width, info.height) if self.policy is not None else None
        except ImageRejected as exc:
            raise _Reject(exc.reason, f"{where}: {exc.detail}") from None
        except _Reject as exc:
            raise _Reject(exc.reason, f"{where}: {exc.detail}") from None
        return (data, info.format, info.width, info.height, info.sha256, tokens)

    def _bytes_of(self, reference: Any, read_named: ByteSource) -> bytes:
        if isinstance(reference, (bytes, bytearray, memoryview)):
            return bytes(reference)
        if isinstance(reference, dict):  # the Hugging Face Image feature: {bytes, path}
            if reference.get("bytes") is not None:
                return self._bytes_of(reference["bytes"], read_named)
            if isinstance(reference.get("path"), str):
                return read_named(reference["path"])
            raise _Reject("image_missing", "an image struct with neither bytes nor path")
        if isinstance(reference, str):
            if not reference:
                raise _Reject("invalid_image_field", "an empty image path")
            return read_named(reference)
        raise _Reject("invalid_image_field", f"an image must be a path, bytes or a {{bytes, path}} struct (got "
                      f"{_json_type_name(reference)})")

    def read_file(self, name: str) -> bytes:
        """The bytes of an image file named by a record (module docstring: path resolution)."""
        return read_image_file(resolve_image_path(self.image_root, name), self.images.limits, self.spec.storage)


def _directory_of(path: str) -> str:
    return path[: path.rfind("/") + 1] if is_remote(path) else os.path.dirname(path)


def resolve_image_path(root: str, name: str) -> str:
    """``name`` resolved against ``root``: URLs and absolute paths as given, else ``root/name``."""
    if is_remote(name) or os.path.isabs(name):
        return name
    if is_remote(root):
        scheme, rest = root.split("://", 1)
        resolved, base = posixpath.normpath(posixpath.join(rest, name)), posixpath.normpath(rest)
        if posixpath.commonpath([resolved, base]) != base:
            raise _Reject("image_unreadable", f"{name!r} climbs out of its root {root} (relative image paths stay "
                          "inside it; write the path absolute, or set --image-root to a folder that holds it)")
        return f"{scheme}://{resolved}"
    resolved, base = os.path.normpath(os.path.join(root, name)), os.path.normpath(root or ".")
    if os.path.commonpath([os.path.abspath(resolved), os.path.abspath(base)]) != os.path.abspath(base):
        raise _Reject("image_unreadable", f"{name!r} climbs out of its root {root} (relative image paths stay inside "
                      "it; write the path absolute, or set --image-root to a folder that holds it)")
    return resolved


def read_image_file(path: str, limits: ImageLimits, storage_options: StorageOptions = StorageOptions()) -> bytes:
    """Read one image file: local, or remote through the storage backend of its scheme
    (:mod:`loader.io.storage`; an unsupported scheme is an ``image_unreadable`` reject naming
    the supported ones)."""
    try:
        if not is_remote(path):
            # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever
            descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            with os.fdopen(descriptor, "rb") as handle:
                info = os.fstat(descriptor)
                if not stat.S_ISREG(info.st_mode):
                    raise _Reject("image_unreadable", f"{path}: not a regular file (a FIFO, device, socket or "
                                  "directory); name image files only")
                if info.st_size > limits.max_bytes:  # never read a huge file into memory just to refuse it
                    raise _Reject("image_too_large", f"{path}: {info.st_size} bytes, above the limit of "
                                  f"{limits.max_bytes} (--max-image-mb)")
                data = handle.read(limits.max_bytes + 1)
            if len(data) > limits.max_bytes:  # it grew since the fstat
                raise _Reject("image_too_large", f"{path}: more than {limits.max_bytes} bytes (--max-image-mb)")
            return data
        # One metadata request pins a version; the bytes read are that version's, so an object
        # replaced after the size check cannot be read whole.
        with storage.open_input(path, storage_options) as reader:
            size = reader.seek(0, io.SEEK_END)
            if size > limits.max_bytes:  # never fetch a huge object just to refuse it
                raise _Reject("image_too_large", f"{path}: {size} bytes, above the limit of {limits.max_bytes} "
                              "(--max-image-mb)")
            reader.seek(0)
            return reader.read(limits.max_bytes + 1)
    except (FileNotFoundError, storage.StorageNotFoundError):
        raise _Reject("image_missing", f"{path} does not exist") from None
    except (OSError, storage.StorageError) as exc:
        raise _Reject("image_unreadable", f"{path}: {type(exc).__name__}: {exc}"[:500]) from None
