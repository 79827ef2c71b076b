"""Names that the manifest, the lane reader, the transforms and the kinds share.

Lane-file columns read by more than one layer (the whole layout is in :mod:`loader.io.manifest`)
and the reject reasons of a document. A bottom module: each of those layers names these, and
none needs the others to do so.
"""

CONVERSATION_COLUMN = "conversation"  # the lane-file column of conversations rendered online
# Datasets sharded with --transform: per row, the position (in the manifest's "transforms") of
# the transform that dropped the document, -1 for a kept one. A dropped document stays in its
# lane as a tombstone (key, empty text, no tokens) so that lane files hold the rows they would
# hold without the transforms; the loader skips tombstones (docs/guides/transforms.md).
TOMBSTONE_COLUMN = "dropped_by"

# The rejection reasons of a document the Beam job can emit (manifest ``rejected`` keys). A text
# job records these (each with its count, zeros included); a chat or image job adds its kind's
# own (loader.kinds.chat.REJECT_REASONS, loader.kinds.image.IMAGE_DOCUMENT_REJECT_REASONS). The
# manifest keeps whatever keys it was written with, so older manifests load unchanged.
DOCUMENT_REJECT_REASONS = (
    "malformed_json",
    "missing_text_field",
    "non_string_text",
    "invalid_utf8",
    "empty_text",
    "missing_id_field",
    "unreadable_file",
)
