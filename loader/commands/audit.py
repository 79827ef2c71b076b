"""``zephon audit CONFIG --step N``: where every token of a global step came from.

For every sequence of global step ``N`` (or one, ``--sequence I``: its position in the
global batch) the report lists its pieces in order: source, lane, document key, lane file,
row group and row, the token span taken from the document and where it sits in the
sequence, then the padding. Spans count the *wrapped* document, ``[BOS] ids [EOS]`` as the
config adds them, so ``wrapped[start:end] == input_ids[position:position + length]``.

It never runs the training pipeline, and iterates from step 0 only where neither a seek nor
a checkpoint can place the lanes (``replay``, with a notice). The lanes of step ``N`` are rebuilt on
:class:`~loader.io.provenance.ProvenanceStream` streams, which read document *lengths*
(``num_tokens``, 4 bytes a document) and carry each token's document and offset as
audit-only per-token features, and are brought to their state before step ``N`` like a
resume, by one of four methods (the report names the one used):

``seek`` (concat packing, endless sources, sequence mixing or one source)
    Each output of a concat lane takes exactly ``seq_len`` tokens, and which source a lane's
    outputs came from is a pure function of the global index (:mod:`loader.order.mixing`),
    so a source's cursor before step ``N`` is token ``count x seq_len`` of its lane, epoch
    after epoch. The epoch and file come from the manifest (tokens and rows per file); only
    the ``num_tokens`` column of the row groups of the one file the cursor falls in is read.
    Cost: ``O(N x B)`` integer work for the mixing counts (none for one source; about 3.5 s
    for 41,233 steps of ``B = 1024`` over two sources on two cores) and at most one file's
    ``num_tokens`` per lane and source, whatever ``N``.
``checkpoint`` (``--load-state`` with a merged state at step ``S <= N``; any packing)
    The saved cursors are restored and the lanes produce steps ``S .. N-1`` on lengths only;
    the recorded mixture schedule is adopted as on a resume. A best-fit state's open bins say
    where each piece came from (``piece_origins``, state version 2: the stream cursor of its
    first token), and each piece is resolved to its document by the lengths of that one row
    group (:meth:`~loader.io.provenance.ProvenanceStream.piece_features`). Cost: the
    ``num_tokens`` of the row groups of the open bins' pieces and of those steps ``S .. N``
    pass through. A version-1 state has no origins: the audit replays instead (under the
    adopted schedule) and its notes say so. ``--load-state DIR`` takes the newest state at or
    before ``N`` of a directory (:mod:`loader.checkpoint.files`; e.g. a Trainer output_dir).
``window`` (best fit with ``packing_window``, endless sources, no checkpoint; text lanes too)
    A windowed lane's state before a source's ``m``-th output is the start of the window
    holding it and the bins of that window already emitted; the windows' output counts are a
    function of document lengths (:mod:`loader.commands.window_index`), counted once and cached
    in files bound to the dataset's (and a text lane's tokenizer's) fingerprint and the config,
    so the audit packs only the window of step ``N`` per lane and source (after counting that
    window again to check the cache). Cost with the counts cached: the same at every ``N``; the
    first audit of a dataset pays one pass over the lengths of the documents before ``N`` (a
    text lane's row groups tokenized once each; the report's notes say how many it counted).
``replay`` (no usable checkpoint, and best fit, token mixing, sources that stop or have ``max_epochs``)
    A seek is impossible: which open bin a document joins depends on every earlier document
    of the lane (token mixing: the next document's source on the tokens drawn before; a
    stopping source: the fallbacks after it stops). The lanes produce every earlier output on
    lengths only, after a notice (:func:`replay_notice`: why, how many outputs and documents,
    a rough time). Cost: ``num_tokens`` of every row group the lanes passed through (each
    read once: later epochs reuse them) and packer CPU proportional to the documents before
    step ``N`` in those lanes; no token is decoded.

Then the step's sequences are produced, and only for the row groups their documents lie in
are the ``key`` column (and, with ``--text``, ``input_ids``) read. Text lanes (tokenized
online) have no lengths on disk: ``seek`` and ``replay`` would tokenize every earlier
document, so they are refused unless ``--load-state`` gives a usable checkpoint (then the row
groups from it to step ``N``, and those of its open bins' pieces, are tokenized) or the config
has a ``packing_window`` (``window``: its counts are tokenized once and cached). Sources with
online transforms or online chat rendering (whose documents change as they are read) are
refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Optional, Sequence

import numpy as np

from loader.checkpoint.files import newest_state_at_or_before
from loader.checkpoint.state import lane_key
from loader.cli import run_command
from loader.commands import audit_replay
from loader.commands.fingerprints import read_state_file
from loader.commands.seek_index import POINT_EVERY, SeekIndex, run_key
from loader.commands.window_index import WindowIndex, cache_dir
from loader.config import LoaderConfig
from loader.errors import AuditError, LaneExhausted
from loader.io.cursor_record import cursor_state
from loader.io.manifest import Manifest
from loader.io.provenance import AUDIT_FEATURES, EPOCH_SHIFT, ROW_MASK, ProvenanceStream, ReadLog
from loader.order.mixing import batch_assignments
from loader.order.ordering import lane_outputs_before
from loader.stages.lane import Lane
from loader.stages.tokenizer import load_tokenizer
from loader.stages.lane_record import MIXED, PACKER, SOURCES, lane_state
from loader.stages.packer_records import BINS, DOC_STARTS, PIECE_ORIGINS, PIECE_STARTS, SERIAL, TOKEN_SOURCES, TOKENS, \
    concat_packer_state, window_packer_state

METHODS = ("seek", "checkpoint", "replay", "window")


@dataclass
class Piece:
    """A run of consecutive tokens of one document inside a sequence."""

    position: int  # first position in the sequence
    length: int
    source: str
    lane: int
    key: str  # the document key
    file: str  # lane file, relative to the dataset
    row_group: int
    row: int  # row in the file (row_group's rows included)
    epoch: int
    start: int  # span [start, end) in the wrapped document ([BOS] ids [EOS])
    end: int
    document_tokens: int  # wrapped length of the document
    text: Optional[str] = None  # --text: the span decoded


@dataclass
class SequenceAudit:
    position: int  # in the global batch
    global_index: int
    lane: int
    source: str  # the sequence's source (majority source under token mixing)
    pieces: list[Piece] = field(default_factory=list)
    padding_start: int = 0  # padding runs from here to seq_len
    padding: int = 0


@dataclass
class StepAudit:
    step: int
    global_batch_size: int
    seq_len: int
    packing: str
    method: str
    reads: dict[str, int]  # row groups read, per column
    sequences: list[SequenceAudit]
    notes: list[str] = field(default_factory=list)  # why this method, what it cost (replay, fallbacks)
    state_step: Optional[int] = None  # the checkpoint's step (method checkpoint, or a replay's adopted schedule)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def text(self) -> str:
        lines = [f"step {self.step}: {len(self.sequences)} sequence(s) of {self.seq_len} tokens "
                 f"({self.packing} packing); lane states by {self.method}; row groups read: "
                 + ", ".join(f"{column} {count}" for column, count in self.reads.items())]
        lines += [f"note: {note}" for note in self.notes]
        for seq in self.sequences:
            lines.append(f"sequence {seq.position}  global index {seq.global_index}  lane {seq.lane}  "
                         f"source {seq.source}  pieces {len(seq.pieces)}  padding {seq.padding}")
            for p in seq.pieces:
                line = (f"  [{p.position:>6}, {p.position + p.length:>6})  {p.source}  {p.key}  "
                        f"{p.file} row group {p.row_group} row {p.row}  epoch {p.epoch}  "
                        f"tokens [{p.start}, {p.end}) of {p.document_tokens}")
                if p.text is not None:
                    line += f"  {p.text!r}"
                lines.append(line)
            if seq.padding:
                lines.append(f"  [{seq.padding_start:>6}, {seq.padding_start + seq.padding:>6})  padding")
        return "\n".join(lines)


# -- lane states ---------------------------------------------------------------------------
def _lane_class():
    """``Lane`` on provenance streams (imported late: the lane pulls in pyarrow and tokenizers)."""
    return type("AuditLane", (Lane,), {"stream_class": ProvenanceStream})


def source_counts_before(schedule, num_sources: int, global_batch_size: int, num_lanes: int,
                         step: int) -> np.ndarray:
    """``[lane, source]``: outputs of each source in each lane over steps ``0 .. step-1``, from the
    mixing decisions alone (no fallback: only valid while every source still has data)."""
    counts = np.zeros((num_lanes, num_sources), dtype=np.int64)
    if num_sources == 1:
        for lane in range(num_lanes):
            counts[lane, 0] = _lane_outputs_before(step * global_batch_size, lane, num_lanes)
        return counts
    block = max(1, 65536 // global_batch_size)
    for first in range(0, step, block):
        steps = range(first, min(step, first + block))
        assigned = batch_assignments([schedule.weights_at(t) for t in steps], global_batch_size, first,
                                     schedule.seed).reshape(-1).astype(np.int64)
        lanes = (first * global_batch_size + np.arange(len(assigned), dtype=np.int64)) % num_lanes
        counts += np.bincount(lanes * num_sources + assigned, minlength=num_lanes * num_sources).reshape(
            num_lanes, num_sources)
    return counts


def _lane_outputs_before(global_index: int, lane: int, num_lanes: int) -> int:
    return lane_outputs_before(global_index, lane, num_lanes)


def concat_cursor(stream: ProvenanceStream, position: int) -> Optional[dict]:
    """The stream state at wrapped token ``position`` of the lane's endless stream, or None
    past its last epoch. Reads the lengths of the row groups of one file at most, or of every
    file when the lanes hold tombstones (``zephon shard --transform``) and documents are wrapped:
    a file's rows then overcount its documents, whose BOS/EOS are in the stream."""
    extra = stream.token_format.extra
    if extra and stream.tombstone_transforms:
        file_tokens = [sum(stream.block_tokens(f, g) for g in range(stream.lane_files.num_row_groups(f)))
                       for f in range(len(stream.files))]
    else:
        file_tokens = [(entry.tokens or 0) + extra * entry.rows for entry in stream.files]
    epoch, rest = divmod(position, sum(file_tokens))
    if stream.max_epochs is not None and epoch >= stream.max_epochs:
        return None
    blocks = stream.blocks_of_epoch(epoch)
    k = 0
    while k < len(blocks):
        file_ordinal = blocks[k][0]
        groups = stream.lane_files.num_row_groups(file_ordinal)
        if rest >= file_tokens[file_ordinal]:
            rest -= file_tokens[file_ordinal]
            k += groups
            continue
        for j in range(k, k + groups):
            tokens = stream.block_tokens(*blocks[j])
            if rest < tokens:
                return cursor_state(epoch, j, rest, False)
            rest -= tokens
        break
    raise AuditError(f"lane {stream.lane_id} of source {stream.source_name!r}: the manifest's token counts "
                     "do not match the lane files' num_tokens (corrupt dataset?); run `zephon inspect` on it")


def choose_method(loader, has_state: bool, bins_resolvable: bool = True) -> str:
    """``seek``, ``checkpoint``, ``window`` or ``replay`` (see the module docstring); ``bins_resolvable``:
    every open best-fit bin of the state says where its pieces came from (``piece_origins``)."""
    config = loader.config
    # Online transforms and online chat rendering change documents (drop them, change their
    # tokens) as they are read: their lengths are not the lane files' num_tokens.
    rewritten = [s.name for s, m in zip(loader.spec.sources, loader.manifests)
                 if getattr(s, "transforms", ()) or getattr(m, "online_chat", False)]
    if rewritten:
        raise AuditError(
            f"sources {rewritten} are transformed or rendered as they are read (online transforms, online chat): "
            "the length of each document is known only after that, which zephon audit does not replay; audit a "
            "config without them, or apply them offline (`zephon shard --transform ...`, chat with --tokenizer)")
    text_lanes = [n for n, m in zip(loader.source_names, loader.manifests) if not m.pretokenized]
    finite = any(d.exhaustion == "stop" or d.max_epochs is not None for d in config.datasets)
    token_mixing = config.mixing_unit == "token" and len(loader.source_names) > 1
    if has_state and bins_resolvable:
        return "checkpoint"
    if config.packing_window is not None and not finite:  # text lanes too: their counts are cached
        return "window"
    if text_lanes:
        raise AuditError(
            f"sources {text_lanes} are text lanes tokenized online: their document lengths are not on disk, so "
            "auditing a step without a checkpoint would tokenize every earlier document"
            + (" and this checkpoint's best-fit bins do not say where their pieces came from (a version-1 "
               "checkpoint, or bins restored from one)" if has_state else "")
            + "; pass --load-state with a checkpoint of the run at or before the step (saved by this Zephon: "
            "version 2), or re-shard the sources pre-tokenized (`zephon shard ... --tokenizer FILE`), or pack "
            "with packing_window (whose window counts are tokenized once and cached)")
    if config.packing == "concat" and not finite and not token_mixing:
        return "seek"
    return "replay"


def _open_bins(state: dict) -> tuple[int, int]:
    """``(open best-fit bins, those without piece_origins)`` of a state (checked on load before)."""
    total = unknown = 0
    for lane in state.get("lanes", {}).values():
        packers = [lane[MIXED]] if MIXED in lane else [s[PACKER] for s in lane.get(SOURCES, {}).values()]
        for packer in packers:
            for bin_ in packer.get(BINS, ()):
                total += 1
                unknown += PIECE_ORIGINS not in bin_
    return total, unknown


def _resolved_lane_state(lane, state: dict) -> dict:
    """A saved lane state for the audit's lane: each open bin's pieces become their documents'
    provenance (:meth:`ProvenanceStream.piece_features` of its ``piece_origins``; zeros for the
    tokens, as the audit's streams have), reading the lengths of those row groups only."""
    streams = lane.source_streams()
    path = f"lanes.{lane_key(lane.lane_id)}"
    if MIXED in state:
        return dict(state, **{MIXED: _resolved_packer(state[MIXED], streams, f"{path}.mixed", mixed=True)})
    sources = {}
    for source, stream in zip(lane.spec.sources, streams):
        saved = state[SOURCES][source.name]
        sources[source.name] = dict(saved, **{PACKER: _resolved_packer(
            saved[PACKER], [stream], f"{path}.sources.{source.name}.packer", mixed=False)})
    return dict(state, **{SOURCES: sources})


def _resolved_packer(packer: dict, streams: list, path: str, *, mixed: bool) -> dict:
    if not packer.get(BINS):
        return packer
    bins = []
    for k, saved in enumerate(packer[BINS]):
        tokens = len(saved[TOKENS])
        starts = [int(x) for x in saved[PIECE_STARTS]] + [tokens]
        doc_starts = np.asarray(saved[DOC_STARTS], dtype=np.int64)
        parts: dict[str, list] = {"audit_document": [], "audit_offset": []}
        for j, (origin, lo, hi) in enumerate(zip(saved[PIECE_ORIGINS], starts[:-1], starts[1:])):
            stream = streams[int(saved[TOKEN_SOURCES][lo])] if mixed else streams[0]
            inside = doc_starts[(doc_starts >= lo) & (doc_starts < hi)] - lo
            features = stream.piece_features(origin, hi - lo, inside, f"{path}.bins[{k}].piece_origins[{j}]")
            for name, values in features.items():
                parts[name].append(values)
        resolved = {SERIAL: saved[SERIAL], TOKENS: np.zeros(tokens, dtype=np.int32),
                    PIECE_STARTS: saved[PIECE_STARTS], DOC_STARTS: saved[DOC_STARTS],
                    PIECE_ORIGINS: saved[PIECE_ORIGINS],
                    **{name: np.concatenate(values) for name, values in parts.items()}}
        if mixed:
            resolved[TOKEN_SOURCES] = saved[TOKEN_SOURCES]
        bins.append(resolved)
    return dict(packer, **{BINS: bins})


# Lengths-only replay speed, documents per second of CPU on the shared 2-core dev machine
# (`python bench/audit_replay.py --steps 3000`: best fit on integers ~370-420K, through the
# lane ~30K, concat ~650K); only to say roughly what a replay will cost. Best fit under token
# mixing replays through the lane (its deficit rule is the mixer's own).
REPLAY_DOCUMENTS_PER_S = {"best_fit": 300_000, "best_fit_token_mixing": 25_000, "concat": 500_000}


def replay_notice(loader, step: int, lane_ids: Sequence[int]) -> str:
    """Why the lanes of ``step`` must be replayed from step 0, and what that costs."""
    config = loader.config
    token_mixing = config.mixing_unit == "token" and len(loader.source_names) > 1
    reasons = []
    if config.packing == "best_fit" and config.packing_window is None:
        reasons.append("best-fit packing: which open bin a document joins, and when a bin is emitted, depends on every "
                       "earlier document of the lane, so the open bins before a step cannot be computed from the step "
                       "number")
    if token_mixing:
        reasons.append("token mixing: which source a lane's next document comes from depends on the tokens of the "
                       "lane's earlier documents in the schedule phase")
    if any(d.exhaustion == "stop" or d.max_epochs is not None for d in config.datasets):
        reasons.append("sources that stop (exhaustion \"stop\" or max_epochs): once one stops, a lane's outputs fall "
                       "back to the others, which depends on its earlier outputs")
    outputs = sum(_lane_outputs_before(step * config.global_batch_size, lane, loader.num_lanes) for lane in lane_ids)
    documents = sum(m.documents for m in loader.manifests)
    wrapped = sum(m.total_tokens or 0 for m in loader.manifests) + loader.spec.token_format.extra * documents
    estimate = ""
    if wrapped and documents:
        count = int(outputs * config.seq_len * documents / wrapped)
        rate = REPLAY_DOCUMENTS_PER_S["best_fit_token_mixing" if token_mixing and config.packing == "best_fit"
                                      else config.packing]
        estimate = f", about {count:,} documents ({_duration(count / rate)} at ~{rate:,} documents/s)"
    return (f"cannot seek to step {step} ({'; '.join(reasons)}): replaying the {outputs:,} earlier outputs of "
            f"{len(lane_ids)} lane(s) on document lengths{estimate}, reading num_tokens of every row group they pass "
            "through. To start from a checkpoint instead, pass --load-state with the run's checkpoint file or "
            "directory (the newest state at or before the step is used)")


def _duration(seconds: float) -> str:
    if seconds < 1:
        return "under a second"
    if seconds < 120:
        return f"roughly {seconds:.0f} s"
    if seconds < 7200:
        return f"roughly {seconds / 60:.0f} min"
    return f"roughly {seconds / 3600:.1f} h"


# -- the audit -----------------------------------------------------------------------------
def audit_step(config: LoaderConfig, step: int, *, sequence: Optional[int] = None,
               load_state: Optional[dict] = None, text: bool = False,
               notice: Optional[Callable[[str], None]] = None, seek_index: Optional[str] = None) -> StepAudit:
    """The provenance of every token of global step ``step`` (see the module docstring).

    ``notice`` is called with each of the report's notes as soon as it is known (the command
    line prints them to stderr before a long replay starts). ``seek_index``: a directory where
    a best-fit replay keeps its lane states and starts from them (:mod:`loader.commands.seek_index`;
    not with ``load_state``, whose schedule may not be the config's)."""
    from loader.pipeline import ZephonLoader  # torch: after the arguments are checked

    B = config.global_batch_size
    if sequence is not None and not 0 <= sequence < B:
        raise AuditError(f"--sequence {sequence}: a position in the global batch, in [0, {B - 1}]")
    # model_inputs lays batches out for a model; the audit reads the loader's own batches (same stream)
    loader = ZephonLoader(config.replace(num_workers=0, read_ahead=False, model_inputs=None), rank=0, world_size=1)
    try:
        start_step = 0
        if load_state is not None:
            loader.load_state_dict(load_state)  # every field checked; adopts the recorded schedule
            start_step = loader.step
            if start_step > step:
                raise AuditError(f"--load-state resumes at step {start_step}, after --step {step}: pass a "
                                 "checkpoint taken at or before the step")
        bins, unknown = _open_bins(load_state) if load_state is not None else (0, 0)
        method = choose_method(loader, load_state is not None, not unknown)
        token_mixing = config.mixing_unit == "token" and len(loader.source_names) > 1
        features = AUDIT_FEATURES + (("token_sources",) if token_mixing else ())
        spec = replace(loader.spec, features=features, read_ahead=False)
        positions = range(B) if sequence is None else [sequence]
        indices = [step * B + p for p in positions]
        L = loader.num_lanes
        lane_ids = sorted({i % L for i in indices})
        notes: list[str] = []
        if load_state is not None and method == "replay":
            notes.append(f"the checkpoint (step {start_step}) holds {unknown} of its {bins} open best-fit bins without "
                         "piece origins (a version-1 checkpoint, or bins restored from one), so they cannot be resolved "
                         "to documents: replaying from step 0 instead, under the checkpoint's mixture schedule")
        index = None
        if method == "replay" and seek_index is not None and load_state is None:
            index = SeekIndex.open(seek_index, run_key(loader._expected_header()), len(loader.source_names))
        if method == "replay":
            starts = {lane_id: index.nearest(lane_id, _lane_outputs_before(step * B, lane_id, L))[0]
                      for lane_id in lane_ids} if index is not None else {}
            if starts and all(starts.values()):
                notes.append(f"best-fit replay from the seek index {index.path}: lane output(s) "
                             f"{', '.join(f'{lane}: {k:,}' for lane, k in sorted(starts.items()))} onwards")
            else:
                notes.append(replay_notice(loader, step, lane_ids)
                             + ("" if index is None else f"; keeping seek points in {index.path}"))
        for note in notes if notice is not None else ():
            notice(note)
        lanes = _build(spec, lane_ids, loader)
        if method == "checkpoint":
            first_index = start_step * B
            for lane_id, lane in lanes.items():
                lane.set_state(_resolved_lane_state(lane, loader.lane_states[lane_id]))
        else:
            first_index = 0
        if method == "seek":
            counts = source_counts_before(spec.schedule, len(spec.sources), B, L, step)
            for lane_id, lane in lanes.items():
                lane.set_state(_seek_state(lane, counts[lane_id], config.seq_len, step * B))
        elif method == "window":
            counts = source_counts_before(spec.schedule, len(spec.sources), B, L, step)
            scanned, rebuilt = 0, []
            for lane_id, lane in lanes.items():
                state, counted, why = _window_state(lane, counts[lane_id], loader, step * B)
                lane.set_state(state)
                scanned += counted
                rebuilt += why
            tokenized = " (tokenized for their lengths)" if any(not m.pretokenized for m in loader.manifests) else ""
            notes.extend(f"packing_window: window count file {why}" for why in rebuilt)
            notes.append(f"packing_window: lane states from window counts ({cache_dir(config.cache_dir)}); "
                         + (f"counted the windows of {scanned:,} documents now{tokenized} (kept for later audits)"
                            if scanned else "every count was cached"))
        else:
            for lane_id, lane in lanes.items():  # produce the lane's outputs before the step
                first = _lane_outputs_before(first_index, lane_id, L)
                end = _lane_outputs_before(step * B, lane_id, L)
                if method == "replay":  # best fit on integers (audit_replay); None: token mixing, concat
                    start, keep = None, {}
                    if index is not None:
                        first, start = index.nearest(lane_id, end)
                        if start is not None:
                            index.check_point(lane_id, first, start, lane.source_streams())
                        keep = dict(point_every=POINT_EVERY,
                                    on_point=lambda k, point, lane_id=lane_id: index.add(lane_id, k, point))
                    try:
                        replayed = audit_replay.replayed_lane_state(lane, first, end, start=start, **keep)
                    except LaneExhausted:
                        raise AuditError(f"step {step} is past the end of the data (lane {lane_id} ends before its "
                                         f"output {end})") from None
                    if replayed is not None:
                        lane.set_state(_resolved_lane_state(lane, replayed))
                        continue
                for k in range(first, end):
                    try:
                        lane.next_sequence(k * L + lane_id)
                    except LaneExhausted:
                        raise AuditError(f"step {step} is past the end of the data (lane {lane_id} ends at output "
                                         f"{k})") from None
        if index is not None:
            index.save()
        sequences = []
        wanted = set(indices)
        for global_index in range(step * B, (step + 1) * B):
            lane_id = global_index % L
            if lane_id not in lanes:
                continue
            lane = lanes[lane_id]
            try:
                source_id, packed = lane.next_sequence(global_index)
            except LaneExhausted:
                raise AuditError(f"step {step} is past the end of the data (lane {lane_id} has no output for "
                                 f"global index {global_index})") from None
            if global_index in wanted:
                sequences.append(_sequence_audit(global_index - step * B, global_index, lane, source_id, packed))
        tokenizer = None
        if text:
            tokenizer = load_tokenizer(config.tokenizer, config.storage_options())
        log = ReadLog()
        for lane in lanes.values():
            for stream in lane.source_streams():
                log.reads.extend(stream.reads.reads)
        _fill_documents(sequences, lanes, loader, tokenizer, log)
        reads = {column: log.count(column) for column in dict.fromkeys(r[4] for r in log.reads)}
        for lane in lanes.values():
            lane.close()
        return StepAudit(step=step, global_batch_size=B, seq_len=config.seq_len, packing=config.packing,
                         method=method, reads=reads, sequences=sequences, notes=notes,
                         state_step=start_step if load_state is not None else None)
    finally:
        loader.close()


def _build(spec, lane_ids: list[int], loader) -> dict:
    from tokenizers import Tokenizer


    tokenizer = Tokenizer.from_str(spec.tokenizer_json) if spec.tokenizer_json is not None else None
    manifests = [Manifest.from_json(s.manifest_json, s.dataset_path) for s in spec.sources]
    lane_class = _lane_class()
    return {lane_id: lane_class(spec, lane_id, manifests, tokenizer) for lane_id in lane_ids}


def _seek_state(lane, counts: np.ndarray, seq_len: int, step_index: int) -> dict:
    packers = []
    for source, stream, count in zip(lane.spec.sources, lane.source_streams(), counts.tolist()):
        cursor = concat_cursor(stream, count * seq_len)
        if cursor is None:  # cannot happen for endless sources (choose_method)
            raise AuditError(f"source {source.name!r} has no data left in lane {lane.lane_id}")
        packers.append(concat_packer_state(cursor))
    return lane_state(lane.spec.source_names, False, _lane_outputs_before(step_index, lane.lane_id, lane.num_lanes),
                      packers, [False] * len(packers))


def _window_state(lane, counts: np.ndarray, loader, step_index: int) -> tuple[dict, int, list[str]]:
    """The lane's state before global index ``step_index`` from its window counts, how many
    documents had to be counted for it (0: all cached) and why cache files were not used."""
    config = loader.config
    directory = cache_dir(config.cache_dir)
    packers, scanned, rebuilt = [], 0, []
    for source, stream, manifest, count in zip(lane.spec.sources, lane.source_streams(), loader.manifests,
                                               counts.tolist()):
        index = WindowIndex(stream, seq_len=config.seq_len, window=config.packing_window, directory=directory,
                            dataset_fingerprint=manifest.dataset_fingerprint or manifest.compute_fingerprint(),
                            tokenizer_fingerprint=loader.tokenizer_fingerprint)
        cursor, window, emitted = index.locate(count)
        index.check_window(window)  # the window packed next, counted again from the lane files
        scanned += index.scanned
        rebuilt += [index.rebuilt] if index.rebuilt else []
        packers.append(window_packer_state(cursor, window, emitted))
    outputs = _lane_outputs_before(step_index, lane.lane_id, lane.num_lanes)
    return lane_state(lane.spec.source_names, False, outputs, packers, [False] * len(packers)), scanned, rebuilt


def _sequence_audit(position: int, global_index: int, lane, source_id: int, packed) -> SequenceAudit:
    names = [s.name for s in lane.spec.sources]
    documents = packed.features["audit_document"]
    offsets = packed.features["audit_offset"]
    token_sources = packed.features.get("token_sources")
    used = documents != -1
    padding_start = int(np.flatnonzero(~used)[0]) if (~used).any() else len(documents)
    # A piece starts where the document changes or its offsets stop being consecutive.
    starts = np.flatnonzero(np.concatenate([[True], (documents[1:] != documents[:-1])
                                            | (offsets[1:] != offsets[:-1] + 1)]) & used)
    ends = np.append(starts[1:], padding_start)
    audit = SequenceAudit(position=position, global_index=global_index, lane=lane.lane_id, source=names[source_id],
                          padding_start=padding_start, padding=len(documents) - padding_start)
    for lo, hi in zip(starts.tolist(), ends.tolist()):
        hi = min(hi, padding_start)
        code = int(documents[lo])
        sid = int(token_sources[lo]) if token_sources is not None else source_id
        audit.pieces.append(Piece(position=lo, length=hi - lo, source=names[sid], lane=lane.lane_id, key="",
                                  file="", row_group=-1, row=code & ROW_MASK, epoch=code >> EPOCH_SHIFT,
                                  start=int(offsets[lo]), end=int(offsets[lo]) + hi - lo, document_tokens=0))
    return audit


def _fill_documents(sequences: list[SequenceAudit], lanes: dict, loader, tokenizer, log: ReadLog) -> None:
    """Keys (and with ``tokenizer``, decoded spans) of the pieces' documents: one read of the
    ``key`` column (and ``input_ids``/``text``) per row group the step's documents lie in."""
    names = [s.name for s in loader.spec.sources]
    columns: dict[tuple, dict[str, list]] = {}
    for seq in sequences:
        for piece in seq.pieces:
            stream = lanes[piece.lane].source_streams()[names.index(piece.source)]
            where = stream.locate(piece.row)  # piece.row holds the lane row until here
            group_key = (piece.source, piece.lane, where.file_ordinal, where.row_group)
            if group_key not in columns:
                wanted = ["key"] + (["input_ids" if stream.pretokenized else "text"] if tokenizer is not None else [])
                table = stream.lane_files.parquet(where.file_ordinal).read_row_group(where.row_group, columns=wanted,
                                                                          use_threads=False)
                for column in wanted:
                    log.note(piece.source, piece.lane, where.path, where.row_group, column)
                columns[group_key] = {c: table.column(c).to_pylist() for c in wanted}
            group = columns[group_key]
            length = int(stream.lengths(where.file_ordinal, where.row_group)[where.row_in_group])
            piece.key = group["key"][where.row_in_group]
            piece.file, piece.row_group, piece.row = where.path, where.row_group, where.row_in_file
            piece.document_tokens = length + stream.token_format.extra
            if tokenizer is not None:
                piece.text = tokenizer.decode(_wrapped_ids(group, where.row_in_group, stream, tokenizer)[
                    piece.start:piece.end], skip_special_tokens=False)


def _wrapped_ids(group: dict, row: int, stream, tokenizer) -> list[int]:
    if "input_ids" in group:
        value = group["input_ids"][row]
        ids = np.frombuffer(value, "<i4").tolist() if isinstance(value, bytes) else list(value or [])
    else:
        ids = tokenizer.encode(group["text"][row] or "", add_special_tokens=False).ids
    fmt = stream.token_format
    return ([fmt.bos_id] if fmt.bos_id is not None else []) + ids + ([fmt.eos_id] if fmt.eos_id is not None else [])


# -- command line ----------------------------------------------------------------------------
def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zephon audit",
        description="List where every token of a global step came from: source, lane, document key, lane file "
                    "and row, the span taken from the document, its place in the sequence, and the padding.",
    )
    parser.add_argument("config", help="loader config file (.toml or .json) of the run")
    parser.add_argument("--step", type=int, required=True, help="the global step to audit (>= 0)")
    parser.add_argument("--sequence", type=int, default=None,
                        help="only this sequence: its position in the global batch (0 .. B-1)")
    parser.add_argument("--load-state", metavar="FILE|DIR",
                        help="a merged checkpoint of the run at or before the step (JSON, as written by "
                             "`zephon fingerprints --save-state`, the HF integration or global_state_dict()), or a "
                             "directory of them (*.json and */*.json, e.g. a Trainer output_dir of "
                             "checkpoint-N/zephon_state.json): the newest at or before the step is used. Its "
                             "cursors and open best-fit bins are restored, its mixture schedule adopted, and only "
                             "the steps from it to --step are produced")
    parser.add_argument("--seek-index", metavar="DIR",
                        help="best fit without --load-state: keep the replay's lane states in DIR (one JSON file "
                             "per run, a point every 1,024 outputs of a lane) and start later audits of the same "
                             "run from the last point at or before their step instead of from step 0")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--text", action="store_true", help="also decode each piece's tokens to text")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_command("audit", argv)


def command(argv: Sequence[str]) -> int:
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    if args.step < 0:
        parser.error(f"--step must be >= 0 (got {args.step})")
    config = LoaderConfig.from_file(args.config)
    load_state = None
    found = []
    if args.load_state:
        path = args.load_state
        if os.path.isdir(path):
            saved = newest_state_at_or_before(path, config.global_batch_size, args.step)
            if saved is None:
                found.append(f"--load-state {path}: no checkpoint at or before step {args.step}, so none is used")
            else:
                found.append(f"--load-state {path}: using {saved.path} (step {saved.step}), the newest checkpoint at "
                             f"or before step {args.step}")
            _print_notice(found[-1])
            path = None if saved is None else saved.path
        if path is not None:
            load_state = read_state_file(path)
    report = audit_step(config, args.step, sequence=args.sequence, load_state=load_state, text=args.text,
                        notice=_print_notice, seek_index=args.seek_index)
    report.notes[:0] = found
    print(report.to_json() if args.json else report.text())
    return 0


def _print_notice(note: str) -> None:
    print(f"zephon audit: {note}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
