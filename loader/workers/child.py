"""A worker process: produce the items of its lanes into shared-memory slots, on command.

Started by :class:`loader.workers.pool.WorkerPool` as a fresh ``python -c`` interpreter
(not ``multiprocessing``: that would re-import the training script, torch and all, in every
worker); it imports only what producing needs and is ready before the trainer asks for a
batch. It lives as long as its loader: a restore sends it a new ``start`` instead of
starting a new process.

Protocol (``multiprocessing.connection`` framing over two pipes)::

    trainer -> worker   ("start", run_id, input_path, start_position, kept slots)
                                                            lanes, states: in a private file
                        ("stop",)                                       or end-of-file: exit
    worker -> trainer   ("ready", pid)
                        ("items", run_id, slot or None, descriptor)     see loader.workers.messages,
                                                            or one micro-batch: loader.workers.batches
                        ("error", run_id, traceback text, pickled ZephonError or None)
                                                            (loader.workers.error_relay)

Slots go back to the worker through their flag bytes in the segment
(:mod:`loader.workers.shm`), not through the pipe. A ``start`` reclaims every slot but the
kept ones (the trainer has dropped the old run's items; it may still hold micro-batches as
views of the kept slots, :mod:`loader.workers.held`, and gives those back later). The worker
exits when the trainer's end of the command pipe closes, so it never outlives a trainer
killed with SIGKILL; writing to a trainer that is gone ends it too (BrokenPipeError).
"""

from __future__ import annotations

import fcntl
import os
import pickle
import signal
from multiprocessing.connection import Connection

import numpy as np

from loader.kinds.base import import_kind_modules
from loader.stages.producer import End, build_lanes, produce, start_reading
from loader.workers.batches import produce_batches
from loader.workers.error_relay import error_message
from loader.workers.messages import write_message
from loader.workers.pipes import PipeWaiter
from loader.workers.shm import SENT, Segment
from loader.workers.state_delta import StateEncoder

# ``python -c`` program that starts a worker: it reads its setup from the command pipe with
# the standard library only, so that the trainer's sys.path is in place before any import.
BOOTSTRAP = (
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "commands = Connection(int(sys.argv[1]), writable=False)\n"
    "messages = Connection(int(sys.argv[2]), readable=False)\n"
    "setup = commands.recv()\n"
    "sys.path[:0] = [p for p in setup['sys_path'] if p not in sys.path]\n"
    "from loader.workers.child import main\n"
    "main(commands, messages, setup)\n"
)


# How long a worker with no free slot waits before it looks again: 1 ms, and once it has waited
# ~0.1 s for one (the trainer evaluates, checkpoints, holds its batches), 2, 4, then 8 ms, so that
# an idle worker does not wake 1000 times a second on the cores the trainer runs on. Not sooner:
# a trainer replaying flat out drains a worker's prefetch (16 micro-batches) in ~2 ms, and a
# worker asleep for 8 ms stalled it.
_SLOT_WAITS_S = (0.001,) * 100 + (0.002, 0.004, 0.008)
WORKER_NICENESS = 5  # the trainer's own thread comes first when the cores are busy
# The message pipe's buffer, then the most an unprivileged process may ask for by default
# (/proc/sys/fs/pipe-max-size). A best-fit message's descriptor carries its lanes' new bin pieces
# (~200 KB per 32 sequences at seq_len 2048): through the default 64 KB buffer the worker blocked
# in every write until the trainer came to read that very message, so it prefetched nothing (72%
# of a worker's wall time in the write, bench/HISTORY.md, "Best fit with 2 workers"). 4 MB holds
# the messages of every slot; the kernel allocates the pages only as they fill.
MESSAGE_PIPE_BYTES = (4 << 20, 1 << 20)


def main(commands: Connection, messages: Connection, setup: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it stops us
    try:
        os.nice(WORKER_NICENESS)
    except OSError:
        pass
    import_kind_modules(setup["kind_modules"])  # the trainer's named lane kinds, before any manifest is read
    segment = Segment.attach(setup["segment_path"], setup["num_slots"], setup["slot_size"], fd=setup["segment_fd"])
    widen_pipe(messages)
    messages.send(("ready", os.getpid()))
    flags = segment.flags
    items_per_message = setup["items_per_message"]
    command_waiter = PipeWaiter(commands)
    run_id = None
    items = None  # the current run's item generator
    segments = True  # the current run's messages carry labels and segment starts
    batches = False  # the current run's messages are whole micro-batches (loader.workers.batches)
    lanes: dict = {}
    waits = 0  # slot waits in a row (_SLOT_WAITS_S)
    try:
        while True:
            # Commands first; block on them when there is nothing to produce.
            while items is None or command_waiter.ready(0):
                try:
                    command = commands.recv()
                except EOFError:  # the trainer is gone
                    return
                kind = command[0]
                if kind == "stop":
                    return
                if kind == "start":
                    _close_lanes(lanes)
                    run_id, input_path, start_position, kept = command[1:]
                    reclaim(flags, kept)
                    try:
                        lanes, items, segments, batches = _start(input_path, start_position)
                    except BaseException:  # noqa: BLE001 - the trainer gets the traceback
                        lanes, items = {}, None
                        messages.send(error_message(run_id))
            slot = segment.free_slot()
            if slot is None:  # `prefetch` messages ahead of the trainer: wait for it
                command_waiter.ready(_SLOT_WAITS_S[min(waits, len(_SLOT_WAITS_S) - 1)])
                waits += 1
                continue
            waits = 0
            try:
                if batches:  # whole micro-batches (loader.workers.batches), endless
                    descriptor = next(items)(segment.view(slot), segment.rows_wanted)
                    flags[slot] = SENT
                    messages.send(("items", run_id, slot, descriptor))
                    continue
                batch = []
                for item in items:
                    batch.append(item)
                    if isinstance(item, End) or len(batch) >= items_per_message:
                        break
                ended = not batch or (isinstance(batch[-1], End) and batch[-1].final)
                sequences = len(batch) - (1 if batch and isinstance(batch[-1], End) else 0)
                if sequences:
                    descriptor = write_message(batch, segment.view(slot), segments)
                    flags[slot] = SENT
                else:
                    slot = None
                    descriptor = write_message(batch, memoryview(b""))
                messages.send(("items", run_id, slot, descriptor))
                if ended:
                    items = None
            except BaseException:  # noqa: BLE001 - everything must reach the trainer, with its traceback
                items = None
                messages.send(error_message(run_id))
    except (BrokenPipeError, ConnectionResetError):  # the trainer is gone
        return
    finally:
        _close_lanes(lanes)


def reclaim(flags, kept: list[int]) -> None:
    """A new run's start: every slot is free again but the ``kept`` ones, which hold micro-batches
    the trainer still reads (their flags are the trainer's to clear)."""
    if not kept:
        flags[:] = 0
        return
    free = np.ones(len(flags), dtype=bool)
    free[kept] = False
    flags[free] = 0


def widen_pipe(connection: Connection, sizes: tuple[int, ...] = MESSAGE_PIPE_BYTES) -> None:
    """Give ``connection``'s pipe a buffer of the first of ``sizes`` the system allows (Linux;
    unprivileged, not above ``/proc/sys/fs/pipe-max-size``); else it keeps its own, and large
    messages wait for the trainer's read."""
    for size in sizes:
        try:
            fcntl.fcntl(connection.fileno(), fcntl.F_SETPIPE_SZ, size)
            return
        except (AttributeError, OSError):  # not Linux, or above the limits
            continue


def _start(input_path: str, start_position: int):
    with open(input_path, "rb") as fh:  # our own file, mode 0600, written by the trainer
        spec, lane_ids, lane_states, num_lanes, rank, world_size, segments, plan, worker_id = pickle.load(fh)
    os.unlink(input_path)
    lanes = build_lanes(spec, lane_ids, lane_states)
    start_reading(lanes, rank + start_position * world_size, num_lanes)  # every lane's block at once
    if plan is not None:
        return lanes, produce_batches(lanes, plan, worker_id, start_position, StateEncoder().ship), segments, True
    items = produce(lanes, num_lanes=num_lanes, rank=rank, world_size=world_size,
                    start_position=start_position, snapshot_state=False, fill_tails=spec.fill_tails)
    return lanes, _with_lane_states(items, lanes, num_lanes), segments, False


def _with_lane_states(items, lanes: dict, num_lanes: int):
    """``items`` with each one's lane state after it, as the worker ships it (deltas of the
    bins sent before, or bare cursors: :meth:`~loader.workers.state_delta.StateEncoder.ship`;
    the pool's decoder for this run rebuilds them)."""
    encoder = StateEncoder()
    for item in items:
        if not isinstance(item, End):
            lane_id = item.global_index % num_lanes
            item.lane_state = encoder.ship(lane_id, lanes[lane_id])
        yield item


def _close_lanes(lanes: dict) -> None:
    for lane in lanes.values():
        lane.close()
