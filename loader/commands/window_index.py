"""Window counts of a ``packing_window`` lane: where each window starts and how many outputs it has.

A windowed best-fit lane (:mod:`loader.stages.window_packing`) yields, per window of ``K``
documents, :func:`~loader.order.packing_windows.window_outputs` sequences: a function of the
window's document lengths. So the packer state before a source's ``m``-th output in a lane is
``(start cursor of window w, w, m - P[w])`` where ``P`` is the prefix sum of the counts, found
by a binary search: no bin is packed, no token read. ``zephon audit`` restores that state and
packs only the window the step falls in.

The counts come from a pass over the lane's document lengths: the ``num_tokens`` column of
pre-tokenized lanes (4 bytes a document), or, for text lanes (tokenized online), the lengths
of the ``text`` column tokenized by the run's tokenizer (one batched call per row group, lengths
only: the same call the training stream makes, so the same lengths). Later epochs replay the
same row groups in a permuted order, so each row group is read (and tokenized) once per pass.
That pass is what "independent of ``N``" costs: it is paid once and kept in a cache file
(:func:`cache_dir`), extended lazily when a later audit goes further. An audit with the counts
cached costs the same at step 20 and at step 20,000: a JSON read, a binary search per lane and
source, and one window packed per lane.

**What a file is bound to.** Its name is the SHA-256 of its *binding*: the index version, the
dataset fingerprint (content of every lane file), for a text lane the tokenizer fingerprint,
and the source, lane, seed, ``seq_len``, ``K`` and BOS/EOS of the config; the file repeats the
binding in clear and is sealed with an HMAC-SHA256 under this user's secret key (the seek
index's, :func:`loader.commands.seek_index.seal_key`). A file that is not of this binding
(another dataset, tokenizer or config), that is truncated or edited, or that is not sealed
with this user's key, is never used: it is counted again from nothing and rewritten, and the
audit's notes say why (:attr:`WindowIndex.rebuilt`). The window a seek lands in is also
counted again from the lane files before it is used (:meth:`WindowIndex.check_window`): a count
or start that disagrees is a :class:`~loader.errors.WindowCountError` naming the file.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import json
import logging
import os
import tempfile
from typing import Iterator, Optional

import numpy as np

from loader.commands.seek_index import seal_key
from loader.errors import EmptyLaneError, LaneDataError, WindowCountError
from loader.io.backends import is_remote
from loader.io.cursor_record import cursor_state
from loader.order.packing_windows import window_outputs

log = logging.getLogger(__name__)

WINDOW_INDEX_VERSION = 2  # 2: the binding in clear, an HMAC seal, text lanes (tokenizer fingerprint)
EXTEND_DOCUMENTS = 1 << 14  # documents counted at least per extension (~15 ms a lane pre-tokenized)
CACHE_ENV = "ZEPHON_WINDOW_CACHE"  # overrides the cache directory (tests, shared machines)


def cache_dir(config_cache_dir: Optional[str] = None) -> str:
    """``$ZEPHON_WINDOW_CACHE``, else ``<cache_dir>/window-counts`` of the loader config, else
    ``$XDG_CACHE_HOME/zephon/window-counts`` (``~/.cache`` by default)."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    if config_cache_dir and not is_remote(config_cache_dir):
        return os.path.join(config_cache_dir, "window-counts")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "zephon", "window-counts")


def _canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _seal(binding: dict, entries: list, following: list) -> str:
    return hmac.new(seal_key(), _canonical([binding, entries, following]), hashlib.sha256).hexdigest()


class WindowIndex:
    """The windows of one (source, lane) stream of lengths (a :class:`~loader.io.provenance.ProvenanceStream`).

    ``starts[w]``: ``(epoch, block, offset)`` of window ``w``'s first document, as the training
    stream's cursor stands there; ``ends[w]``: outputs of windows ``0 .. w`` (the prefix sum).
    ``tokenizer_fingerprint``: required for a text lane (its lengths are the tokenizer's), unused
    for a pre-tokenized one (the dataset fingerprint covers its ids).
    """

    def __init__(self, stream, *, seq_len: int, window: int, dataset_fingerprint: str,
                 directory: Optional[str], tokenizer_fingerprint: Optional[str] = None) -> None:
        self.stream = stream
        self.seq_len = seq_len
        self.window = window
        self.extra = stream.token_format.extra
        self.binding = {"version": WINDOW_INDEX_VERSION, "dataset": dataset_fingerprint,
                        "source": stream.source_name, "lane": stream.lane_id, "seed": stream.seed,
                        "seq_len": seq_len, "window": window, "bos": stream.token_format.bos_id is not None,
                        "eos": stream.token_format.eos_id is not None}
        if not stream.pretokenized:
            if not tokenizer_fingerprint:
                raise ValueError(f"lane {stream.lane_id} of source {stream.source_name!r} is tokenized online: its "
                                 "window counts need the tokenizer's fingerprint")
            self.binding["tokenizer"] = tokenizer_fingerprint
        self.key = hashlib.sha256(_canonical(self.binding)).hexdigest()
        self.path = None if directory is None else os.path.join(directory, f"{self.key}.json")
        self.starts: list[tuple[int, int, int]] = [(0, 0, 0)]
        self.ends: list[int] = []
        self.scanned = 0  # documents counted by this process (0: all came from the cache)
        self.rebuilt: Optional[str] = None  # why a cache file there was not used
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

    def check_window(self, w: int) -> None:
        """Count window ``w`` again from the lane files (its ``K`` documents' lengths: what the
        audit reads anyway to pack it) and compare with the cache: a mismatch is a
        :class:`WindowCountError` (the file is not of these lane files, whatever its seal says)."""
        cached = self.ends[w] - (self.ends[w - 1] if w else 0)
        count, _, following = next(self._windows_from(*self.starts[w]))
        if count != cached or following != self.starts[w + 1]:
            raise WindowCountError(
                f"window count file {self.path}: window {w} of lane {self.stream.lane_id} of source "
                f"{self.stream.source_name!r} holds {count} outputs and ends at {list(following)} in the lane files, "
                f"but the file says {cached} outputs ending at {list(self.starts[w + 1])}: the lane files changed "
                "under the same dataset fingerprint, or the file was written by someone else with this user's key; "
                "delete the file (the next audit counts the windows again)")

    # -- the pass over lengths -----------------------------------------------------------
    def _wrapped(self, epoch: int, block: int) -> np.ndarray:
        """Wrapped lengths of the documents of a block, in the order the stream reads them."""
        stream = self.stream
        file_ordinal, row_group = stream.blocks_of_epoch(epoch)[block]
        lengths = stream.lengths(file_ordinal, row_group)
        rows = np.arange(len(lengths), dtype=np.int64)
        if epoch > 0:
            rows = stream.lane_files.row_order(epoch, file_ordinal, row_group, len(lengths)).astype(np.int64)
        rows = rows[lengths[rows] >= 0]  # offline tombstones: no document
        return lengths[rows] + self.extra

    def _windows_from(self, epoch: int, block: int, offset: int) -> Iterator[tuple[int, int, tuple[int, int, int]]]:
        """``(outputs, documents, next window's start)`` of each window from the one starting at
        ``(epoch, block, offset)`` on (endless: epochs follow each other)."""
        pending: list[np.ndarray] = []
        pending_docs = 0
        empty_blocks = 0  # in a row: a whole epoch of them is a lane without documents, not a loop forever
        while True:
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
                    count = window_outputs(np.concatenate(pending).tolist(), self.seq_len)
                    # the next window's cursor, as the stream's take leaves it (one block advance at a block end)
                    if k < len(wrapped):
                        following = (epoch, block, int(bounds[k - 1]))
                    elif block + 1 < blocks:
                        following = (epoch, block + 1, 0)
                    else:
                        following = (epoch + 1, 0, 0)
                    yield count, pending_docs, following
                    pending, pending_docs = [], 0
            block, offset = block + 1, 0
            if block == blocks:
                epoch, block = epoch + 1, 0

    def _extend(self, outputs: int) -> None:
        """Count windows from the last known start until their outputs pass ``outputs`` (and by at
        least ~16 K documents at a time, so that neighbouring audits rarely extend again)."""
        target_windows = len(self.ends) + max(1, EXTEND_DOCUMENTS // self.window)
        total = self.ends[-1] if self.ends else 0
        for count, documents, following in self._windows_from(*self.starts[-1]):
            total += count
            self.scanned += documents
            self.ends.append(total)
            self.starts.append(following)
            if len(self.ends) >= target_windows and total > outputs:
                break
        self._save()

    # -- the cache file ------------------------------------------------------------------
    def _entries(self) -> list:
        return [list(start) + [end] for start, end in zip(self.starts, self.ends)]

    def _load(self) -> None:
        if self.path is None or not os.path.exists(self.path):
            return
        why = self._unusable()
        if why is not None:
            self.rebuilt = f"{self.path} {why}: counting its windows again"
            log.warning("window count file %s", self.rebuilt)

    def _unusable(self) -> Optional[str]:
        """Why the cache file cannot be used (None: it is loaded)."""
        try:
            with open(self.path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError) as exc:
            return f"cannot be read as JSON ({exc})"
        if not isinstance(data, dict):
            return "is not a window count file"
        binding = data.get("binding")
        if data.get("version") != WINDOW_INDEX_VERSION or not isinstance(binding, dict):
            return f"is of window index version {data.get('version')!r}, not {WINDOW_INDEX_VERSION}"
        differing = sorted(k for k in set(binding) | set(self.binding) if binding.get(k) != self.binding.get(k))
        if differing:
            return f"was made for another {', '.join(differing)} than this lane's"
        entries, following = data.get("windows"), data.get("next")
        if not (isinstance(entries, list) and all(isinstance(e, list) and len(e) == 4 and all(type(x) is int for x in e)
                                                  for e in entries)
                and isinstance(following, list) and len(following) == 3 and all(type(x) is int for x in following)):
            return "does not hold windows as lists of integers"
        seal = data.get("hmac_sha256")
        if not isinstance(seal, str) or not hmac.compare_digest(seal, _seal(self.binding, entries, following)):
            return "is not sealed by this user's key (its windows do not match their hmac_sha256: edited, " \
                   "truncated, or written on another account)"
        ends = [e[3] for e in entries]
        starts = [tuple(e[:3]) for e in entries] + [tuple(following)]
        if any(b < a for a, b in zip([0] + ends, ends)) or any(b < a for a, b in zip(starts, starts[1:])):
            return "holds windows that are not in stream order"
        if entries:
            self.starts, self.ends = starts, ends
        return None

    def _save(self) -> None:
        if self.path is None:
            return
        entries, following = self._entries(), list(self.starts[-1])
        data = {"version": WINDOW_INDEX_VERSION, "binding": self.binding, "windows": entries, "next": following,
                "hmac_sha256": _seal(self.binding, entries, following)}
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
        with os.fdopen(handle, "w", encoding="utf-8") as fh:
            json.dump(data, fh, separators=(",", ":"))
        os.replace(temporary, self.path)  # atomic: a concurrent reader sees the old file or the new one
