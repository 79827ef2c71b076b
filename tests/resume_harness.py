"""The one resume harness: an uninterrupted run against save/restore cycles, by fingerprint.

Every stateful stage (a lane token stream, a packer, a whole loader of W ranks) is driven
through the same small protocol, :class:`Resumable`, and checked by :func:`check_resume`::

    uninterrupted  make(0):  s0 s1 s2 | s3 s4 s5 s6 | s7 s8 ...      (saves at every cut, keeps going)
    interrupted    make(1):  s0 s1 s2 |                              save -> JSON text -> load
                   make(2):           | s3 s4 s5 s6 |                save -> JSON text -> load
                   make(3):                         | s7 s8 ...

and asserts

* the interrupted run's step fingerprints equal the uninterrupted run's (and ``expected``,
  when given, e.g. a W=1 ``collect_fingerprints`` run);
* every state is JSON text made of JSON primitives only (no pickle, no bytes), and loads
  from that text;
* with ``compare_states`` the state saved at a cut is byte-identical whether the run was
  interrupted or not: a checkpoint does not depend on the topology, worker count or
  prefetch that produced it, and saving does not disturb the stream.

Cut points may repeat (a save/restore cycle with no step between) and may be 0 (a
checkpoint before anything was consumed). Each segment is built by ``make(k)``, so a test
can change the world size, worker count, micro-batch or prefetch at every resume.

Drivers: :class:`LoaderRun` (W rank loaders reassembled into global batches, the same
fingerprint as :func:`loader.commands.fingerprints.collect_fingerprints`), :class:`MaskedLoaderRun`
(the same line plus the step's loss masks) and :class:`StageRun` (any object with
``get_state``/``set_state`` and a function producing its next output).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from loader.config import LoaderConfig
from loader.commands.fingerprints import StepFingerprint, image_bytes_by_row, sequence_bytes
from loader.checkpoint.state import merge_rank_states, to_jsonable

JSON_LEAF_TYPES = (str, int, float, bool, type(None))


class Resumable(Protocol):
    """One incarnation of a run: produce steps, save, load (before producing), close."""

    def run(self, steps: int) -> list[str]:
        """Fingerprints of the next ``steps`` steps; fewer only when the data has ended."""

    def save(self) -> dict:
        """The state as it stands after the steps produced so far."""

    def load(self, state: dict) -> None:
        """Continue from ``state`` (called before :meth:`run`)."""

    def close(self) -> None:
        ...


def assert_plain_json(value: Any, where: str = "state") -> None:
    """Only dicts with str keys, lists and JSON primitives: nothing pickled, no numpy, no bytes."""
    if isinstance(value, dict):
        for key, item in value.items():
            assert isinstance(key, str), f"{where}: non-string key {key!r}"
            assert_plain_json(item, f"{where}.{key}")
    elif isinstance(value, list):
        for k, item in enumerate(value):
            assert_plain_json(item, f"{where}[{k}]")
    else:
        assert type(value) in JSON_LEAF_TYPES, f"{where}: {type(value).__name__} is not a JSON primitive"
        if isinstance(value, str):
            # A pickled or base64-encoded object would show up as a long opaque string.
            assert len(value) <= 256, f"{where}: a {len(value)}-character string in a state (an encoded blob?)"


def json_round_trip(state: dict, where: str = "state") -> dict:
    assert_plain_json(state, where)
    text = json.dumps(state, sort_keys=True)
    loaded = json.loads(text)
    assert loaded == state, f"{where} does not survive a JSON round trip"
    return loaded


@dataclass
class ResumeReport:
    baseline: list[str]
    resumed: list[str]
    states: dict[int, str] = field(default_factory=dict)  # cut -> state JSON (interrupted run)


def check_resume(
    make: Callable[[int], Resumable],
    *,
    steps: int,
    cut_points: Sequence[int],
    expected: Optional[Sequence[str]] = None,
    compare_states: bool = True,
) -> ResumeReport:
    """Run ``steps`` steps uninterrupted with ``make(0)`` and cut at ``cut_points`` with ``make(1..)``."""
    cuts = sorted(cut_points)
    assert all(0 <= c <= steps for c in cuts), f"cut points must lie in [0, {steps}] (got {cuts})"

    baseline: list[str] = []
    baseline_states: dict[int, str] = {}
    run = make(0)
    try:
        position = 0
        for cut in cuts + [steps]:
            baseline += run.run(cut - position)
            position = cut
            if compare_states and cut < steps:
                baseline_states[cut] = _state_text(run.save(), f"uninterrupted state at step {cut}")
    finally:
        run.close()
    if expected is not None:
        _assert_same(list(expected), baseline, "uninterrupted run (make(0)) vs expected")

    resumed: list[str] = []
    states: dict[int, str] = {}
    text: Optional[str] = None
    position = 0
    for k, cut in enumerate(cuts + [steps], start=1):
        run = make(k)
        try:
            if text is not None:
                run.load(json.loads(text))
            produced = run.run(cut - position)
            resumed += produced
            if cut < steps:
                text = _state_text(run.save(), f"state at step {cut} (segment {k}: {run!r})")
                states[cut] = text
        finally:
            run.close()
        if len(produced) < cut - position:  # the data ended: later segments have nothing to add
            break
        position = cut
    _assert_same(baseline, resumed, f"uninterrupted vs cut at {cuts}")
    if compare_states:
        for cut, text in states.items():
            assert text == baseline_states[cut], (
                f"the state saved at step {cut} differs between the uninterrupted run and the run "
                f"resumed at {[c for c in cuts if c < cut]}: a checkpoint must not depend on how it was reached"
                + _first_difference(json.loads(baseline_states[cut]), json.loads(text))
            )
    return ResumeReport(baseline=baseline, resumed=resumed, states=states)


def _state_text(state: dict, where: str) -> str:
    json_round_trip(state, where)
    return json.dumps(state, sort_keys=True)


def _assert_same(expected: list[str], actual: list[str], what: str) -> None:
    for step, (a, b) in enumerate(zip(expected, actual)):
        assert a == b, f"{what}: step {step} differs:\n  expected {a}\n  actual   {b}"
    assert len(expected) == len(actual), (
        f"{what}: {len(expected)} steps expected, {len(actual)} produced (data ended at a different step?)"
    )


def _first_difference(a: Any, b: Any, where: str = "") -> str:
    if type(a) is not type(b):
        return f"\n  first difference at {where or '<root>'}: {a!r:.200} vs {b!r:.200}"
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{where}.{key}")
    if isinstance(a, list) and len(a) == len(b):
        for k, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{where}[{k}]")
    return f"\n  first difference at {where or '<root>'}: {a!r:.200} vs {b!r:.200}"


# ---------------------------------------------------------------------------------------
# Drivers.


class LoaderRun:
    """W ``ZephonLoader`` ranks of one config, reassembled into global batches in index order.

    A step's fingerprint is ``StepFingerprint.line()``: ``"STEP SHA256"`` with the same bytes
    as ``collect_fingerprints`` (plus ``name=count`` per source for mixes). Every micro-batch
    is checked for its ``step``/``micro_step``/``global_indices`` fields, and all ranks must
    agree on where the data ends.

    With ``workers_serve`` the worker processes (if any) serve from the first batch: without
    the wait a loader reads in-process until they are ready (its warm start), and a short run
    might never reach them, so what only the workers do (import a named kind's module, encode
    online) would go untested.
    """

    def __init__(self, config: LoaderConfig, world_size: int = 1, *, workers_serve: bool = False) -> None:
        from loader.pipeline import ZephonLoader

        self.config = config
        self.world_size = world_size
        self.loaders = [ZephonLoader(config, rank=r, world_size=world_size) for r in range(world_size)]
        self.workers_serve = workers_serve and config.num_workers > 0
        if self.workers_serve:
            for loader in self.loaders:
                loader.wait_for_workers(60)
        self.names = self.loaders[0].source_names
        self.micro_steps = self.loaders[0].topology.micro_steps_per_step
        self.last_rows: dict[int, bytes] = {}  # the last step's sequence bytes by global index

    def __repr__(self) -> str:
        c = self.config
        return (f"LoaderRun(W={self.world_size}, num_workers={c.num_workers}, micro={c.micro_batch_size}, "
                f"prefetch={c.prefetch}, packing={c.packing})")

    def load(self, state: dict) -> None:
        for loader in self.loaders:
            loader.load_state_dict(state)

    def save(self) -> dict:
        return merge_rank_states([loader.state_dict() for loader in self.loaders])

    def close(self) -> None:
        for loader in self.loaders:
            loader.close()

    def run(self, steps: int) -> list[str]:
        out = []
        for _ in range(steps):
            line = self._step()
            if line is None:
                break
            out.append(line)
        if out and self.workers_serve:
            assert not any(loader._run.warm_start for loader in self.loaders), f"{self!r}: the workers did not serve"
        return out

    def _step(self) -> Optional[str]:
        B = self.config.global_batch_size
        step = self.loaders[0].step
        rows: dict[int, tuple[bytes, int]] = {}
        ended = []
        # Ranks simulated in one process agree on the end of finite data the way real ranks
        # do through torch.distributed: nobody starts a step that some rank cannot finish.
        from loader.pipeline import ranks_have_step  # torch, as ZephonLoader above

        if not ranks_have_step(self.loaders):
            return None
        for rank, loader in enumerate(self.loaders):
            assert loader.step == step, f"rank {rank} is at step {loader.step}, rank 0 at {step}"
            for micro in range(self.micro_steps):
                try:
                    batch = next(loader)
                except StopIteration:
                    ended.append((rank, micro))
                    break
                assert batch["step"] == step, f"rank {rank} micro-batch says step {batch['step']}, expected {step}"
                assert batch["micro_step"] == micro, f"rank {rank} micro_step {batch['micro_step']}, expected {micro}"
                indices = batch["global_indices"].tolist()
                images = image_bytes_by_row(batch)  # image configs: pixels are part of the line
                assert len(indices) == self.config.micro_batch_size
                if self.config.balance is None:  # balance: any of the step's indices (loader.order.balance)
                    assert all(i % self.world_size == rank for i in indices), f"rank {rank} got indices {indices}"
                for row, (index, ids, labels, source) in enumerate(zip(
                    indices, batch["input_ids"].numpy(), batch["labels"].numpy(), batch["source_ids"].tolist()
                )):
                    assert index not in rows, f"global index {index} delivered twice"
                    rows[index] = (sequence_bytes(ids, labels) + images.get(row, b""), source)
        if ended:
            assert [r for r, _ in ended] == list(range(self.world_size)), (
                f"step {step}: ranks disagree about the end of the data: ranks/micro-steps {ended} stopped, "
                f"the other ranks delivered {len(rows)} sequences of the step (their trainers would hang)"
            )
            return None
        expected = list(range(step * B, (step + 1) * B))
        assert sorted(rows) == expected, f"step {step}: ranks delivered indices {sorted(rows)}, expected {expected}"
        digest = hashlib.sha256()
        counts: Counter = Counter()
        for index in expected:
            digest.update(rows[index][0])
            counts[rows[index][1]] += 1
        self.last_rows = {i: rows[i][0] for i in expected}
        source_counts = {n: counts.get(k, 0) for k, n in enumerate(self.names)} if len(self.names) > 1 else {}
        return StepFingerprint(step, digest.hexdigest(), source_counts).line()


class RecordingLoader:
    """A rank loader that hands each micro-batch's loss masks to ``sink`` by global index."""

    def __init__(self, loader, sink: dict[int, bytes]) -> None:
        self._loader, self._sink = loader, sink

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def __next__(self) -> dict:
        batch = next(self._loader)
        for index, mask in zip(batch["global_indices"].tolist(), batch["loss_mask"].numpy()):
            self._sink[index] = np.asarray(mask, np.uint8).tobytes()
        return batch


class MaskedLoaderRun(LoaderRun):
    """:class:`LoaderRun` whose step line also covers the step's ``loss_mask`` rows.

    A step fingerprint hashes ``input_ids`` and ``labels``, not ``loss_mask``; this line adds
    the SHA-256 of the step's masks in global-index order, so two lines agree only when ids,
    labels and masks all do.
    """

    def __init__(self, config: LoaderConfig, world_size: int = 1, **options: Any) -> None:
        super().__init__(config, world_size, **options)
        self.masks: dict[int, bytes] = {}
        self.loaders = [RecordingLoader(loader, self.masks) for loader in self.loaders]

    def _step(self) -> Optional[str]:
        self.masks.clear()
        line = super()._step()
        if line is None:
            return None
        digest = hashlib.sha256(b"".join(self.masks[i] for i in sorted(self.masks)))
        assert sorted(self.masks) == sorted(self.last_rows)  # every sequence of the step has its mask
        return f"{line} loss_mask={digest.hexdigest()}"


def loader_runs(config: LoaderConfig, topologies: Sequence[dict], *, run: Callable[..., LoaderRun] = LoaderRun,
                workers_serve: bool = False) -> Callable[[int], LoaderRun]:
    """``make`` for :func:`check_resume`: segment ``k`` uses ``topologies[k % len]``.

    A topology is a dict of ``world_size`` and any of ``num_workers``, ``micro_batch_size``,
    ``prefetch``; index 0 is the uninterrupted run. ``run`` is the driver class
    (:class:`LoaderRun` or a subclass).
    """

    def make(k: int) -> LoaderRun:
        topo = dict(topologies[k % len(topologies)])
        world_size = topo.pop("world_size", 1)
        return run(config.replace(**topo), world_size, workers_serve=workers_serve)

    return make


def run_lines(make: Callable[[int], Resumable], steps: int, k: int = 0) -> list[str]:
    """The fingerprints of ``steps`` steps of ``make(k)`` alone, closed afterwards."""
    run = make(k)
    try:
        return run.run(steps)
    finally:
        run.close()


class StageRun:
    """A single stateful stage: ``produce(stage)`` returns its next output (None at the end).

    One step is ``per_step`` outputs, fingerprinted by ``digest(outputs)``. The state is
    ``to_jsonable(stage.get_state())`` and is loaded with ``stage.set_state``.
    """

    def __init__(self, stage, produce: Callable, per_step: int, digest: Callable[[list], str]) -> None:
        self.stage = stage
        self.produce = produce
        self.per_step = per_step
        self.digest = digest

    def __repr__(self) -> str:
        return f"StageRun({type(self.stage).__name__})"

    def run(self, steps: int) -> list[str]:
        out = []
        for _ in range(steps):
            outputs = []
            for _ in range(self.per_step):
                value = self.produce(self.stage)
                if value is None:
                    break
                outputs.append(value)
            if not outputs:
                break
            out.append(self.digest(outputs))
            if len(outputs) < self.per_step:
                break
        return out

    def save(self) -> dict:
        return to_jsonable(self.stage.get_state())

    def load(self, state: dict) -> None:
        self.stage.set_state(state)

    def close(self) -> None:
        pass


def digest_sequences(sequences: list) -> str:
    """Fingerprint of packed sequences: ids, labels and segment starts of each."""
    h = hashlib.sha256()
    for seq in sequences:
        h.update(sequence_bytes(seq.input_ids, seq.labels))
        h.update(np.asarray(seq.segment_starts, dtype="<i4").tobytes())
        h.update(b"|")
    return h.hexdigest()


def digest_chunks(chunks: list) -> str:
    """Fingerprint of token-stream chunks: tokens and document starts of each."""
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(np.asarray(chunk.tokens, dtype="<i4").tobytes())
        h.update(np.asarray(chunk.doc_starts, dtype="<i8").tobytes())
        h.update(b"|")
    return h.hexdigest()


def lane_epochs(global_state: dict) -> dict[str, tuple[int, ...]]:
    """Per lane key, the epoch of each source's stream in a merged loader state."""
    return {
        lane: tuple(src["packer"]["stream"]["epoch"] for src in lane_state["sources"].values())
        for lane, lane_state in global_state["lanes"].items()
    }


def epoch_edge_steps(config: LoaderConfig, steps: int) -> list[int]:
    """Steps ``s`` at which some lane has just started a new epoch (during step ``s - 1``).

    Cutting at such a step saves a checkpoint right across a lane's epoch boundary.
    """
    run = LoaderRun(config.replace(num_workers=0), 1)
    edges = []
    try:
        before = lane_epochs(run.save())
        for step in range(1, steps + 1):
            if not run.run(1):
                break
            after = lane_epochs(run.save())
            if after != before:
                edges.append(step)
            before = after
    finally:
        run.close()
    return edges
