"""Pre-tokenized text documents longer than a ``best_fit`` sequence: the loader config's ``overlong``.

Best fit never splits a document that fits ``seq_len`` minus the loader's BOS/EOS; a longer
one is cut into ``seq_len`` pieces (loader.stages.packing), the documented behaviour for text.
The Beam job records a pre-tokenized text dataset's longest document in tokens (the manifest's
``longest_tokens``; ``zephon record-longest`` adds it to a dataset sharded before), so the loader
knows exactly whether any document is cut:

==============  ==========================================================================
``overlong``    a pre-tokenized text document longer than the fit
==============  ==========================================================================
``"refuse"``    cut into pieces, as ever (a text document has no turn that splitting would
                break; conversations are refused instead, loader.chat.block); the loader
                logs the recorded longest once when it does not fit
``"drop"``      dropped, counted as the drops of the transform ``length_tokens``
``"truncate"``  its first ``fit`` tokens kept (``truncate_tokens``, counted as changed); a
                document with a ``loss_mask`` column is cut after its last supervised run
                that fits (``truncate_turns``), dropped when none does
==============  ==========================================================================

The transform is appended to the source's own where the recorded longest does not fit, or
where nothing is recorded (it then changes only documents that do not fit): the stream of a
dataset is the same with the entry and without it. Text tokenized by the loader has no tokens
stage to run it on, and is cut into pieces whatever ``overlong`` says.
"""

from __future__ import annotations

import logging
from typing import Optional

from loader.transforms.spec import TransformSpec

log = logging.getLogger(__name__)


def text_fit(manifest, *, seq_len: int, packing: str, wrap_tokens: int) -> Optional[int]:
    """The tokens a document of this pre-tokenized text source may hold without being cut by
    ``best_fit`` (``seq_len`` minus the loader's BOS/EOS), or None where ``overlong`` has nothing
    to decide: concat packing, a source that is not pre-tokenized text (chat, images and named
    kinds have their own bounds), or a recorded longest document that fits."""
    if packing != "best_fit" or not manifest.pretokenized or manifest.chat is not None \
            or manifest.images is not None or manifest.kind is not None:
        return None
    fit = seq_len - wrap_tokens
    if fit < 1 or (manifest.longest_tokens is not None and manifest.longest_tokens <= fit):
        return None
    return fit


def text_overlong_transforms(overlong: str, manifest, source_name: str, *, seq_len: int, packing: str,
                             wrap_tokens: int) -> tuple[TransformSpec, ...]:
    """``overlong``'s transform of a pre-tokenized text source (module docstring); none where
    every document fits or ``overlong`` is "refuse" (then logged once if the longest is known)."""
    fit = text_fit(manifest, seq_len=seq_len, packing=packing, wrap_tokens=wrap_tokens)
    if fit is None:
        return ()
    if overlong == "refuse":
        if manifest.longest_tokens is not None:
            log.info("datasets entry %r: its longest document has %d tokens, more than seq_len=%d minus the %d "
                     "BOS/EOS token(s); best_fit cuts such documents into seq_len pieces (set overlong = \"drop\" "
                     "or \"truncate\" to drop or truncate them, counted)", source_name, manifest.longest_tokens,
                     seq_len, wrap_tokens)
        return ()
    if overlong == "drop":
        return (TransformSpec("length_tokens", {"max": fit}),)
    if any(column.get("name") == "loss_mask" for column in manifest.schema):
        return (TransformSpec("truncate_turns", {"max_tokens": fit}),)
    return (TransformSpec("truncate_tokens", {"max_tokens": fit}),)
