"""``zephon audit --seek-index DIR``: the best-fit replay's lane states, kept as seek points.

Without a checkpoint a best-fit audit replays every lane of the step from step 0 on document
lengths (:mod:`loader.commands.audit_replay`): no formula gives the open bins before a step.
The replay passes through every earlier state anyway, so with ``--seek-index DIR`` it keeps one
every :data:`POINT_EVERY` outputs of each lane, and a later audit of the same run starts each
lane from the last point at or before its step instead of from 0 (an audit of the steps around
a loss spike pays for one replay, not one each).

One JSON file per run: ``DIR/<key>.json``, ``key`` the SHA-256 of the header a resume is checked
against (:func:`run_key`), so a point is never used for another run.
The file is data only (integers, booleans), validated when read, and sealed: it carries an
HMAC-SHA256 of its points under a per-user secret key (:func:`seal_key`, a 0600 file
``$XDG_CONFIG_HOME/zephon/seek-index.key`` created on first use). A plain digest would not be a
seal (whoever edits the file recomputes it); without the key, an edited, re-digested or
truncated file is refused with :class:`SeekIndexError` naming the file, never replayed from.
Whoever can read the key (the user's own account) can still forge a file: the docs say so
(docs/guides/what-is-checked.md). A point used is also checked against the run's lanes (every
cursor and piece names a block of its epoch, :meth:`SeekIndex.check_point`), so an index of
another build of the data cannot index past a lane. Points are
:func:`loader.commands.audit_replay.compact_lane_state` values.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from typing import Any, Optional

from loader.errors import SeekIndexError
from loader.io.cursor_record import BLOCK, EPOCH, EXHAUSTED, OFFSET
from loader.stages.lane_record import PACKER, SOURCES, STOPPED
from loader.stages.packer_records import BINS, SERIAL, STREAM

SEEK_INDEX_VERSION = 2  # 2: an HMAC seal ("hmac_sha256") instead of a plain SHA-256
KEY_FILE = os.path.join("zephon", "seek-index.key")  # under $XDG_CONFIG_HOME (default ~/.config)
POINT_EVERY = 1024  # lane outputs between two points: ~1-3 KB of JSON a point at 16 open bins


def run_key(resume_header: dict) -> str:
    """The run's key: the SHA-256 of the header a resume is checked against
    (``ZephonLoader._expected_header``: config stream fields and fingerprint, each dataset's
    fingerprint, the tokenizer's, lanes, schedule, transforms), so a point is never used for a
    run a checkpoint could not resume."""
    blob = json.dumps({"version": SEEK_INDEX_VERSION, "run": resume_header}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def seal_key() -> bytes:
    """This user's secret seek-index key, created (32 random bytes, mode 0600) on first use."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    path = os.path.join(base, KEY_FILE)
    try:
        with open(path, "rb") as handle:
            key = handle.read()
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        key = secrets.token_bytes(32)
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another audit created it first: use that one
            return seal_key()
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(key)
    if len(key) < 32:
        raise SeekIndexError(f"the seek-index key {path} holds {len(key)} bytes, not 32: delete it (every seek index "
                             "sealed with it is then replayed again)")
    return key


def _seal(lanes: dict) -> str:
    blob = json.dumps(lanes, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(seal_key(), blob, hashlib.sha256).hexdigest()


@dataclass
class SeekIndex:
    """The seek points of one run: ``points[lane_id][outputs] = compact lane state``."""

    path: str
    key: str
    num_sources: int
    points: dict[int, dict[int, dict]] = field(default_factory=dict)
    added: int = 0

    @classmethod
    def open(cls, directory: str, key: str, num_sources: int) -> "SeekIndex":
        path = os.path.join(directory, f"{key}.json")
        index = cls(path, key, num_sources)
        if not os.path.exists(path):
            return index
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except (OSError, ValueError) as exc:
            raise index._error(f"cannot be read as JSON ({type(exc).__name__}: {exc})") from exc
        index._check_document(data)
        index.points = {int(lane): {int(k): point for k, point in points.items()} for lane, points in data["lanes"].items()}
        return index

    def nearest(self, lane_id: int, end: int) -> tuple[int, Optional[dict]]:
        """``(outputs, point)`` of the last point of the lane at or before ``end`` outputs, or ``(0, None)``."""
        points = self.points.get(lane_id, {})
        best = max((k for k in points if k <= end), default=0)
        return (best, points[best]) if best else (0, None)

    def add(self, lane_id: int, outputs: int, point: dict) -> None:
        lane = self.points.setdefault(lane_id, {})
        if outputs not in lane:
            lane[outputs] = point
            self.added += 1

    def save(self) -> None:
        """Write the file if points were added (atomically: a temporary file renamed over it)."""
        if not self.added:
            return
        lanes = {str(lane): {str(k): point for k, point in sorted(points.items())}
                 for lane, points in sorted(self.points.items())}
        data = {"format": "zephon-seek-index", "version": SEEK_INDEX_VERSION, "key": self.key,
                "point_every": POINT_EVERY, "hmac_sha256": _seal(lanes), "lanes": lanes}
        directory = os.path.dirname(self.path) or "."
        os.makedirs(directory, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=directory, prefix=".seek-", suffix=".json")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                json.dump(data, out, separators=(",", ":"))
            os.replace(temporary, self.path)
        except BaseException:
            if os.path.exists(temporary):
                os.unlink(temporary)
            raise
        self.added = 0

    def _error(self, why: str) -> SeekIndexError:
        return SeekIndexError(f"seek index {self.path} {why}; delete the file (the next audit replays and writes it "
                              "again) or pass another --seek-index directory")

    def _check_document(self, data: Any) -> None:
        if not isinstance(data, dict) or data.get("format") != "zephon-seek-index":
            raise self._error("is not a zephon seek index (no \"format\": \"zephon-seek-index\")")
        if data.get("version") != SEEK_INDEX_VERSION:
            raise self._error(f"has version {data.get('version')!r}; this zephon reads version {SEEK_INDEX_VERSION}")
        if data.get("key") != self.key:
            raise self._error("belongs to another run (its key is not the file name's)")
        lanes = data.get("lanes")
        if not isinstance(lanes, dict):
            raise self._error("has no \"lanes\" object")
        seal = data.get("hmac_sha256")
        if not isinstance(seal, str) or not hmac.compare_digest(seal, _seal(lanes)):
            raise self._error("was changed or cut short after it was written, or sealed with another user's key "
                              "(its points do not match their hmac_sha256)")
        for lane, points in lanes.items():
            if not (isinstance(lane, str) and lane.isdigit() and isinstance(points, dict)):
                raise self._error(f"has a malformed entry at lanes.{lane}")
            for outputs, point in points.items():
                where = f"lanes.{lane}.{outputs}"
                if not (outputs.isdigit() and int(outputs) > 0):
                    raise self._error(f"has a malformed point key at {where} (a positive output count)")
                self._check_point(point, where)

    def check_point(self, lane_id: int, outputs: int, point: dict, streams: list) -> None:
        """A point about to be replayed from names only blocks of its lane's epochs."""
        for s, (source, stream) in enumerate(zip(point[SOURCES], streams)):
            at = f"lanes.{lane_id}.{outputs}.sources.{s}.packer"
            packer = source[PACKER]
            cursor = packer[STREAM]
            places = [(cursor[EPOCH], cursor[BLOCK], f"{at}.stream")]
            places += [(p[0], p[1], f"{at}.bins.{b}") for b, bin_ in enumerate(packer[BINS]) for p in bin_[2]]
            max_epochs = stream.max_epochs
            for epoch, block, where in places:
                if max_epochs is not None and epoch > max_epochs:
                    raise self._error(f"has epoch {epoch} at {where} but the source reads {max_epochs} epoch(s)")
                blocks = len(stream.blocks_of_epoch(epoch))
                if block >= blocks:
                    raise self._error(f"has block {block} at {where} but lane {lane_id}'s epoch {epoch} has "
                                      f"{blocks} block(s)")

    def _check_point(self, point: Any, where: str) -> None:
        sources = point.get(SOURCES) if isinstance(point, dict) else None
        if not isinstance(sources, list) or len(sources) != self.num_sources:
            raise self._error(f"has a malformed point at {where}: expected {self.num_sources} sources")
        for s, source in enumerate(sources):
            at = f"{where}.sources.{s}"
            packer = source.get(PACKER) if isinstance(source, dict) else None
            if not isinstance(packer, dict) or not isinstance(source.get(STOPPED), bool):
                raise self._error(f"has a malformed source at {at}")
            stream = packer.get(STREAM)
            if not (isinstance(stream, dict) and all(_count(stream.get(k)) for k in (EPOCH, BLOCK, OFFSET))
                    and isinstance(stream.get(EXHAUSTED), bool)):
                raise self._error(f"has a malformed cursor at {at}.packer.stream")
            if not _count(packer.get(SERIAL)) or not isinstance(packer.get(BINS), list):
                raise self._error(f"has a malformed packer at {at}.packer")
            for b, bin_ in enumerate(packer[BINS]):
                ok = (isinstance(bin_, list) and len(bin_) == 3 and _count(bin_[0]) and _count(bin_[1])
                      and isinstance(bin_[2], list) and bin_[2]
                      and all(isinstance(p, list) and len(p) == 5 and all(_count(v) for v in p[:4])
                              and isinstance(p[4], bool) for p in bin_[2])
                      and sum(p[3] for p in bin_[2]) == bin_[0])
                if not ok:
                    raise self._error(f"has a malformed bin at {at}.packer.bins.{b}")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
