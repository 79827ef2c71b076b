"""Deterministic document transforms: user filters and maps, applied online and offline.

A transform is an importable function ``module:function`` (or a built-in's short name) with
keyword arguments and an optional declared version, listed in the loader config per dataset
or for all (``transforms``), or given to ``zephon shard --transform``. It receives one
:class:`~loader.transforms.document.Document` and returns it (possibly changed) or ``None``
to drop it; its only randomness is ``doc.seed``, derived from (seed, position in the chain,
document key) with the stable hashes of :mod:`loader.order.hashing`.

Modules: :mod:`~loader.transforms.spec` (what a config names, parsing, import),
:mod:`~loader.transforms.document` (the document a function sees),
:mod:`~loader.transforms.chain` (applying a source's transforms, the determinism check,
the counters), :mod:`~loader.transforms.rows` (a row group's columns through a chain, for the
lane reader; the tombstones of offline drops), :mod:`~loader.transforms.conversations` (online
chat sources: records before the render, tokens after), :mod:`~loader.transforms.builtins`
(length, metadata, regex, truncation).
"""

from loader.errors import TransformError
from loader.transforms.chain import TransformChain, TransformCounts
from loader.transforms.document import Document, document_seed
from loader.transforms.spec import STAGES, TransformSpec, parse_transform_arg, transform

__all__ = [
    "Document", "STAGES", "TransformChain", "TransformCounts", "TransformError", "TransformSpec",
    "document_seed", "parse_transform_arg", "transform",
]
