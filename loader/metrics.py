"""Loader metrics: what the trainer was handed, what it waited for, what was read.

``ZephonLoader.metrics()`` returns a :class:`LoaderMetrics`: counters since the loader was
built (``total``) and for the last whole step this rank handed out (``last_step``), each a
:class:`StepCounters`:

=====================  ===================================================================
field                  meaning
=====================  ===================================================================
steps, sequences       steps completed / sequences handed out (this rank)
tokens                 per source: tokens handed out that are not padding (by the
                       sequence's source; under token mixing by each token's source)
supervised_tokens      per source, only when a source has a ``loss_mask``: positions whose
                       label is not -100 (``loss_mask`` 1 and not a document's first token)
padding_tokens         tokens of padding (the padded tail of best-fit and final sequences)
padding_fraction       ``padding_tokens / (sequences x seq_len)``
fill_rows              finite data with filled tails (``epoch_tail = "fill"``): fill rows
                       handed out (rows of lanes already done; their padding is counted too)
rejected               per reason: documents the loader dropped while reading (online chat
                       rejects); the Beam job's rejects are in ``dataset_rejected``
wait_s                 seconds spent inside ``next(loader)`` (what the trainer waited for)
bytes_read             compressed bytes of the Parquet column chunks read (this loader's lanes,
                       its worker processes included: they report with every message)
row_groups_read        row groups read, likewise
cache_hits/misses      lane-file cache (``cache_dir``, remote files) opens served locally / fetched
=====================  ===================================================================

plus ``restores``, ``restore_s`` (seconds of the last ``load_state_dict``),
``first_batch_after_restore_s`` (the wait for the first micro-batch after it) and
``dataset_rejected`` (per source and reason, from the manifests), and with ``balance`` set
``balance`` (:meth:`loader.balanced.Balancer.stats`: the last step's max/mean rank cost, balanced
and as the default layout had it, their means, the exchange's seconds). I/O counters are per
loader: each loader's streams count into its own :class:`IoCounters` (``StreamOwner.io``,
:mod:`loader.io.owner`), so two loaders in one process (a train and an eval loader, simulated
ranks) each report their own reads.

Cost: per micro-batch two clock reads and one pass over its sequences (source id and padding
count of each, no per-token work), the run's totals folded in once per step; per-token work
only where the counts need it (token mixing: a ``bincount`` of the token sources;
``loss_mask``: a comparison over the batch). I/O counters are incremented once per row group
read. ``python -m bench.metrics_overhead`` measures it (docs/guides/audit.md, "Loader metrics").

``metrics_log_every_steps = N`` (loader config) logs :meth:`LoaderMetrics.line` at INFO on
logger ``loader.metrics`` every N steps; :meth:`LoaderMetrics.flat` gives the same numbers
as ``{"zephon/...": float}`` for a framework logger (loader.integrations.hf / lightning).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Iterator, Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)


# -- I/O counters (per loader) ----------------------------------------------------------------
IO_FIELDS = ("bytes_read", "row_groups_read", "cache_hits", "cache_misses")


class IoCounters:
    """The I/O counts of one loader's streams, incremented by the lane reader (once per row group)
    and the lane-file cache (once per file open), from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(IO_FIELDS, 0)
        self._shipped = dict.fromkeys(IO_FIELDS, 0)  # what a worker has reported so far

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                self._values[name] += value

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def delta_to_ship(self) -> Optional[dict[str, int]]:
        """In a worker process: the counts since the last call (None if nothing changed), to
        travel with a message and be added to the trainer's counters (:func:`receive_shipped`)."""
        with self._lock:
            delta = {k: self._values[k] - self._shipped[k] for k in IO_FIELDS}
            if not any(delta.values()):
                return None
            self._shipped = dict(self._values)
            return delta


# The counters of streams built outside a loader (loader.io.owner.PROCESS_OWNER): a worker
# process's streams (one loader's lanes), ``zephon audit``, tests.
IO = IoCounters()

# The counters a thread's file opens count into while a stream opens a lane file
# (:func:`counting_into`): the lane-file cache sits below the storage facade, which knows no loader.
_opening = threading.local()


@contextlib.contextmanager
def counting_into(counters: IoCounters) -> Iterator[None]:
    """Within the block, :func:`active_counters` on this thread is ``counters``."""
    previous = getattr(_opening, "counters", None)
    _opening.counters = counters
    try:
        yield
    finally:
        _opening.counters = previous


def active_counters() -> IoCounters:
    """The counters of the stream opening a file on this thread (:func:`counting_into`), else :data:`IO`."""
    counters = getattr(_opening, "counters", None)
    return IO if counters is None else counters


def note_row_group_read(row_group_metadata, columns: Sequence[str], counters: IoCounters) -> None:
    """One row group read into ``counters``: its compressed bytes of ``columns`` (from the Parquet footer)."""
    size = 0
    for i in range(row_group_metadata.num_columns):
        column = row_group_metadata.column(i)
        if column.path_in_schema in columns:
            size += column.total_compressed_size
    counters.add(bytes_read=size, row_groups_read=1)


def receive_shipped(delta: Optional[dict[str, int]], counters: IoCounters) -> None:
    """In the trainer: add what a worker message reported (its reads since its last message)."""
    if delta:
        counters.add(**delta)


_PADDING = attrgetter("sequence.padding")
_REJECTS = attrgetter("chat_rejects")


# -- counters -------------------------------------------------------------------------------
@dataclass
class StepCounters:
    steps: int = 0
    sequences: int = 0
    tokens: dict[str, int] = field(default_factory=dict)
    supervised_tokens: dict[str, int] = field(default_factory=dict)
    padding_tokens: int = 0
    padding_fraction: float = 0.0
    fill_rows: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    wait_s: float = 0.0
    bytes_read: int = 0
    row_groups_read: int = 0
    cache_hits: int = 0
    cache_misses: int = 0


@dataclass
class LoaderMetrics:
    """``ZephonLoader.metrics()``: see the module docstring for every field."""

    step: int  # the global step of the next micro-batch
    total: StepCounters
    last_step: StepCounters
    restores: int = 0
    restore_s: float = 0.0
    first_batch_after_restore_s: float = 0.0
    dataset_rejected: dict[str, dict[str, int]] = field(default_factory=dict)
    # balance = "attention" (loader.balanced.Balancer.stats): max/mean rank cost, balanced and not
    balance: dict[str, float] = field(default_factory=dict)

    def flat(self, prefix: str = "zephon/") -> dict[str, float]:
        """Scalars for a framework logger: ``zephon/total/tokens/web``, ``zephon/last_step/wait_s``, ..."""
        out: dict[str, float] = {}
        for scope, counters in (("total", self.total), ("last_step", self.last_step)):
            for name, value in vars(counters).items():
                if isinstance(value, dict):
                    for key, count in value.items():
                        out[f"{prefix}{scope}/{name}/{key}"] = float(count)
                else:
                    out[f"{prefix}{scope}/{name}"] = float(value)
        out[f"{prefix}restore_s"] = self.restore_s
        out[f"{prefix}first_batch_after_restore_s"] = self.first_batch_after_restore_s
        for name, value in self.balance.items():
            out[f"{prefix}balance/{name}"] = float(value)
        return out

    def line(self) -> str:
        """One log line: the last step and the totals."""
        last, total = self.last_step, self.total
        tokens = " ".join(f"{k}={v}" for k, v in total.tokens.items())
        text = (f"zephon step {self.step}: last step {sum(last.tokens.values())} tokens, padding "
                f"{last.padding_fraction:.1%}, waited {last.wait_s * 1e3:.1f} ms, read {last.bytes_read} B; "
                f"total tokens {tokens}, padding {total.padding_fraction:.1%}, waited {total.wait_s:.2f} s, "
                f"read {total.bytes_read} B in {total.row_groups_read} row groups, cache hits {total.cache_hits}/"
                f"{total.cache_hits + total.cache_misses}")
        if total.supervised_tokens:
            text += " supervised " + " ".join(f"{k}={v}" for k, v in total.supervised_tokens.items())
        if total.fill_rows:
            text += f" fill rows {total.fill_rows}"
        if total.rejected:
            text += " rejected " + " ".join(f"{k}={v}" for k, v in total.rejected.items())
        if self.restores:
            text += f", last restore {self.restore_s:.2f} s"
        if self.balance:
            text += (f", rank cost max/mean {self.balance['max_over_mean']:.3f} (unbalanced "
                     f"{self.balance['max_over_mean_unbalanced']:.3f})")
        return text


class _Accumulator:
    """Counts of one step (or, folded, of the whole run), as lists indexed by source id."""

    __slots__ = ("steps", "sequences", "tokens", "supervised", "padding", "rejected", "wait_s", "fill")

    def __init__(self, num_sources: int) -> None:
        self.steps = self.sequences = self.padding = self.fill = 0
        self.tokens = [0] * num_sources
        self.supervised = [0] * num_sources
        self.rejected: dict[str, int] = {}
        self.wait_s = 0.0

    def fold(self, other: "_Accumulator") -> None:
        """Add a finished step's counts to these."""
        self.steps += other.steps
        self.sequences += other.sequences
        self.padding += other.padding
        self.fill += other.fill
        self.wait_s += other.wait_s
        for s, count in enumerate(other.tokens):
            self.tokens[s] += count
        for s, count in enumerate(other.supervised):
            self.supervised[s] += count
        _add(self.rejected, other.rejected)

    def counters(self, names: Sequence[str], seq_len: int, supervised: bool, io: dict[str, int]) -> StepCounters:
        slots = self.sequences * seq_len
        return StepCounters(
            steps=self.steps, sequences=self.sequences, tokens=dict(zip(names, self.tokens)),
            supervised_tokens=dict(zip(names, self.supervised)) if supervised else {},
            padding_tokens=self.padding, padding_fraction=self.padding / slots if slots else 0.0,
            fill_rows=self.fill, rejected=dict(self.rejected), wait_s=self.wait_s, **io,
        )


class MetricsRecorder:
    """The accounting behind ``ZephonLoader.metrics()``: the loader calls :meth:`count` once per
    micro-batch with its items and its NumPy arrays, and :meth:`restored` after a restore.

    Per micro-batch only the current step's counts change, in one pass over the items (their
    source ids and padding counts: Python ints, which stay valid after collation released a
    worker's slot); the run's totals are folded in once per step. Per-token work only under
    token mixing (a ``bincount`` of the token sources) and with a ``loss_mask`` (one
    comparison over the micro-batch).
    """

    def __init__(self, *, source_names: Sequence[str], seq_len: int, per_rank_batch: int, supervised: bool,
                 token_mixing: bool, batched_token_sources: bool = True, log_every_steps: int = 0,
                 dataset_rejected: Optional[dict[str, dict[str, int]]] = None, fill_rows: bool = False,
                 io: IoCounters = IO) -> None:
        self.names = tuple(source_names)
        self._io = io  # the loader's streams' counters (loader.io.owner.StreamOwner.io)
        self.fill_rows = fill_rows  # count fill rows (source id -1): finite data with filled tails
        # Token mixing without token_source_ids in the batch: the loader calls keep_token_sources
        # before collation (a worker's slot may be written again once the items are copied out).
        self.copies_token_sources = token_mixing and not batched_token_sources
        self._token_sources: Optional[np.ndarray] = None
        self.seq_len = seq_len
        self.per_rank_batch = per_rank_batch
        self.supervised = supervised
        self.token_mixing = token_mixing
        self.log_every_steps = log_every_steps
        self.dataset_rejected = dataset_rejected or {}
        self._io_start = io.snapshot()
        self._io_step = self._io_start  # at the last step boundary
        self._done = _Accumulator(len(self.names))  # whole steps handed out
        self._current = _Accumulator(len(self.names))
        self._last: Optional[_Accumulator] = None  # the last whole step, not yet in _done
        self._last_io = (self._io_start, self._io_start)  # I/O counters at its start and end
        self.restores = 0
        self.restore_s = 0.0
        self.first_batch_after_restore_s = 0.0
        self._after_restore = False

    def keep_token_sources(self, items: list) -> None:
        self._token_sources = np.stack([it.sequence.features["token_sources"] for it in items])

    def _per_token_sources(self, batch: dict[str, Any]) -> np.ndarray:
        values = batch.get("token_source_ids")
        return self._token_sources if values is None else _numpy(values)

    def count(self, items: list, batch: dict[str, Any], wait_s: float, rank_position: int) -> None:
        """One micro-batch handed out (``batch``: NumPy arrays or the torch tensors sharing them)."""
        current = self._current
        current.wait_s += wait_s
        current.sequences += len(items)
        if self.fill_rows:
            current.fill += sum(item.source_id < 0 for item in items)
        if self.token_mixing:
            self._count_token_sources(self._per_token_sources(batch))
        elif len(current.tokens) == 1:  # one source: the C-level sum is the whole pass
            padding = sum(map(_PADDING, items))
            current.tokens[0] += len(items) * self.seq_len - padding
            current.padding += padding
        else:
            seq_len, tokens, padding = self.seq_len, current.tokens, 0
            for item in items:
                pad = item.sequence.padding
                tokens[item.source_id] += seq_len - pad
                padding += pad
            current.padding += padding
        if any(map(_REJECTS, items)):
            for item in items:
                if item.chat_rejects:
                    _add(current.rejected, item.chat_rejects)
        self._counted(items, batch, wait_s, rank_position)

    def count_rows(self, source_ids: list[int], batch: dict[str, Any], wait_s: float, rank_position: int,
                   padding: Optional[list[int]] = None, rejects: Optional[dict[str, int]] = None) -> None:
        """:meth:`count` of a micro-batch given by its rows' source ids (no fill rows), their
        ``padding`` (None: full rows) and its online ``rejects``: the loader's bulk paths, which
        make no items (in-process concat rows; micro-batches built whole by a worker)."""
        current = self._current
        current.wait_s += wait_s
        current.sequences += len(source_ids)
        seq_len = self.seq_len
        if self.token_mixing:
            self._count_token_sources(self._per_token_sources(batch))
        elif padding is None and len(current.tokens) == 1:
            current.tokens[0] += len(source_ids) * seq_len
        else:
            for source_id, pad in zip(source_ids, padding or [0] * len(source_ids)):
                current.tokens[source_id] += seq_len - pad
                current.padding += pad
        if rejects:
            _add(current.rejected, rejects)
        self._counted(source_ids, batch, wait_s, rank_position)

    def _counted(self, rows: list, batch: dict[str, Any], wait_s: float, rank_position: int) -> None:
        """What :meth:`count` and :meth:`count_rows` share after the token counts; ``rows``: the
        items, or their source ids."""
        if self.supervised:
            self._count_supervised(rows, batch)
        if self._after_restore:
            self.first_batch_after_restore_s = wait_s
            self._after_restore = False
        if rank_position % self.per_rank_batch == 0:  # the step is complete
            self._end_step(rank_position // self.per_rank_batch)

    def _end_step(self, step: int) -> None:
        """Close the current step. Kept cheap (it runs every step): the step's counts are kept as
        they are and folded into the totals when the next step closes; the readable
        :class:`StepCounters` are built only by :meth:`metrics`."""
        current = self._current
        current.steps = 1
        if self._last is not None:
            self._done.fold(self._last)
        self._last = current
        io = self._io.snapshot()
        self._last_io = (self._io_step, io)
        self._io_step = io
        self._current = _Accumulator(len(self.names))
        if self.log_every_steps and step % self.log_every_steps == 0:
            log.info("%s", self.metrics(step).line())

    def _count_token_sources(self, per_token: np.ndarray) -> None:
        current = self._current
        counts = np.bincount(per_token.reshape(-1).astype(np.int64) + 1, minlength=len(self.names) + 1)
        current.padding += int(counts[0])
        for s in range(len(self.names)):
            current.tokens[s] += int(counts[s + 1])

    def _count_supervised(self, items: list, batch: dict[str, Any]) -> None:
        labels, mask = batch.get("labels"), batch.get("loss_mask")
        labels, mask = (None if labels is None else _numpy(labels)), (None if mask is None else _numpy(mask))
        if labels is not None:
            supervised = labels != -100
            if mask is not None:
                supervised &= mask == 1
        elif mask is not None:  # no labels in batch_fields: the loss mask's targets (document starts included)
            supervised = mask == 1
        else:
            return
        if self.token_mixing:
            per_token = self._per_token_sources(batch)
            counts = np.bincount(per_token[supervised].astype(np.int64), minlength=len(self.names))
        else:
            counts = np.zeros(len(self.names), np.int64)
            sources = [r if type(r) is int else r.source_id for r in items]  # items or source ids
            np.add.at(counts, sources, supervised.reshape(len(items), -1).sum(axis=1))
        for s in range(len(self.names)):
            self._current.supervised[s] += int(counts[s])

    def restored(self, seconds: float) -> None:
        self.restores += 1
        self.restore_s = seconds
        self._after_restore = True

    def metrics(self, step: int) -> LoaderMetrics:
        io = self._io.snapshot()
        total = _Accumulator(len(self.names))
        for part in (self._done, self._last, self._current):  # the step in progress too
            if part is not None:
                total.fold(part)
        since_start = {k: io[k] - self._io_start[k] for k in IO_FIELDS}
        start, end = self._last_io
        last = (self._last or _Accumulator(len(self.names))).counters(
            self.names, self.seq_len, self.supervised, {k: end[k] - start[k] for k in IO_FIELDS})
        return LoaderMetrics(step=step, total=total.counters(self.names, self.seq_len, self.supervised, since_start),
                             last_step=last, restores=self.restores, restore_s=self.restore_s,
                             first_batch_after_restore_s=self.first_batch_after_restore_s,
                             dataset_rejected=self.dataset_rejected)


def _numpy(values) -> np.ndarray:
    """A batch field as NumPy (a torch tensor of the batch shares its memory)."""
    return values if isinstance(values, np.ndarray) else values.numpy()


def _add(into: dict[str, int], counts: dict[str, int]) -> None:
    for key, count in counts.items():
        into[key] = into.get(key, 0) + count
