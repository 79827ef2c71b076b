"""Progress of the sharding job while it runs, and a readable summary when it ends.

While it runs: Beam metrics counters in namespace ``zephon.shard`` (shown live by the
Dataflow UI and by ``PipelineResult.metrics()``) and, from every worker process, a
``progress:`` log line at most every ``PROGRESS_INTERVAL_S`` seconds per stage; where the
process sees the whole stage (the local in-memory runner), with the total, the share done and
the time left, from the files done::

    progress: ReadFiles 5 of 12 input files, 34,000 documents, 310 rejected (42%, about 14 s left)
    progress: WriteLaneFiles 40 of at most 64 lane files, 31,880 rows, 9.1 MiB written (62%, about 6 s left)

Counters: ``files_read``, ``documents_read``, ``records_rejected`` (ReadFiles),
``lane_files_written``, ``rows_written``, ``bytes_written``, ``tokens_written``
(WriteLaneFiles), ``duplicate_keys``.

At the end, :class:`ShardSummary` (from the committed manifest, the counters and the wall
time) says what the job did: documents, rejects by reason, bytes read and written, tokens,
time and throughput, and the per-lane balance (min / median / max rows and tokens per lane,
and the largest lane over the mean), e.g.::

    sharded 31,880 documents in 12.4 s (2,571 documents/s) into 64 lanes, 64 files
      input: 12 files, 1.2 GiB; written: 9.1 MiB; tokens: 4,102,331
      rejected: 310 (empty_text=300, malformed_json=10)
      rows per lane: min 441 / median 498 / max 560 (max / mean 1.12)
      tokens per lane: min 57,010 / median 64,100 / max 72,900 (max / mean 1.14)
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from apache_beam.metrics import Metrics

logger = logging.getLogger(__name__)

NAMESPACE = "zephon.shard"
PROGRESS_INTERVAL_S = 10.0


def counter(name: str):
    """A Beam counter of the job's namespace (create it in a DoFn's ``__init__``)."""
    return Metrics.counter(NAMESPACE, name)


class StageProgress:
    """Counts of one stage in this worker process, logged at most every ``interval_s``.

    One per (process, stage) through :func:`stage`; ``add`` is called once per input file or
    lane file, never per document, so the lock is not on a hot path.
    """

    def __init__(self, name: str, interval_s: Optional[float] = None) -> None:
        self.name = name
        self.interval_s = PROGRESS_INTERVAL_S if interval_s is None else interval_s
        self.counts: dict[str, int] = {}
        self.total_files: Optional[int] = None  # the job's total, where this process sees the whole stage
        self._lock = threading.Lock()
        self._last_log = self._started = time.monotonic()

    def expect(self, files: int) -> None:
        """The stage's total of files (input files read, or at most the lane files written), for
        the share done and the time left in its progress lines."""
        with self._lock:
            self.total_files = files
            self._started = time.monotonic()

    def add(self, **counts: int) -> None:
        with self._lock:
            for key, value in counts.items():
                self.counts[key] = self.counts.get(key, 0) + value
            now = time.monotonic()
            if now - self._last_log < self.interval_s:
                return
            self._last_log = now
            line = self.line()
        logger.info("%s", line)

    def line(self) -> str:
        c = self.counts
        files = f"{c.get('files', 0):,}"
        if self.total_files:
            files += f"{' of at most' if self.name != 'ReadFiles' else ' of'} {self.total_files:,}"
        if self.name == "ReadFiles":
            text = f"progress: ReadFiles {files} input files, {c.get('documents', 0):,} documents"
            text += f", {c['rejected']:,} rejected" if c.get("rejected") else ""
        else:
            text = (f"progress: {self.name} {files} lane files, {c.get('rows', 0):,} rows, "
                    f"{human_bytes(c.get('bytes', 0))} written")
        return text + self._share_and_eta()

    def _share_and_eta(self) -> str:
        """``(40%, about 1 min 20 s left)`` from the files done against the total, when known."""
        done = self.counts.get("files", 0)
        if not self.total_files or not done:
            return ""
        share = min(1.0, done / self.total_files)
        left = (time.monotonic() - self._started) * (1 - share) / share
        return f" ({share:.0%}, about {human_seconds(left)} left)"


_stages: dict[str, StageProgress] = {}
_stages_lock = threading.Lock()


def stage(name: str) -> StageProgress:
    """This process's progress of stage ``name`` (worker processes each have their own)."""
    with _stages_lock:
        if name not in _stages:
            _stages[name] = StageProgress(name)
        return _stages[name]


_launcher_pid: Optional[int] = None


def reset_stages() -> None:
    """Forget this process's stage counts (a new job starts: the in-memory runner runs the
    stages in the launching process, job after job); this process is the job's launcher."""
    global _launcher_pid
    with _stages_lock:
        _stages.clear()
        _launcher_pid = os.getpid()


def expect(name: str, files: int) -> None:
    """Stage ``name`` of this job handles ``files`` files in all. Taken only in the launching
    process: with the in-memory runner it runs every stage and sees the whole count; a worker
    process of another runner sees only its share, so its lines show counts without a total."""
    if os.getpid() == _launcher_pid:
        stage(name).expect(files)


def expect_lane_files(files_per_lane: int, num_lanes: int) -> int:
    """``expect`` for WriteLaneFiles once the files per lane are known (a step of the pipeline:
    parts that receive no document have no file, hence "at most")."""
    expect("WriteLaneFiles", files_per_lane * num_lanes)
    return files_per_lane


def human_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {rest} s"
    return f"{minutes // 60} h {minutes % 60} min"


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:,.0f} {unit}" if unit == "B" else f"{count:,.1f} {unit}"
        count /= 1024
    return f"{count} B"  # unreachable


def query_counters(result: Any) -> dict[str, int]:
    """The job's ``zephon.shard`` counters from a finished ``PipelineResult`` (committed values
    where the runner has them, else attempted); empty when the runner reports no metrics."""
    from apache_beam.metrics.metric import MetricsFilter

    try:
        found = result.metrics().query(MetricsFilter().with_namespace(NAMESPACE))
    except Exception:  # a runner without metrics support: the summary comes from the manifest alone
        return {}
    values: dict[str, int] = {}
    for entry in found.get("counters", []):
        value = entry.committed if entry.committed is not None else entry.attempted
        values[entry.key.metric.name] = values.get(entry.key.metric.name, 0) + int(value or 0)
    return values


@dataclass(frozen=True)
class Spread:
    """Min / median / max of a per-lane quantity, and max over mean (1.0: perfectly even)."""

    minimum: int
    median: float
    maximum: int
    max_over_mean: float

    @classmethod
    def of(cls, values: list[int]) -> "Spread":
        if not values:
            return cls(0, 0.0, 0, 0.0)
        mean = sum(values) / len(values)
        return cls(min(values), statistics.median(values), max(values), max(values) / mean if mean else 0.0)

    def text(self) -> str:
        return (f"min {self.minimum:,} / median {self.median:,.0f} / max {self.maximum:,} "
                f"(max / mean {self.max_over_mean:.2f})")


@dataclass(frozen=True)
class ShardSummary:
    documents: int
    rejected: dict[str, int]  # reason -> count (non-zero only)
    seconds: float
    num_lanes: int
    files: int
    bytes_written: int
    input_files: int
    input_bytes: int
    tokens: Optional[int]  # pre-tokenized only
    rows_per_lane: Spread
    tokens_per_lane: Optional[Spread]
    counters: dict[str, int] = field(default_factory=dict)  # the job's Beam counters, as reported
    lanes_note: Optional[str] = None  # how the job chose the lane count (no --num-lanes)

    @classmethod
    def of(cls, manifest, seconds: float, counters: dict[str, int], input_files: int = 0,
           input_bytes: int = 0, lanes_note: Optional[str] = None) -> "ShardSummary":
        """``input_files`` / ``input_bytes``: as listed at launch (the counter ``files_read`` wins
        when the runner reports it)."""
        rows = [0] * manifest.num_lanes
        tokens = [0] * manifest.num_lanes
        for entry in manifest.files:
            rows[entry.lane] += entry.rows
            tokens[entry.lane] += entry.tokens or 0
        return cls(
            documents=manifest.documents, rejected={k: v for k, v in manifest.rejected.items() if v},
            seconds=seconds, num_lanes=manifest.num_lanes, files=len(manifest.files),
            bytes_written=sum(e.bytes for e in manifest.files), input_files=counters.get("files_read", input_files),
            input_bytes=input_bytes, tokens=manifest.total_tokens,
            rows_per_lane=Spread.of(rows), tokens_per_lane=Spread.of(tokens) if manifest.pretokenized else None,
            counters=dict(counters), lanes_note=lanes_note,
        )

    def text(self) -> str:
        rate = f" ({self.documents / self.seconds:,.0f} documents/s)" if self.seconds > 0 else ""
        lines = [f"sharded {self.documents:,} documents in {self.seconds:.1f} s{rate} into {self.num_lanes} lanes, "
                 f"{self.files} files",
                 f"  input: {self.input_files} files, {human_bytes(self.input_bytes)}; written: "
                 f"{human_bytes(self.bytes_written)}" + (f"; tokens: {self.tokens:,}" if self.tokens is not None else "")]
        total_rejected = sum(self.rejected.values())
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.rejected.items()))
        lines.append(f"  rejected: {total_rejected:,}" + (f" ({reasons})" if reasons else ""))
        if self.counters.get("duplicate_keys"):
            lines.append(f"  duplicate keys: {self.counters['duplicate_keys']:,} rows (all kept)")
        if self.lanes_note is not None:
            lines.append(f"  {self.lanes_note}")
        lines.append(f"  rows per lane: {self.rows_per_lane.text()}")
        if self.tokens_per_lane is not None:
            lines.append(f"  tokens per lane: {self.tokens_per_lane.text()}")
        return "\n".join(lines)


class StageTimer:
    """Named stages of a command with their wall times (``zephon quickstart``)."""

    def __init__(self) -> None:
        self.stages: list[tuple[str, float]] = []
        self._name: Optional[str] = None
        self._started = 0.0

    def start(self, name: str) -> None:
        self.stop()
        self._name, self._started = name, time.monotonic()

    def stop(self) -> Optional[float]:
        if self._name is None:
            return None
        seconds = time.monotonic() - self._started
        self.stages.append((self._name, seconds))
        self._name = None
        return seconds

    def table(self) -> str:
        width = max((len(name) for name, _ in self.stages), default=0)
        total = sum(s for _, s in self.stages)
        rows = [f"   {name:<{width}}  {seconds:7.1f} s" for name, seconds in self.stages]
        return "\n".join(rows + [f"   {'total':<{width}}  {total:7.1f} s"])
