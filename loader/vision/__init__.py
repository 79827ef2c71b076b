"""Vision-language data: image inspection and decoding, image-processing policies, the
interleaved text/image layout of lane rows.

Modules:

- :mod:`~loader.vision.reasons`: the stable names of image reject reasons (no Pillow import);
- :mod:`~loader.vision.images`: inspect encoded bytes (format, size, SHA-256, rejects) and
  decode them deterministically to RGB;
- :mod:`~loader.vision.policies`: the ``fixed`` and ``dynamic`` image-processing policies
  (visual-token counts and pixel values in the layout of their model family);
- :mod:`~loader.vision.segments`: the ``segments`` column that orders a document's text and
  images;
- :mod:`~loader.vision.documents`: a lane row back as an :class:`ImageDocument` (parts in order,
  images with their recorded metadata);
- :mod:`~loader.vision.record`: the manifest's ``images`` entry (limits, policy, counts);
- :mod:`~loader.vision.options`: the loader config's ``images`` table, resolved to
  :class:`~loader.vision.block.ImageOptions`;
- :mod:`~loader.vision.block`: a row group of image documents as a token block (placeholders,
  ``loss_mask``, ``image_ref``), the online half's decode point;
- :mod:`~loader.vision.resolve`: a packed sequence's image refs back to pixels;
- :mod:`~loader.vision.transfer`: pixels through a worker's shared-memory slot.
- :mod:`~loader.vision.chat`: conversations with image parts (chat templates, pads expanded to
  the policy's visual tokens), the chat-and-images block.
"""

from loader.vision.reasons import IMAGE_REJECT_REASONS, ImageRejected
from loader.vision.segments import IMAGE_SEGMENT, Segment, decode_segments, encode_segments

__all__ = [
    "IMAGE_REJECT_REASONS",
    "IMAGE_SEGMENT",
    "ImageRejected",
    "Segment",
    "decode_segments",
    "encode_segments",
]
