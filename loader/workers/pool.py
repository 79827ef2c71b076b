"""The trainer's side of the worker processes: start them early, feed them runs, read their slots.

A :class:`WorkerPool` starts its processes when the loader is built (they import and map
their shared memory while the trainer sets up its model), keeps them across restores (a
``load_state_dict`` sends a new ``start``, it does not start new processes), and ends them
in :meth:`WorkerPool.shutdown`: the stop command, then SIGTERM, then SIGKILL, so that no
worker outlives the loader whatever state it is in.

Items arrive as views of a worker's shared-memory slot (:mod:`loader.workers.shm`); the
slot goes back to the worker when the trainer has copied the last of its items into a
micro-batch (:class:`~loader.workers.messages.SlotLease`). Micro-batches built whole in a
worker are handed out as views of its slot, which goes back once they are freed
(:mod:`loader.workers.held`).
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Optional, Sequence

from loader.errors import WorkerError
from loader.kinds.base import kind_modules
from loader.workers.child import BOOTSTRAP
from loader.workers.error_relay import worker_exception
from loader.metrics import IO, IoCounters
from loader.workers.batches import read_batches
from loader.workers.held import HELD_BATCHES, HeldViews, MessageLease
from loader.workers.messages import read_message
from loader.workers.pipes import PipeWaiter
from loader.workers.shm import SHM_DIR, Segment, remove_stale_segments, slot_bytes
from loader.workers.state_delta import StateDecoder

log = logging.getLogger(__name__)

# How long shutdown waits for the workers at each step: the stop command, SIGTERM, SIGKILL.
SHUTDOWN_GRACE_S = 2.0
_POLL_S = 0.2


class WorkerProcess:
    """One worker's process, with the ``multiprocessing.Process`` methods shutdown needs."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self._popen = popen
        self.pid = popen.pid

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def exitcode(self) -> Optional[int]:
        return self._popen.poll()

    def _signal(self, signum: int) -> None:
        if self.is_alive():
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def join(self, timeout: Optional[float] = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


# Default prefetch: messages holding this many tokens per worker, at least 4. Text workers
# deliver in bursts (a tokenizer call per lane and ~64 KiB of text); 4 messages of 2048-token
# sequences (64 K tokens, ~40 ms of a 2-worker text loader) ran dry under a busy trainer, 16 did
# not (bench/HISTORY.md, "issue 16, text with workers"). Slots hold ~16 bytes per token: ~4 MB
# per worker by default.
PREFETCH_TOKENS = 256 * 1024
# ...and no more slot room than this per worker beyond the 4 messages (image sources: a slot
# has room for a message's pixels, up to ~125 MB), so /dev/shm holds what it did before.
PREFETCH_SLOT_BYTES = 64 * 1024**2


def default_prefetch(seq_len: int, slot_size: int, items_per_message: int) -> int:
    """``prefetch`` when the config leaves it out: messages of ``PREFETCH_TOKENS`` in all, at
    least 4 (text at seq_len 2048: 16 messages of 8 sequences; pre-tokenized: 4 of 32), and 4
    where a slot is large (``slot_size`` bytes: image sources)."""
    return max(4, min(PREFETCH_TOKENS // (items_per_message * seq_len), PREFETCH_SLOT_BYTES // slot_size))


def slots_per_worker(prefetch: int, items_held: int, items_per_message: int, batches: bool = False) -> int:
    """Messages a worker may have ready (``prefetch``) plus those the trainer holds at most:
    the items of one micro-batch (or of a whole step, when steps are looked ahead) can span
    ``ceil(items / items_per_message) + 1`` messages, plus the one being read; with whole
    micro-batches (``batches``), plus one slot per micro-batch the trainer may hold as views
    (``HELD_BATCHES``: all of them may be this worker's)."""
    return prefetch + math.ceil(items_held / items_per_message) + 2 + (HELD_BATCHES if batches else 0)


class WorkerPool:
    def __init__(self, *, num_workers: int, seq_len: int, prefetch: Optional[int], items_held: int,
                 items_per_message: int, extra_slot_bytes: int = 0, features: Optional[Sequence[str]] = None,
                 batch_slot_bytes: int = 0, io: IoCounters = IO) -> None:
        """``prefetch``: the config's (None: :func:`default_prefetch`); ``items_held``: the items
        the trainer may hold at once (:func:`slots_per_worker`); ``items_per_message``:
        :func:`~loader.workers.messages.items_per_message`; ``batch_slot_bytes``: room for a
        message of micro-batches built in a worker (:mod:`loader.workers.batches`; 0: none is);
        ``io``: the counters the workers' reads are added to (the loader's, :mod:`loader.metrics`)."""
        remove_stale_segments()
        self.io = io
        self.items_per_message = items_per_message
        # extra_slot_bytes: a message's worst-case pixel data (image sources, loader.vision.transfer)
        self.slot_size = max(slot_bytes(seq_len, items_per_message, features) + extra_slot_bytes, batch_slot_bytes)
        self.prefetch = prefetch or default_prefetch(seq_len, self.slot_size, items_per_message)
        self.num_slots = slots_per_worker(self.prefetch, items_held, items_per_message, batches=batch_slot_bytes > 0)
        self.held = HeldViews()  # micro-batches the trainer holds as views of the slots
        self.processes: list[WorkerProcess] = []
        self.commands: list[Connection] = []
        self.messages: list[Connection] = []
        self.waiters: list[PipeWaiter] = []  # one per message pipe
        self.segments: list[Segment] = []
        self.ready = [False] * num_workers
        self.started_at = time.monotonic()  # for raise_if_slow_to_start
        self.run_id = 0
        self.decoders: list[StateDecoder] = []  # the current run's, one per worker
        self.input_dir = tempfile.mkdtemp(prefix="zephon-workers-")
        env = dict(os.environ)
        # The tokenizer's thread pool in each worker gets its share of the cores, not all of them.
        env.setdefault("RAYON_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_workers)))
        env.setdefault("TOKENIZERS_PARALLELISM", "true")
        try:
            for worker_id in range(num_workers):
                self._start_process(worker_id, env)
        except BaseException:
            self.shutdown_parts(self.processes, self.commands, self.messages, self.segments, self.input_dir)
            raise

    def _start_process(self, worker_id: int, env: dict) -> None:
        segment = Segment.create(self.num_slots, self.slot_size, worker_id)
        self.segments.append(segment)
        command_r, command_w = os.pipe()
        message_r, message_w = os.pipe()
        segment_fd = os.open(segment.path, os.O_RDWR)  # the worker maps it by descriptor, not by name
        try:
            popen = subprocess.Popen(
                [sys.executable, "-c", BOOTSTRAP, str(command_r), str(message_w)],
                pass_fds=(command_r, message_w, segment_fd), stdin=subprocess.DEVNULL, env=env,
            )
        finally:
            os.close(command_r)
            os.close(message_w)
            os.close(segment_fd)
        # Mapped here, open in the worker: the name can go now, so that a kill -9 of the trainer
        # from here on leaves nothing in /dev/shm (only this instant's window remains, for
        # remove_stale_segments of the next loader).
        segment.unlink()
        self.processes.append(WorkerProcess(popen))
        self.commands.append(Connection(command_w, readable=False))
        self.messages.append(Connection(message_r, writable=False))
        self.waiters.append(PipeWaiter(self.messages[-1]))
        # The worker imports the modules of the named lane kinds (loader.kinds.base.kind_modules):
        # it is a fresh interpreter, where only the built-in kinds are registered.
        self.commands[-1].send({
            "sys_path": list(sys.path), "kind_modules": kind_modules(), "segment_path": segment.path,
            "segment_fd": segment_fd,
            "num_slots": self.num_slots, "slot_size": self.slot_size,
            "items_per_message": self.items_per_message,
        })

    def all_ready(self) -> bool:
        """Whether every worker has started (never blocks): "ready" is each one's first message."""
        for worker_id, connection in enumerate(self.messages):
            if not self.ready[worker_id]:
                try:
                    if not self.waiters[worker_id].ready(0):
                        return False
                    message = connection.recv()
                except (EOFError, OSError):
                    return False  # dead: healthy() says so, receive() raises
                if message[0] != "ready":
                    raise RuntimeError(f"internal error: worker {worker_id}'s first message is {message[0]!r}")
                self._mark_ready(worker_id)
        return True

    def _mark_ready(self, worker_id: int) -> None:
        self.ready[worker_id] = True
        self.segments[worker_id].unlink()  # already gone (_start_process); idempotent

    def raise_if_dead(self) -> None:
        for worker_id, process in enumerate(self.processes):
            if not process.is_alive():
                raise self._died(worker_id)

    def raise_if_slow_to_start(self, timeout_s: float) -> None:
        """A worker that has not started ``timeout_s`` after the pool did (stopped, stuck in an
        import or on storage) is an error, as a worker that stops producing later is: the
        trainer would otherwise go on producing in-process forever and never hand over."""
        if time.monotonic() - self.started_at <= timeout_s or self.all_ready():
            return
        waiting = [w for w, ready in enumerate(self.ready) if not ready]
        pids = [self.processes[w].pid for w in waiting]
        raise WorkerError(f"loader worker(s) {waiting} (pid {pids}) did not start within {timeout_s:.0f} s "
                          "(worker_timeout_s): stopped, or stuck starting up (imports, storage)?")

    def healthy(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    # -- runs ------------------------------------------------------------------------------
    def start_run(self, spec, lanes_per_worker: list[list[int]], lane_states: dict[int, dict], *,
                  num_lanes: int, rank: int, world_size: int, start_position: int, segments: bool = True,
                  plan=None) -> None:
        """Every worker drops what it was doing and produces from ``start_position``;
        ``segments``: whether its messages carry labels and segment starts
        (:func:`~loader.workers.messages.write_message`); ``plan``: a
        :class:`~loader.workers.batches.BatchPlan` when the workers build whole micro-batches
        (``lanes_per_worker`` then the plan's)."""
        self.run_id += 1
        kept = self.held.keep()  # slots of micro-batches the trainer still holds: not reclaimed
        # Each worker's encoder starts anew too (loader.workers.state_delta).
        self.decoders = [StateDecoder(spec.source_names, spec.token_mixing) for _ in lanes_per_worker]
        for worker_id, lane_ids in enumerate(lanes_per_worker):
            path = os.path.join(self.input_dir, f"run-{self.run_id}-worker-{worker_id}.pickle")
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as fh:
                states = {l: lane_states[l] for l in lane_ids if l in lane_states}
                pickle.dump((spec, lane_ids, states, num_lanes, rank, world_size, segments, plan, worker_id), fh,
                            protocol=pickle.HIGHEST_PROTOCOL)
            self._send(worker_id, ("start", self.run_id, path, start_position, kept.get(worker_id, [])))

    def want_rows(self, wanted: bool) -> None:
        """Tell every worker whether to ship bulk rows for the trainer to collate
        (:attr:`~loader.workers.shm.Segment.rows_wanted`)."""
        for segment in self.segments:
            segment.rows_wanted = wanted

    def end_run(self) -> None:
        """Messages and leases of the current run are ignored from now on."""
        self.run_id += 1

    def _send(self, worker_id: int, command) -> None:
        try:
            self.commands[worker_id].send(command)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass  # the worker is dead: receive() reports it

    def receive(self, worker_id: int, timeout_s: float) -> list:
        """The items of the next message of ``worker_id``'s current run (views of its slot)."""
        connection = self.messages[worker_id]
        waiter = self.waiters[worker_id]
        process = self.processes[worker_id]
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if not waiter.ready(_POLL_S):
                    if not process.is_alive():
                        raise self._died(worker_id)
                    if time.monotonic() > deadline:
                        raise WorkerError(
                            f"loader worker {worker_id} produced nothing for {timeout_s:.0f} s "
                            "(worker_timeout_s); storage stalled?"
                        )
                    continue
                message = connection.recv()
            except (EOFError, OSError):  # its write end closed: it died, maybe mid-message
                process.join(timeout=1.0)
                raise self._died(worker_id) from None
            items = self._items_of(worker_id, message)
            if items is not None:
                return items

    def try_receive(self, worker_id: int) -> Optional[list]:
        """:meth:`receive` if a message of the current run has arrived, else None (never blocks)."""
        connection = self.messages[worker_id]
        waiter = self.waiters[worker_id]
        try:
            while waiter.ready(0):
                items = self._items_of(worker_id, connection.recv())
                if items is not None:
                    return items
        except (EOFError, OSError):
            self.processes[worker_id].join(timeout=1.0)
            raise self._died(worker_id) from None
        return None

    def _items_of(self, worker_id: int, message) -> Optional[list]:
        """A message's items, None for an earlier run's message (its slot was reclaimed by the new start)."""
        # "ready" never arrives here: a run is started only after all_ready() took it.
        kind, run_id = message[0], message[1]
        if run_id != self.run_id:
            return None
        if kind == "error":
            raise worker_exception(worker_id, message, WorkerError)
        slot, descriptor = message[2], message[3]
        decode = self.decoders[worker_id].decode
        if descriptor.get("kind") == "batch":  # whole micro-batches (loader.workers.batches)
            segment = self.segments[worker_id]
            return read_batches(descriptor, segment.view(slot), lambda count: MessageLease(
                worker_id, slot, count, lambda lease: self._give_back(segment, run_id, slot, lease.kept)), decode, self.io)
        if slot is None:
            return read_message(descriptor, memoryview(b""), None, decode, self.io)
        segment = self.segments[worker_id]
        return read_message(descriptor, segment.view(slot), lambda: self._give_back(segment, run_id, slot), decode,
                            self.io)

    def _give_back(self, segment: Segment, run_id: int, slot: int, kept: bool = False) -> None:
        # A later start has reclaimed every slot already, but those it was told the trainer keeps
        # (loader.workers.held); a closed segment has no flags left to clear (batches held past close).
        if (kept or run_id == self.run_id) and segment.mapped:
            segment.flags[slot] = 0

    def _died(self, worker_id: int) -> WorkerError:
        process = self.processes[worker_id]
        if process.exitcode == -signal.SIGBUS:  # a write to a segment of a full tmpfs
            return WorkerError(
                f"loader worker {worker_id} (pid {process.pid}) died of SIGBUS: shared memory ({SHM_DIR}) is full, "
                "so a page of its segment could not be allocated; enlarge it (docker run --shm-size=2g) or lower "
                "num_workers or prefetch, and check what else fills it"
            )
        return WorkerError(
            f"loader worker {worker_id} (pid {process.pid}) died with exit code {process.exitcode} "
            "without reporting an error (killed, or out of memory?)"
        )

    # -- shutdown --------------------------------------------------------------------------
    def shutdown(self) -> None:
        self.shutdown_parts(self.processes, self.commands, self.messages, self.segments, self.input_dir)

    @staticmethod
    def shutdown_parts(processes: list, commands: list, messages: list, segments: list,
                       input_dir: Optional[str]) -> None:
        """Stop, then SIGTERM, then SIGKILL: every worker is gone (and reaped) when this returns.

        A worker that does not react to the stop command or to SIGTERM (stopped by SIGSTOP, a
        frozen cgroup, stuck in native code) would otherwise outlive the loader. Each
        escalation waits at most ``SHUTDOWN_GRACE_S`` for all workers together. Static, with
        the parts as arguments, so that a ``weakref.finalize`` can run it without the pool.
        """
        for connection in commands:
            try:
                connection.send(("stop",))
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass
            connection.close()  # end-of-file for a worker that missed the stop
        for escalate in (None, "terminate", "kill"):
            alive = [p for p in processes if p.is_alive()]
            if not alive:
                break
            for process in alive:
                if escalate is not None:
                    getattr(process, escalate)()
            deadline = time.monotonic() + SHUTDOWN_GRACE_S
            for process in alive:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():  # SIGKILL is not refused: only an unkillable (D-state) process is left
                log.error("loader worker pid %s did not exit after SIGKILL", process.pid)
        for connection in messages:
            connection.close()
        for segment in segments:
            segment.unlink()
            segment.close()
        if input_dir is not None:
            shutil.rmtree(input_dir, ignore_errors=True)
