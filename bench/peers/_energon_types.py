"""Energon sample type, cookers and task encoders (module level, so worker processes can pickle them)."""

from __future__ import annotations

import numpy as np
from megatron.energon import Cooker, DefaultTaskEncoder, Sample, basic_sample_keys, stateless
from megatron.energon.edataclass import edataclass


@edataclass
class DocSample(Sample):
    """One document: int32 ids (pre-tokenized) or its text."""

    doc: object


@stateless
def cook_ids(raw: dict) -> DocSample:
    return DocSample(**basic_sample_keys(raw), doc=np.frombuffer(raw["ids"], dtype="<i4"))


@stateless
def cook_text(raw: dict) -> DocSample:
    value = raw["txt"]
    value = value.decode() if isinstance(value, (bytes, bytearray)) else value
    return DocSample(**basic_sample_keys(raw), doc=value)


class IdsEncoder(DefaultTaskEncoder):
    cookers = [Cooker(cook_ids)]


class TextEncoder(DefaultTaskEncoder):
    cookers = [Cooker(cook_text)]
