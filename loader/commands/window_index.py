"""Window counts of a ``packing_window`` lane: where each window starts and how many outputs it has.

A windowed best-fit lane (:mod:`loader.stages.window_packing`) yields, per window of ``K``
documents, :func:`~loader.order.packing_windows.window_outputs` sequences: a function of the
window's document lengths. So the packer state before a source's ``m``-th output in a lane is
``(start cursor of window w, w, m - P[w])`` where ``P`` is the prefix sum of the counts, found
by a binary search: no bin is packed, no token read. ``zephon audit`` restores that state and
packs only the window the step falls in.

The counts themselves come from a pass over the lane's document lengths (the ``num_tokens``
column, 4 bytes a document; later epochs replay the same row groups in a permuted order, so
each row group is read once) at ``~1 us`` per document. That pass is what "independent of
``N``" costs: it is paid once per (dataset, lane, source, seed, seq_len, ``K``, BOS/EOS) and
kept in a cache file (:func:`cache_dir`), extended lazily when a later audit goes further. An
audit with the counts cached costs the same at step 20 and at step 20,000: a JSON read, a
binary search per lane and source, and one window packed per lane.

Cache files are data only (integers), keyed by the SHA-256 of what the counts depend on and
carrying the SHA-256 of their entries; one that does not match is rebuilt, never used.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import tempfile
from typing import Optional

import numpy as np

from loader.errors import EmptyLaneError, LaneDataError
from loader.io.cursor_record import cursor_state
from loader.order.packing_windows import window_outputs

log = logging.getLogger(__name__)

WINDOW_INDEX_VERSION = 1
EXTEND_DOCUMENTS = 1 << 14  # documents counted at least per extension (~15 ms a lane)
CACHE_ENV = "ZEPHON_WINDOW_CACHE"  # overrides the cache directory (tests, shared machines)


def cache_dir(config_cache_dir: Optional[str] = None) -> str:
    """``$ZEPHON_WINDOW_CACHE``, else ``<cache_dir>/window-counts`` of the loader config, else
    ``$XDG_CACHE_HOME/zephon/window-counts`` (``~/.cache`` by default)."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    if config_cache_dir and "://" not in config_cache_dir:
        return os.path.join(config_cache_dir, "window-counts")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "zephon", "window-counts")


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class WindowIndex:
    """The windows of one (source, lane) stream of lengths (a :class:`~loader.io.provenance.ProvenanceStream`).

    ``starts[w]``: ``(epoch, block, offset)`` of window ``w``'s first document, as the training
    stream's cursor stands there; ``ends[w]``: outputs of windows ``0 .. w`` (the prefix sum).
    """

    def __init__(self, stream, *, seq_len: int, window: int, dataset_fingerprint: str,
                 directory: Optional[str]) -> None:
        self.stream = stream
        self.seq_len = seq_len
        self.window = window
        self.extra = stream.token_format.extra
        self.key = _digest({"version": WINDOW_INDEX_VERSION, "dataset": dataset_fingerprint,
                            "source": stream.source_name, "lane": stream.lane_id, "seed": stream.seed,
                            "seq_len": seq_len, "window": window, "bos": stream.token_format.bos_id is not None,
                            "eos": stream.token_format.eos_id is not None})
        self.path = None if directory is None else os.path.join(directory, f"{self.key}.json")
        self.starts: list[tuple[int, int, int]] = [(0, 0, 0)]
        self.ends: list[int] = []
        self.scanned = 0  # documents counted by this process (0: all came from the cache)
        self._load()

    # -- lookup ------------------------------------------------------------------------
    def locate(self, outputs: int) -> tuple[dict, int, int]:
        """``(stream state, window, emitted)``: the packer state before the source's output
        number ``outputs`` (0-based) in this lane."""
        while not self.ends or self.ends[-1] <= outputs:
            self._extend(outputs)
        w = bisect.bisect_right(self.ends, outputs)
        before = self.ends[w - 1] if w else 0
        epoch, block, offset = self.starts[w]
        return cursor_state(epoch, block, offset, False), w, outputs - before

    # -- the pass over lengths -----------------------------------------------------------
    def _wrapped(self, epoch: int, block: int) -> np.ndarray:
        """Wrapped lengths of the documents of a block, in the order the stream reads them."""
        stream = self.stream
        file_ordinal, row_group = stream.blocks_of_epoch(epoch)[block]
        lengths = stream.lengths(file_ordinal, row_group)
        rows = np.arange(len(lengths), dtype=np.int64)
        if epoch > 0:
            rows = stream._row_order(epoch, file_ordinal, row_group, len(lengths)).astype(np.int64)
        rows = rows[lengths[rows] >= 0]  # offline tombstones: no document
        return lengths[rows] + self.extra

    def _extend(self, outputs: int) -> None:
        """Count windows from the last known start until their outputs pass ``outputs`` (and by at
        least ~16 K documents at a time, so that neighbouring audits rarely extend again)."""
        target_windows = len(self.ends) + max(1, EXTEND_DOCUMENTS // self.window)
        epoch, block, offset = self.starts[-1]
        pending: list[np.ndarray] = []
        pending_docs = 0
        total = self.ends[-1] if self.ends else 0
        empty_blocks = 0  # in a row: a whole epoch of them is a lane without documents, not a loop forever
        while len(self.ends) < target_windows or total <= outputs:
            blocks = len(self.stream.blocks_of_epoch(epoch))
            wrapped = self._wrapped(epoch, block)
            empty_blocks = 0 if len(wrapped) else empty_blocks + 1
            if empty_blocks > blocks:
                raise EmptyLaneError(f"lane {self.stream.lane_id} of source {self.stream.source_name!r}: a whole "
                                     "epoch of row groups without documents; the lane can never produce a sequence")
            bounds = np.cumsum(wrapped)
            first = int(np.searchsorted(bounds, offset, side="right")) if offset else 0
            if offset and (first == 0 or int(bounds[first - 1]) != offset):
                raise LaneDataError(f"window start {(epoch, block, offset)} is not a document start of lane "
                                    f"{self.stream.lane_id} of source {self.stream.source_name!r}: the lane files "
                                    f"changed since the window counts were made; delete {self.path} and audit again")
            k = first
            while k < len(wrapped):
                take = min(self.window - pending_docs, len(wrapped) - k)
                pending.append(wrapped[k:k + take])
                pending_docs += take
                k += take
                if pending_docs == self.window:
                    total += window_outputs(np.concatenate(pending).tolist(), self.seq_len)
                    self.scanned += pending_docs
                    pending, pending_docs = [], 0
                    self.ends.append(total)
                    # the next window's cursor, as the stream's take leaves it (one block advance at a block end)
                    if k < len(wrapped):
                        self.starts.append((epoch, block, int(bounds[k - 1])))
                    elif block + 1 < blocks:
                        self.starts.append((epoch, block + 1, 0))
                    else:
                        self.starts.append((epoch + 1, 0, 0))
            block, offset = block + 1, 0
            if block == blocks:
                epoch, block = epoch + 1, 0
        self._save()

    # -- the cache file ------------------------------------------------------------------
    def _entries(self) -> list:
        return [list(start) + [end] for start, end in zip(self.starts, self.ends)]

    def _load(self) -> None:
        if self.path is None or not os.path.exists(self.path):
            return
        try:
            with open(self.path, encoding="utf-8") as fh:
                data = json.load(fh)
            entries = data["windows"]
            following = data["next"]
            ok = (data.get("key") == self.key and data.get("sha256") == _digest([entries, following])
                  and all(isinstance(e, list) and len(e) == 4 and all(type(x) is int for x in e) for e in entries)
                  and isinstance(following, list) and len(following) == 3 and all(type(x) is int for x in following))
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            log.warning("window index %s does not match its key or checksum: rebuilding it", self.path)
            return
        if entries:
            self.starts = [tuple(e[:3]) for e in entries]
            self.ends = [e[3] for e in entries]
            self.starts.append(tuple(following))

    def _save(self) -> None:
        if self.path is None:
            return
        entries, following = self._entries(), list(self.starts[-1])
        data = {"version": WINDOW_INDEX_VERSION, "key": self.key, "windows": entries, "next": following,
                "sha256": _digest([entries, following])}
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
        with os.fdopen(handle, "w", encoding="utf-8") as fh:
            json.dump(data, fh, separators=(",", ":"))
        os.replace(temporary, self.path)  # atomic: a concurrent reader sees the old file or the new one
