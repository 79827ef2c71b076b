"""The checkpoint records of the packers (:mod:`loader.stages.packing`, :mod:`loader.stages.window_packing`).

State keys::

    concat            {stream}                     the stream's cursor: the packer holds no tokens
    best_fit          {stream, bins, serial}       the open bins and the next bin's serial; a bin is
                      {serial, tokens, piece_starts, doc_starts [, token_sources] [, <feature> ...]
                      [, piece_origins]}: its ids, where its pieces and documents start, under token
                      mixing each token's source, each lane-file feature of loader.stages.features one
                      value per token, and (version 2) per piece the cursor [epoch, block, offset] of
                      its first token (absent where unknown: a version-1 bin)
    best_fit_window   {stream, window{version, index, emitted}}   (``packing_window``) the cursor of the
                      window's first document, windows completed, bins of this one handed out; the
                      ``window`` record carries its own version (:data:`WINDOW_STATE_VERSION`)

``stream`` is a ``cursor`` record (loader.io.cursor_record), or under token mixing a
``mixed_stream`` record (loader.stages.mixed_record).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from loader.checkpoint.records import RecordContext, RecordType, register_record
from loader.io.cursor_record import Cursor, cursor_state, parse_cursor
from loader.stages.features import BIN_STATE_FEATURES, FEATURES
from loader.stages.mixed_record import MixedStream, parse_mixed_stream
from loader.validation import Problems, fields_of, id_array, int_list, json_int, show, type_name

STREAM = "stream"
BINS = "bins"
SERIAL = "serial"
WINDOW = "window"
# a best-fit bin's keys
TOKENS = "tokens"
PIECE_STARTS = "piece_starts"
DOC_STARTS = "doc_starts"
TOKEN_SOURCES = "token_sources"
PIECE_ORIGINS = "piece_origins"
# a windowed packer's window
VERSION = "version"
INDEX = "index"
EMITTED = "emitted"
WINDOW_KEYS = (VERSION, INDEX, EMITTED)
WINDOW_STATE_VERSION = 1  # of the windowed packer's ``window`` record

# Per-token features a best-fit bin may hold besides token_sources: those read from lane files
# (loader.stages.features), and the stage-made ones saved in bins (image_ref); which of them a
# packer's bins must hold is checked on restore, against the source's lane files
# (BestFitPacker.set_state).
BIN_FEATURES = BIN_STATE_FEATURES


def concat_state(epoch: int, block: int, offset: int, exhausted: bool) -> dict:
    """A :class:`~loader.stages.packing.ConcatPacker` state whose stream's state is its bare cursor."""
    return {STREAM: cursor_state(epoch, block, offset, exhausted)}


def concat_packer_state(stream_state: dict) -> dict:
    return {STREAM: stream_state}


def best_fit_state(stream_state: dict, bins: list, serial: int) -> dict:
    return {STREAM: stream_state, BINS: bins, SERIAL: serial}


def window_packer_state(stream_state: dict, index: int, emitted: int) -> dict:
    """A :class:`~loader.stages.window_packing.WindowedBestFitPacker` state."""
    return {STREAM: stream_state, WINDOW: {VERSION: WINDOW_STATE_VERSION, INDEX: index, EMITTED: emitted}}


# -- typed records -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Bin:
    """An open best-fit bin: ``tokens`` (and ``token_sources``) as int64 arrays, starts as lists."""

    serial: int
    tokens: np.ndarray
    piece_starts: list
    doc_starts: list
    token_sources: Optional[np.ndarray]
    features: tuple = ()  # (name, int64 array) of the column features it holds (loader.stages.features), registry order
    piece_origins: Optional[tuple] = None  # per piece (epoch, block, offset); None: unknown (a version-1 bin)


@dataclass(frozen=True)
class WindowPosition:
    """Where a windowed best-fit packer stands: windows done, bins of the current one handed out."""

    version: int
    index: int
    emitted: int


@dataclass(frozen=True)
class PackerState:
    packing: str
    stream: Union[Cursor, MixedStream]
    bins: tuple[Bin, ...] = ()  # best_fit only
    serial: int = 0  # best_fit only
    window: Optional[WindowPosition] = None  # best_fit with packing_window only (then no bins)


# -- parsers -------------------------------------------------------------------------------------


def _parse_stream(raw: Any, path: str, problems: Problems, context: RecordContext) -> Any:
    if context.token_mixing:
        return parse_mixed_stream(raw, path, problems, context)
    return parse_cursor(raw, path, problems)


def parse_concat(raw: Any, path: str, problems: Problems, context: RecordContext) -> Optional[PackerState]:
    entry = CONCAT.fields(raw, path, problems)
    if entry is None:
        return None
    stream = _parse_stream(entry[STREAM], f"{path}.{STREAM}", problems, context)
    return None if stream is None else PackerState(context.packing, stream)


def parse_best_fit(raw: Any, path: str, problems: Problems, context: RecordContext) -> Optional[PackerState]:
    mixed_sources = len(context.source_names) if context.token_mixing else 0
    entry = BEST_FIT.fields(raw, path, problems)
    if entry is None:
        return None
    stream = _parse_stream(entry[STREAM], f"{path}.{STREAM}", problems, context)
    serial = json_int(entry[SERIAL], f"{path}.{SERIAL}", problems)
    bins_raw = entry[BINS]
    if not isinstance(bins_raw, list):
        problems.at(f"{path}.{BINS}", f"must be a list of bins (got {type_name(bins_raw)} {show(bins_raw)})")
        return None
    bins = []
    for k, item in enumerate(bins_raw):
        parsed = _parse_bin(item, f"{path}.{BINS}[{k}]", mixed_sources, problems)
        if parsed is not None:
            bins.append(parsed)
    if len(bins) != len(bins_raw) or serial is None or stream is None:
        return None
    serials = [b.serial for b in bins]
    if len(set(serials)) != len(serials):
        problems.at(f"{path}.{BINS}", f"bin serials repeat ({serials})")
        return None
    if bins and serial <= max(serials):
        k = serials.index(max(serials))
        problems.at(f"{path}.{SERIAL}", f"must be greater than every bin's serial (got {serial}; "
                    f"{path}.{BINS}[{k}].{SERIAL} is {serials[k]})")
        return None
    if mixed_sources:
        before = problems.count
        check_bin_values(tuple(bins), path, TOKEN_SOURCES, 0, mixed_sources, "source ids", problems)
        if problems.count > before:
            return None
    return PackerState(context.packing, stream, tuple(bins), serial)


def parse_window_packer(raw: Any, path: str, problems: Problems, context: RecordContext) -> Optional[PackerState]:
    """A windowed best-fit packer: ``{stream, window: {version, index, emitted}}``; ``emitted`` is
    checked against the window's outputs when the restore reads it (it needs the data)."""
    entry = BEST_FIT_WINDOW.fields(raw, path, problems)
    if entry is None:
        return None
    stream = parse_cursor(entry[STREAM], f"{path}.{STREAM}", problems)
    where = f"{path}.{WINDOW}"
    window = fields_of(entry[WINDOW], where, WINDOW_KEYS, problems)
    if window is None:
        return None
    version = json_int(window[VERSION], f"{where}.{VERSION}", problems)
    readable = BEST_FIT_WINDOW.readable
    if version is not None and version not in readable:
        problems.at(f"{where}.{VERSION}", f"must be one of {list(readable)}, the window record versions "
                    f"this Zephon reads (got {version}): the checkpoint is from a newer Zephon")
        return None
    index = json_int(window[INDEX], f"{where}.{INDEX}", problems)
    emitted = json_int(window[EMITTED], f"{where}.{EMITTED}", problems)
    if stream is None or None in (version, index, emitted):
        return None
    return PackerState(context.packing, stream, window=WindowPosition(version, index, emitted))


def _parse_bin(raw: Any, path: str, mixed_sources: int, problems: Problems) -> Optional[Bin]:
    """Per-bin work is a few Python operations and one array conversion per id list: a
    restore holds up to ``L x best_fit_open_bins`` bins, and value ranges are checked for
    all bins of a packer at once (:func:`check_bin_values`)."""
    keys = (SERIAL, TOKENS, PIECE_STARTS, DOC_STARTS) + ((TOKEN_SOURCES,) if mixed_sources else ())
    entry = fields_of(raw, path, keys, problems, optional=BIN_FEATURES + (PIECE_ORIGINS,))
    if entry is None:
        return None
    serial = json_int(entry[SERIAL], f"{path}.{SERIAL}", problems)
    tokens = id_array(entry[TOKENS], f"{path}.{TOKENS}", problems)
    sources = id_array(entry[TOKEN_SOURCES], f"{path}.{TOKEN_SOURCES}", problems) if mixed_sources else None
    starts = {name: int_list(entry[name], f"{path}.{name}", problems) for name in (PIECE_STARTS, DOC_STARTS)}
    if serial is None or tokens is None or (mixed_sources and sources is None) or None in starts.values():
        return None
    pieces, docs = [int(p) for p in starts[PIECE_STARTS]], [int(d) for d in starts[DOC_STARTS]]
    size = len(tokens)
    ok = True
    if size == 0:
        problems.at(f"{path}.{TOKENS}", "an open bin holds at least one token (got an empty list)")
        return None
    # Each rule names the first item that breaks it.
    if not pieces:
        problems.at(f"{path}.{PIECE_STARTS}", "must list where each piece starts, from 0 (got an empty list)")
        ok = False
    for k, start in enumerate(pieces):
        if not 0 <= start < size or (k == 0 and start != 0) or (k and start <= pieces[k - 1]):
            problems.at(f"{path}.{PIECE_STARTS}[{k}]", f"piece starts must begin at 0 and increase strictly inside "
                        f"the bin's {size} tokens (got {start})")
            ok = False
            break
    if ok:
        piece_set = set(pieces)
        for k, start in enumerate(docs):
            if start not in piece_set or (k and start < docs[k - 1]):
                problems.at(f"{path}.{DOC_STARTS}[{k}]", "document starts must be piece starts (a document begins "
                            f"a piece), in increasing order (got {start}; piece starts {show(pieces)})")
                ok = False
                break
    if sources is not None and len(sources) != size:
        problems.at(f"{path}.{TOKEN_SOURCES}", f"must have one entry per token ({size}; got {len(sources)})")
        ok = False
    features = []
    for name in BIN_FEATURES:
        if name not in entry:
            continue
        values = id_array(entry[name], f"{path}.{name}", problems)
        if values is None:
            ok = False
        elif len(values) != size:
            problems.at(f"{path}.{name}", f"must have one entry per token ({size}; got {len(values)})")
            ok = False
        else:
            low, high = FEATURES[name].value_range or (values.min(), values.max())
            bad = np.flatnonzero((values < low) | (values > high))
            if len(bad):
                problems.at(f"{path}.{name}[{int(bad[0])}]", f"must be in [{low}, {high}] (got {int(values[bad[0]])})")
                ok = False
            features.append((name, values))
    origins = _parse_origins(entry[PIECE_ORIGINS], f"{path}.{PIECE_ORIGINS}", len(pieces), problems) \
        if PIECE_ORIGINS in entry else None
    if PIECE_ORIGINS in entry and origins is None:
        ok = False
    return Bin(serial, tokens, pieces, docs, sources, tuple(features), origins) if ok else None


def _parse_origins(value: Any, path: str, pieces: int, problems: Problems) -> Optional[tuple]:
    """A bin's ``piece_origins``: one ``[epoch, block, offset]`` of integers >= 0 per piece."""
    if not isinstance(value, list) or len(value) != pieces:
        problems.at(path, f"must be a list of {pieces} [epoch, block, offset] cursors, one per piece "
                    f"(got {show(value)})")
        return None
    origins = []
    for k, item in enumerate(value):
        if isinstance(item, np.ndarray):
            item = item.tolist()
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            problems.at(f"{path}[{k}]", f"must be [epoch, block, offset] (got {show(item)})")
            return None
        values = [json_int(x, f"{path}[{k}][{j}]", problems) for j, x in enumerate(item)]
        if None in values:
            return None
        origins.append(tuple(values))
    return tuple(origins)


def check_bin_values(bins: tuple, path: str, name: str, low: int, high: int, what: str, problems: Problems) -> None:
    """Every bin's ``name`` array (tokens or token_sources) in ``[low, high)``: one pass over
    all bins of a packer; the first bad item of the first bad bin is named."""
    arrays = [getattr(b, name) for b in bins]
    if not arrays:
        return
    joined = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
    if not len(joined) or (int(joined.min()) >= low and int(joined.max()) < high):
        return
    for k, array in enumerate(arrays):
        bad = np.flatnonzero((array < low) | (array >= high))
        if len(bad):
            problems.at(f"{path}.{BINS}[{k}].{name}[{int(bad[0])}]",
                        f"{what} must be in [{low}, {high - 1}] (got {int(array[bad[0]])})")
            return


CONCAT = register_record(RecordType(name="concat", version=1, keys=(STREAM,), parse=parse_concat))
BEST_FIT = register_record(RecordType(name="best_fit", version=2, keys=(STREAM, BINS, SERIAL), parse=parse_best_fit,
                                      # a version-1 bin is a version-2 bin without piece_origins
                                      migrations={1: lambda raw: raw}))
BEST_FIT_WINDOW = register_record(RecordType(name="best_fit_window", version=WINDOW_STATE_VERSION,
                                             keys=(STREAM, WINDOW), parse=parse_window_packer))
