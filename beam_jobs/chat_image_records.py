"""Chat records with image parts in the sharding job: conversations validated, images read and
checked, both stored for the loader to encode online (:mod:`loader.vision.chat`).

A chat job (``--messages-field``, ``--chat-template``) given an image option (``--image-root``,
``--image-policy`` or a ``--max-image-*`` limit) is a chat-with-images job::

    record --parse + render_image_conversation (image parts allowed; chat rejects as a chat job's)-->
      each image part's reference (``image`` / ``url`` / ``path``: a path resolved like an image
      job's, or bytes) --read + inspect_image (+ visual tokens with --image-policy)-->
      document (key, plain render of the stripped conversation, text + image bytes, kept values,
                (segments, images), conversation JSON with each image part as {"type": "image"})
      | a missing or bad image, or a bad message --> the whole conversation is a rejection

The lane rows are an image job's (the image columns, ``segments`` = the render then its images)
plus the ``conversation`` column, and the manifest has both the online ``chat`` entry and the
``images`` entry. ``--tokenizer`` is refused (the loader places the image refs when it encodes).
"""

from __future__ import annotations

from typing import Any, Union

from beam_jobs.chat_records import TOOLS_FIELD, InvalidUtf8Record, _lone_surrogate, conversation_json
from beam_jobs.image_records import ImageRecordConverter, _Reject
from beam_jobs.records import IMAGE_CHAT_RECORDS, register_converter
from loader.chat.conversations import ConversationRejected
from loader.vision.chat import image_parts, parse_image_conversation, render_image_conversation
from loader.vision.segments import IMAGE, encode_segments


@register_converter(IMAGE_CHAT_RECORDS)
class ChatImageRecordConverter(ImageRecordConverter):
    """A record of a chat-with-images job -> a document (module docstring) or a rejection."""

    def convert(self, record: dict, record_index: int, raw: Union[bytes, str]) -> tuple[bool, tuple]:
        spec = self.chat_encoder.spec
        try:
            for name in spec.record_fields:
                problem = _lone_surrogate(record.get(name))
                if problem:
                    raise InvalidUtf8Record(f"field {name!r}: {problem}")
            parsed = parse_image_conversation(record, messages_field=spec.messages_field, tools_field=TOOLS_FIELD)
            parts = image_parts(parsed)
            limit = self.images.limits.max_images_per_document
            if len(parts) > limit:
                raise _Reject("too_many_images", f"{len(parts)} image parts, more than --max-images-per-document "
                              f"{limit}")
            conversation = render_image_conversation(parsed, self.chat_encoder.template,
                                                     loss_on=spec.loss_on).conversation  # stripped
            images = tuple(self._part_image(index, where, reference) for index, (where, reference) in enumerate(parts))
        except ConversationRejected as exc:
            return False, self.reject(record_index, exc.reason, exc.detail, raw)
        except InvalidUtf8Record as exc:
            return False, self.reject(record_index, "invalid_utf8", str(exc), raw)
        except _Reject as exc:
            return False, self.reject(record_index, exc.reason, exc.detail, raw)
        # the plain render, as a text chat job's text column
        text = self.chat_encoder.template.render(list(conversation.messages), tools=conversation.tools).text
        segments = encode_segments([text] + [IMAGE] * len(images))[1]
        ok, element = self._document(record, record_index, raw, text, (tuple(segments), images))
        if not ok:
            return ok, element
        key, text, text_nbytes, kept, payload = element
        return True, (key, text, text_nbytes + sum(len(image[0]) for image in images), kept, payload,
                      conversation_json(conversation))

    def _part_image(self, index: int, where: str, reference: Any) -> tuple:
        if reference is None:
            raise _Reject("image_missing", f"image {index} ({where}): the image part names no image (give it as "
                          "'image', 'url' or 'path')")
        try:
            return self._image(index, reference, self.read_file)
        except _Reject as exc:
            raise _Reject(exc.reason, f"{where}: {exc.detail}") from None
