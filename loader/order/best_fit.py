"""The best-fit placement rule on integers: which open bin a piece joins, and which bin is emitted.

One implementation for every user of the rule, so that they cannot drift: the loader's packer
(:class:`loader.stages.packing.BestFitPacker`, pieces of tokens) and ``zephon audit``'s replay on
lengths (:mod:`loader.commands.audit_replay`, pieces as cursors and lengths). The rule sees only
sizes (and image counts); the pieces it is given are opaque and come back in the emitted bins.

The rule (``packing = "best_fit"``, ``best_fit_open_bins = B``), per piece of ``size`` tokens
(``1 <= size <= seq_len``, a document's piece: the stream cuts longer documents):

1. a full piece (``size == seq_len``) is a sequence on its own; the open bins do not change;
2. else it joins the open bin with the least room that still fits it, the oldest bin on ties
   (with ``max_images``: among the bins whose images plus the piece's stay within it, when the
   piece holds images); a bin it fills exactly is emitted;
3. else, when ``B`` bins are open, the fullest bin (the oldest on ties) is emitted, and the piece
   opens a new bin (serial: the next number, kept across checkpoints);
4. at the end of the stream the open bins are emitted fullest first (:meth:`OpenBins.flush`).

Bins are kept in the order they were opened (serial order), which is also the order a
checkpoint lists them in. Pure integer work, no I/O; ``O(B)`` per piece.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence


class OpenBins:
    """The open bins of one best-fit packer (module docstring), pieces opaque."""

    __slots__ = ("seq_len", "max_open", "max_images", "used", "serials", "pieces", "images", "serial",
                 "last_serial", "last_at", "emitted_serial")

    def __init__(self, seq_len: int, max_open: int, max_images: Optional[int] = None, serial: int = 0) -> None:
        self.seq_len = seq_len
        self.max_open = max_open
        self.max_images = max_images  # None: no image bound (every source but image sources)
        self.used: list[int] = []  # tokens per open bin, in serial order
        self.serials: list[int] = []
        self.pieces: list[list] = []
        self.images: list[int] = []  # images per open bin (counted only with max_images)
        self.serial = serial  # the next bin's
        # After place(): the serial of the bin the piece joined (-1: a full piece, in none) and
        # where in it the piece starts; after place() or flush(): the serial of the bin emitted
        # (-1: none, or a full piece on its own). A packer that keeps per-bin data reads them.
        self.last_serial = self.last_at = self.emitted_serial = -1

    def __len__(self) -> int:
        return len(self.used)

    def restore(self, serial: int, used: int, pieces: list, images: int = 0) -> None:
        """Put back an open bin of a saved state (bins in their saved, serial, order)."""
        self.used.append(used)
        self.serials.append(serial)
        self.pieces.append(pieces)
        self.images.append(images)

    def bins(self) -> Iterator[tuple[int, int, list]]:
        """``(serial, used, pieces)`` of every open bin, in serial order."""
        return zip(self.serials, self.used, self.pieces)

    def place(self, size: int, piece, images: int = 0) -> Optional[list]:
        """Place ``piece`` of ``size`` tokens (``images`` images); returns the pieces of the
        sequence this emits (rules 1-3), or None when the piece stays in an open bin."""
        seq_len = self.seq_len
        if size >= seq_len:
            self.last_serial = self.emitted_serial = -1
            return [piece]
        limit = seq_len - size
        used = self.used
        best, best_used = -1, -1
        if images and self.max_images is not None:
            room, held = self.max_images - images, self.images
            for k in range(len(used)):
                u = used[k]
                if best_used < u <= limit and held[k] <= room:
                    best, best_used = k, u
        else:
            for k in range(len(used)):
                u = used[k]
                if best_used < u <= limit:  # strict: the first of equal bins (the oldest) stays
                    best, best_used = k, u
        if best >= 0:
            self.pieces[best].append(piece)
            self.images[best] += images
            self.last_serial, self.last_at = self.serials[best], best_used
            if best_used + size == seq_len:
                return self._remove(best)
            used[best] = best_used + size
            self.emitted_serial = -1
            return None
        if len(used) >= self.max_open:
            evicted = self._remove(self._fullest())
        else:
            evicted, self.emitted_serial = None, -1
        self.last_serial, self.last_at = self.serial, 0
        used.append(size)
        self.serials.append(self.serial)
        self.pieces.append([piece])
        self.images.append(images)
        self.serial += 1
        return evicted

    def flush(self) -> Optional[list]:
        """The pieces of the fullest open bin (oldest on ties), removed; None when none is open."""
        if not self.used:
            self.emitted_serial = -1
            return None
        return self._remove(self._fullest())

    def _fullest(self) -> int:
        used = self.used
        return used.index(max(used))  # index(): the first, the oldest, of equal bins

    def _remove(self, k: int) -> list:
        self.emitted_serial = self.serials[k]
        del self.used[k], self.serials[k], self.images[k]
        return self.pieces.pop(k)


def best_fit_bins(sizes: Sequence[int], seq_len: int, max_open: int) -> list[list[int]]:
    """The sequences a best-fit packer makes of pieces of these sizes, as lists of piece
    indices in emission order, the open bins flushed at the end: the rule on integers alone
    (tests compare it with the packer's bins)."""
    bins = OpenBins(seq_len, max_open)
    out = []
    for k, size in enumerate(sizes):
        emitted = bins.place(int(size), k)
        if emitted is not None:
            out.append(emitted)
    while (emitted := bins.flush()) is not None:
        out.append(emitted)
    return out
