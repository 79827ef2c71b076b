"""Per-token features: named arrays that travel with ``input_ids`` from read to batch.

A document is its token ids plus any number of *features*, each an array with one value per
token (a loss mask, the source of each token under token mixing, later image placeholders).
Every stage carries them without knowing them: a block holds them next to its tokens, a
:class:`~loader.io.lane_reader.Chunk` slices them with the tokens, the packers lay them out
with the tokens (cuts, carries, best-fit bins, their checkpoints), worker messages ship
them in the shared-memory slot, and collation builds each batch field from them by one rule
(:func:`batch_feature`). What differs per feature is data, one :class:`Feature` entry in
:data:`FEATURES`; a new feature is a new entry (plus whatever makes its values: a lane-file
column, or a stage such as the token mixer).

Values at positions the loader makes itself:

* a BOS the loader inserts gets ``bos``; an EOS gets ``eos``, or with ``eos=None`` the value
  of the document's last token (``bos`` for an empty document): a loss mask trains the EOS
  after a supervised reply and not after an unsupervised one;
* the padding tail of a sequence gets ``pad``;
* tokens of a document whose source lacks the feature (a mix of a source with a loss mask
  and one without) get ``default``.

Datasets without features pay nothing: every stage tests ``if features`` (an empty mapping)
and keeps its feature-free path, so their batches and checkpoints are byte-identical to
those of a loader that knows no features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

IGNORE_INDEX = -100

class _NoFeatures(Mapping):
    """The features of a chunk or sequence that has none: one shared, immutable, falsy,
    hashable instance (usable as a dataclass default)."""

    def __getitem__(self, name: str) -> np.ndarray:
        raise KeyError(name)

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "NO_FEATURES"


NO_FEATURES: Mapping[str, np.ndarray] = _NoFeatures()


@dataclass(frozen=True)
class Feature:
    """One per-token feature: how it is stored, padded, wrapped, batched and used for labels."""

    name: str  # key in Block/Chunk/PackedSequence ``features``, in worker slots and best-fit bin states
    dtype: np.dtype  # in memory and in worker slots
    pad: int  # on the padding tail of a sequence
    bos: int  # on a BOS the loader inserts
    eos: Optional[int]  # on an EOS the loader inserts; None: the document's last token's value
    default: int  # on tokens of documents whose source does not have the feature
    column: Optional[str]  # lane-file column it is read from (binary, one element per token); None: made by a stage
    batch_field: Optional[str]  # micro-batch key (``batch_fields`` entry); None: not batched
    batch_dtype: np.dtype  # dtype of the batch array
    masks_labels: bool = False  # labels are IGNORE_INDEX where the value is 0
    value_range: Optional[tuple[int, int]] = None  # [low, high]: checked in lane files and best-fit bin states
    audit_only: bool = False  # made only by ``zephon audit`` (loader.commands.audit); never in a training stream
    in_bin_states: bool = False  # saved in best-fit bin states although made by a stage (column features are)
    # A reference into the data (another row's bytes are read by it): a restored best-fit bin's
    # values are checked against the block each piece came from (BestFitPacker.set_state).
    bound_to_data: bool = False


# Registry order is the order features appear in worker slots, bin states and batches.
# ``token_sources`` first: a token-mixing best-fit bin state lists it right after
# ``doc_starts``, as it did before the registry existed (checkpoint bytes unchanged).
FEATURES: dict[str, Feature] = {
    f.name: f
    for f in (
        # Source id of every token under token-unit mixing (set by loader.stages.token_mixing).
        Feature("token_sources", np.dtype(np.int8), pad=-1, bos=-1, eos=-1, default=-1, column=None,
                batch_field="token_source_ids", batch_dtype=np.dtype(np.int64)),
        # 1 where the token is a training target (chat / SFT: the assistant's tokens).
        Feature("loss_mask", np.dtype(np.uint8), pad=0, bos=0, eos=None, default=1, column="loss_mask",
                batch_field="loss_mask", batch_dtype=np.dtype(np.uint8), masks_labels=True,
                value_range=(0, 1)),
        # Provenance of every token, for ``zephon audit`` only (loader.commands.audit): the
        # document it comes from, as ``epoch << 40 | row of the lane`` (rows counted in the
        # lane's epoch-0 order), and its offset in the wrapped document (BOS/EOS included).
        # No training loader has them: ZephonLoader selects column features and
        # token_sources only, so its batches and checkpoints are unchanged, and worker slots
        # reserve no per-token room for them (slot_bytes_per_token).
        Feature("audit_document", np.dtype(np.int64), pad=-1, bos=-1, eos=-1, default=-1, column=None,
                batch_field=None, batch_dtype=np.dtype(np.int64), audit_only=True),
        Feature("audit_offset", np.dtype(np.int64), pad=-1, bos=-1, eos=-1, default=-1, column=None,
                batch_field=None, batch_dtype=np.dtype(np.int64), audit_only=True),
        # The image each visual placeholder token stands for (loader.vision.block): the image's
        # position (epoch, block, row, image) as loader.vision.refs packs it, -1 on every other
        # token. Not a batch field: whoever assembles a sequence resolves the refs to pixels
        # (loader.vision.resolve), which the batch carries as pixel_values.
        Feature("image_ref", np.dtype(np.int64), pad=-1, bos=-1, eos=-1, default=-1, column=None,
                batch_field=None, batch_dtype=np.dtype(np.int64), in_bin_states=True, bound_to_data=True),
    )
}

BATCH_FEATURE_FIELDS: tuple[str, ...] = tuple(f.batch_field for f in FEATURES.values() if f.batch_field)
# Features a best-fit bin state may hold besides token_sources (loader.checkpoint.schema).
BIN_STATE_FEATURES: tuple[str, ...] = tuple(f.name for f in FEATURES.values() if f.column is not None or f.in_bin_states)


def column_features(column_names: Iterable[str]) -> tuple[Feature, ...]:
    """The features read from lane-file columns among ``column_names``, in registry order."""
    names = set(column_names)
    return tuple(f for f in FEATURES.values() if f.column is not None and f.column in names)


def in_order(names: Iterable[str]) -> tuple[str, ...]:
    """Feature names in registry order (the order every stage lays them out in)."""
    present = set(names)
    return tuple(name for name in FEATURES if name in present)


def slice_features(features: Mapping[str, np.ndarray], start: int, end: int) -> Mapping[str, np.ndarray]:
    """Each feature's ``[start, end)`` (views); the empty mapping stays the shared one."""
    if not features:
        return NO_FEATURES
    return {name: values[start:end] for name, values in features.items()}


def wrap_feature(feature: Feature, flat: np.ndarray, lengths: np.ndarray, doc_starts: np.ndarray,
                 bos: bool, eos: bool) -> np.ndarray:
    """A feature's document values laid out like the wrapped tokens (``doc_starts``: the
    block's, with BOS/EOS included), with the ``bos``/``eos`` values at the wrappers."""
    flat = np.asarray(flat, dtype=feature.dtype)
    if not bos and not eos:
        return flat
    out = np.empty(int(doc_starts[-1]), dtype=feature.dtype)
    is_document_value = np.ones(len(out), dtype=bool)
    if bos:
        out[doc_starts[:-1]] = feature.bos
        is_document_value[doc_starts[:-1]] = False
    if eos:
        ends = doc_starts[1:] - 1
        is_document_value[ends] = False
    out[is_document_value] = flat
    if eos:
        if feature.eos is not None:
            out[ends] = feature.eos
        else:  # the document's last token's value; an empty document's EOS gets the BOS value
            last = ends - 1
            empty = lengths == 0
            out[ends] = np.where(empty, feature.bos, out[np.maximum(last, 0)])
    return out


def lay_out(names: Sequence[str], pieces: Sequence[Mapping[str, np.ndarray]], lengths: Sequence[int],
            size: int) -> dict[str, np.ndarray]:
    """Feature arrays of ``size`` tokens made of ``pieces`` back to back (piece ``k`` holds
    ``lengths[k]`` tokens; a piece without a feature gets its ``default``), ``pad`` after."""
    out = {}
    for name in names:
        feature = FEATURES[name]
        values = np.full(size, feature.pad, dtype=feature.dtype)
        at = 0
        for piece, n in zip(pieces, lengths):
            own = piece.get(name)
            values[at : at + n] = feature.default if own is None else own
            at += n
        out[name] = values
    return out


def mask_labels(labels: np.ndarray, features: Mapping[str, np.ndarray]) -> None:
    """Apply every label rule of ``features`` to ``labels`` (same shape), in place."""
    for name, values in features.items():
        if FEATURES[name].masks_labels:
            labels[values == 0] = IGNORE_INDEX


def batch_feature(name: str, row_features: Sequence[Mapping[str, np.ndarray]], rows: int, seq_len: int) -> np.ndarray:
    """``[rows, seq_len]`` of feature ``name`` over a micro-batch (``row_features``: each row's
    features), in its batch dtype; a row without it (a source without the feature) holds the
    default on every token."""
    feature = FEATURES[name]
    per_row = []
    for features in row_features:
        values = features.get(name)
        per_row.append(np.full(seq_len, feature.default, feature.dtype) if values is None else values)
    return np.concatenate(per_row, dtype=feature.batch_dtype).reshape(rows, seq_len)


def slot_bytes_per_token(names: Optional[Iterable[str]] = None) -> int:
    """Bytes per token of the features ``names`` (default: every feature at once, the worker
    slot's worst case); audit-only features never travel through workers. A loader passes its
    own features, so a text loader's slots hold no room for, e.g., image refs."""
    chosen = FEATURES.values() if names is None else [FEATURES[n] for n in names]
    return sum(f.dtype.itemsize for f in chosen if not f.audit_only)
