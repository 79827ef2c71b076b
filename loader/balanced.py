"""``balance = "attention"``: a rank's micro-batches chosen from the whole global batch by cost.

A :class:`~loader.pipeline.ZephonLoader` with ``balance`` set hands out, at every step, the
sequences :func:`loader.order.balance.balanced_assignment` gives its rank, instead of the
global indices ``i = rank mod W``. The lanes, their states and the global batch do not change
(each rank still produces exactly its own lanes' outputs: checkpoints are the same with and
without balance, and resume on any world size); only who trains on which sequence does.

A rank holds only its own lanes' sequences, so the others come from where they are made::

    rank r:  produce own B/W items of step t ──┐
             costs of them ───────── all_gather (W x B/W int64) ── assignment (same on every rank)
             the items others get ── all_to_all by send/recv ──── this rank's M micro-batches

* :class:`DistributedExchange` (``torch.distributed`` initialised with ``W`` ranks): a per-step
  collective of the costs, then the sequences, point to point (each rank sends each peer the
  rows it gets, as one byte tensor per peer: ids, labels, segment starts, per-token features,
  images with their pixels, online rejects: :mod:`loader.balance_rows`). On a CPU (gloo) group,
  beside an NCCL training group if there is one (``docs/guides/packing-window-and-balance.md``).
* :class:`SimulatedExchange` (ranks simulated in one process, no process group): the rank
  builds a private loader per other rank (same config, no workers, same state) and takes its
  sequences from them: no communication, ``W`` times the production (for tests and tools).

Per step the balancer keeps ``max / mean`` of the ranks' costs, balanced and as the default
layout would have had it (``ZephonLoader.metrics().balance``).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any, Optional

from loader.balance_rows import decode_items, encode_items
from loader.errors import TopologyError
from loader.order.balance import CostModel, balanced_assignment, default_assignment, imbalance
from loader.order.data_parallel import initialized_distributed
from loader.stages.producer import Item

_SHADOW = threading.local()  # set while a SimulatedExchange builds its peers' loaders: they do not balance


@contextlib.contextmanager
def _building_peers():
    _SHADOW.active = True
    try:
        yield
    finally:
        _SHADOW.active = False


def make_balancer(loader) -> Optional["Balancer"]:
    """The balancer of ``loader`` (None without ``balance``, and for a simulated rank's peer loaders)."""
    if loader.config.balance is None or getattr(_SHADOW, "active", False):
        return None
    world_size = loader.topology.world_size
    if world_size > 1 and initialized_distributed() is not None:
        exchange = DistributedExchange(loader)
    else:
        exchange = SimulatedExchange(loader)
    return Balancer(loader, exchange)


class Balancer:
    """Hands out a rank's balanced micro-batches of each step (see the module docstring)."""

    def __init__(self, loader, exchange) -> None:
        self.loader = loader
        self.exchange = exchange
        self.cost_model = CostModel.for_seq_len(loader.config.seq_len)
        self._pending: collections.deque = collections.deque()
        self._position = 0
        self.steps = 0
        self.balanced_sum = self.unbalanced_sum = 0.0
        self.last: dict[str, float] = {}
        self.exchange_s = 0.0

    def cost(self, item: Item) -> int:
        sequence = item.sequence
        images = sequence.images  # resolved where the row was made: the encoder's patches from their grids
        grids = images.grids if images is not None else None
        refs = sequence.features.get("image_ref") if sequence.features and grids is None else None
        return self.cost_model.row_cost(sequence.segment_starts, len(sequence.input_ids), sequence.padding, refs,
                                        grids)

    def next_batch(self) -> dict[str, Any]:
        loader = self.loader
        started = time.perf_counter()
        if not self._pending:
            self._produce_step()
        items = self._pending.popleft()
        self._position += len(items)
        batch = loader._collate(items, self._position)  # its micro_step from the position handed out
        loader._metrics.count(items, batch, time.perf_counter() - started, self._position)
        return loader._handed_out(batch)

    def _produce_step(self) -> None:
        loader = self.loader
        topology = loader.topology
        start = loader.rank_position
        own = [item for _ in range(topology.micro_steps_per_step) for item in loader._next_items()]
        B = loader.config.global_batch_size
        step = own[0].global_index // B
        began = time.perf_counter()
        costs, held = self.exchange.costs(step, own, self.cost)
        assignment = balanced_assignment(costs, topology.world_size, loader.config.micro_batch_size)
        rows_began = time.perf_counter()  # real ranks: every rank is past the costs' all_gather
        mine = self.exchange.sequences(step, held, assignment)
        ended = time.perf_counter()
        self.exchange_s, rows_s = ended - began, ended - rows_began
        kept = {id(item) for micro in mine for item in micro}
        for item in own:  # sent to (or, simulated, made again by) another rank: its worker slot is free
            if id(item) not in kept and item.lease is not None:
                item.lease.item_done()
        balanced = imbalance(costs, assignment)
        unbalanced = imbalance(costs, default_assignment(B, topology.world_size, loader.config.micro_batch_size))
        self.steps += 1
        self.balanced_sum += balanced
        self.unbalanced_sum += unbalanced
        self.last = {"step": step, "max_over_mean": balanced, "max_over_mean_unbalanced": unbalanced,
                     "exchange_s": self.exchange_s, "exchange_rows_s": rows_s,
                     "exchange_bytes": self.exchange.sent_bytes}
        self._position = start
        self._pending = collections.deque(mine)

    def stats(self) -> dict[str, float]:
        """The last step's ``max/mean`` rank cost (balanced, and as the default layout had it), the
        means over the steps so far, and the last step's exchange: seconds in all (``exchange_s``: on
        real ranks the costs' ``all_gather`` included, which also waits for the slowest rank to have
        produced its rows), seconds of the rows' transfer alone (``exchange_rows_s``) and the bytes
        of rows this rank sent its peers (0 for simulated ranks: nothing is sent)."""
        if not self.steps:
            return {}
        return dict(self.last, mean_max_over_mean=self.balanced_sum / self.steps,
                    mean_max_over_mean_unbalanced=self.unbalanced_sum / self.steps, steps=self.steps)

    def restored(self, state: dict) -> None:
        self._pending.clear()
        self.exchange.restored(state)

    def close(self) -> None:
        self.exchange.close()


class SimulatedExchange:
    """Ranks simulated in one process: the other ranks' sequences from private peer loaders."""

    sent_bytes = 0  # nothing travels

    def __init__(self, loader) -> None:
        self.loader = loader
        topology = loader.topology
        config = loader.config.replace(num_workers=0)
        with _building_peers():
            self.peers = {q: type(loader)(config, rank=q, world_size=topology.world_size)
                          for q in range(topology.world_size) if q != topology.rank}

    def costs(self, step: int, own: list[Item], cost) -> tuple[list[int], dict[int, Item]]:
        """Every position's cost and the items by batch position (this process makes them all)."""
        B = self.loader.config.global_batch_size
        held = {item.global_index - step * B: item for item in own}
        for peer in self.peers.values():
            for _ in range(peer.topology.micro_steps_per_step):
                for item in peer._next_items():
                    held[item.global_index - step * B] = item
        return [cost(held[p]) for p in range(B)], held

    def sequences(self, step: int, held: dict[int, Item], assignment) -> list[list[Item]]:
        return [[held[p] for p in micro] for micro in assignment[self.loader.topology.rank]]

    def restored(self, state: dict) -> None:
        for peer in self.peers.values():
            peer.load_state_dict(state)

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()


class DistributedExchange:
    """Real ranks: costs by ``all_gather``, sequences by point-to-point send/recv (see the module
    docstring). Every rank calls it at the same step (the collectives are per step)."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.dist = dist = initialized_distributed()
        group_size = dist.get_world_size(loader.dp_group)
        if group_size != loader.topology.world_size:
            raise TopologyError(f"balance = \"attention\": the process group has {group_size} ranks but the loader "
                             f"serves world_size={loader.topology.world_size}; build the loader with the "
                             "data-parallel group's rank and size (dp_rank/dp_world_size or device_mesh)")
        self.group = loader.dp_group
        if dist.get_backend(self.group) != "gloo":  # NCCL: the rows are CPU tensors, as the end-of-data flag is
            if self.group is not None:
                raise TopologyError("balance = \"attention\" with a non-gloo data-parallel group from a DeviceMesh: "
                                 "its rows travel as CPU tensors; give the loader a gloo DP group (a mesh built "
                                 "with backend \"cpu:gloo,cuda:nccl\")")
            self.group = dist.new_group(backend="gloo")  # every rank builds the loader: a collective call
        self.features = loader.features
        self.sent_bytes = 0  # the last step's rows sent to the peers

    def _global_rank(self, rank: int) -> int:
        return rank if self.group is None else self.dist.get_global_rank(self.group, rank)

    def costs(self, step: int, own: list[Item], cost) -> tuple[list[int], dict[int, Item]]:
        W, B = self.loader.topology.world_size, self.loader.config.global_batch_size
        import torch  # optional heavy dependency: real ranks run torch.distributed

        mine = torch.tensor([cost(item) for item in own], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(W)]
        self.dist.all_gather(gathered, mine, group=self.group)
        costs = [0] * B
        for rank, values in enumerate(gathered):  # rank q's k-th item is position q + k W
            for k, value in enumerate(values.tolist()):
                costs[rank + k * W] = value
        return costs, {item.global_index - step * B: item for item in own}

    def sequences(self, step: int, held: dict[int, Item], assignment) -> list[list[Item]]:
        me, W = self.loader.topology.rank, self.loader.topology.world_size
        B = self.loader.config.global_batch_size
        peers = [peer for peer in range(W) if peer != me]
        import torch  # optional heavy dependency: real ranks run torch.distributed

        # rank q holds the positions p = q mod W: send each peer those of its share that are ours
        outgoing = {peer: torch.from_numpy(encode_items(
            [held[p] for micro in assignment[peer] for p in micro if p % W == me], self.features)) for peer in peers}
        self.sent_bytes = sum(len(payload) for payload in outgoing.values())
        # sizes first (rows vary: segment starts, images), then the rows themselves
        sizes = self._swap({peer: torch.tensor([len(payload)], dtype=torch.int64) for peer, payload in outgoing.items()},
                           {peer: torch.zeros(1, dtype=torch.int64) for peer in peers})
        incoming = self._swap(outgoing, {peer: torch.empty(int(sizes[peer].item()), dtype=torch.uint8) for peer in peers})
        wanted = [p for micro in assignment[me] for p in micro]
        received = {p: held[p] for p in wanted if p % W == me}
        for peer, buffer in incoming.items():
            items = decode_items(buffer.numpy(), self.features)
            positions = sorted(item.global_index - step * B for item in items)
            if positions != sorted(p for p in wanted if p % W == peer):
                raise RuntimeError(f"balance exchange: rank {peer} sent batch positions {positions} that rank {me} "
                                   f"did not ask for at step {step} (are the ranks at different steps?)")
            received.update((item.global_index - step * B, item) for item in items)
        return [[received[p] for p in micro] for micro in assignment[me]]

    def _swap(self, outgoing: dict, incoming: dict) -> dict:
        """Send ``outgoing[peer]`` to every peer and receive into ``incoming[peer]``, all at once."""
        operations = []
        for peer in outgoing:
            operations.append(self.dist.P2POp(self.dist.isend, outgoing[peer], self._global_rank(peer), self.group))
            operations.append(self.dist.P2POp(self.dist.irecv, incoming[peer], self._global_rank(peer), self.group))
        for request in self.dist.batch_isend_irecv(operations) if operations else ():
            request.wait()
        return incoming

    def restored(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass
