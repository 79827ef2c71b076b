"""Best-fit-decreasing inside a packing window: bins as a pure function of the pieces' lengths.

``packing_window = K`` (:mod:`loader.stages.window_packing`) packs each run of ``K`` documents
of a lane and source on its own. A document of ``n`` tokens (wrapped: ``[BOS] ids [EOS]``) is
cut into ``n // seq_len`` full pieces and a last piece of ``n % seq_len`` tokens (none if 0), in
the order of the documents; :func:`best_fit_decreasing` packs those pieces:

1. pieces in order of decreasing length (ties: the earlier piece first);
2. each goes to the open bin with the least room that still fits it (ties: the bin opened
   first); a bin that fits none opens a new one (a full piece is a bin on its own);
3. the bins are emitted in the order of their earliest piece, each bin's pieces in their
   window order.

Which lengths end up together depends only on the multiset of lengths, never on the order
the documents arrive in: the number of bins (the window's outputs) is a property of the data
that :func:`window_outputs` computes from lengths alone, with no tokens. That is what makes
a windowed lane seekable (:mod:`loader.commands.window_index`): the outputs before any step
are a sum of per-window counts.

Pure integer work, no I/O; ``O(n log n)`` per window of ``n`` pieces.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Sequence


def document_pieces(lengths: Sequence[int], seq_len: int) -> list[int]:
    """Piece sizes of documents of these wrapped lengths, in order: full ``seq_len`` pieces, then
    the rest (an empty document has no piece: it yields no tokens)."""
    pieces: list[int] = []
    for n in lengths:
        full, rest = divmod(int(n), seq_len)
        pieces.extend([seq_len] * full)
        if rest:
            pieces.append(rest)
    return pieces


def best_fit_decreasing(sizes: Sequence[int], seq_len: int) -> list[list[int]]:
    """Bins of piece indices (see the module docstring), in emission order; each bin's indices
    increase. Every size must be in ``[1, seq_len]``."""
    order = sorted(range(len(sizes)), key=lambda k: (-sizes[k], k))
    bins: list[list[int]] = []
    open_rooms: list[tuple[int, int]] = []  # (room left, bin number), sorted: bisect finds the best fit
    for k in order:
        size = sizes[k]
        if not 0 < size <= seq_len:
            raise ValueError(f"piece {k}: size {size} is not in [1, seq_len={seq_len}]")
        at = bisect_left(open_rooms, (size, -1))
        if at < len(open_rooms):
            room, number = open_rooms.pop(at)
            bins[number].append(k)
            room -= size
        else:
            number, room = len(bins), seq_len - size
            bins.append([k])
        if room:
            insort(open_rooms, (room, number))
    for members in bins:
        members.sort()
    bins.sort(key=lambda members: members[0])
    return bins


def window_outputs(lengths: Sequence[int], seq_len: int) -> int:
    """How many sequences a window of documents of these wrapped lengths yields: the number of
    bins of :func:`best_fit_decreasing`, computed without building them."""
    sizes = sorted((size for size in document_pieces(lengths, seq_len) if size < seq_len), reverse=True)
    full = sum(int(n) // seq_len for n in lengths)
    rooms: list[int] = []  # sorted rooms of the open bins
    opened = 0
    for size in sizes:
        at = bisect_left(rooms, size)
        if at < len(rooms):
            room = rooms.pop(at) - size
        else:
            opened += 1
            room = seq_len - size
        if room:
            insort(rooms, room)
    return full + opened
