"""Stable hashes shared by the Beam job and the loader.

Everything that decides *where* a document lives (its lane, its position inside the lane,
its file bucket) or *in which order* rows are replayed in a later epoch is derived here from
fixed algorithms over bytes. Python's ``hash()`` is salted per process and must never be
used for any of it; ``numpy`` random generators are avoided too, because NumPy does not
promise a stable stream across releases.

Both halves of Zephon import this module, so they cannot disagree about a lane.

Guarantee: every function here returns the same value for the same arguments on every
machine, Python version and process, forever (changing one is a dataset format change and
needs a new ``FORMAT_VERSION`` in :mod:`loader.io.manifest`).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Union

import numpy as np

HashPart = Union[bytes, str, int]

_PERSON = b"zephon-v1"  # blake2b personalisation: domain-separates our hashes
_MASK64 = (1 << 64) - 1


def _encode_part(part: HashPart) -> bytes:
    if isinstance(part, bool):  # bool is an int; refuse the ambiguity
        raise TypeError(f"hash parts must be bytes, str or int (got bool {part!r})")
    if isinstance(part, bytes):
        tag, body = b"b", part
    elif isinstance(part, str):
        tag, body = b"s", part.encode("utf-8", "surrogatepass")
    elif isinstance(part, int):
        if part < 0:
            raise ValueError(f"hash parts that are ints must be >= 0 (got {part})")
        tag, body = b"i", part.to_bytes(max(1, (part.bit_length() + 7) // 8), "big")
    else:
        raise TypeError(f"hash parts must be bytes, str or int (got {type(part).__name__})")
    # Length-prefixed so that ("ab", "c") and ("a", "bc") hash differently.
    return tag + len(body).to_bytes(8, "big") + body


def stable_hash64(*parts: HashPart) -> int:
    """A 64-bit unsigned hash of the parts (blake2b, length-prefixed, personalised)."""
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    for part in parts:
        h.update(_encode_part(part))
    return int.from_bytes(h.digest(), "big")


def lane_of_key(seed: int, key: str, num_lanes: int) -> int:
    """The lane a document with this key belongs to: ``H(seed, "lane", key) mod L``."""
    if num_lanes <= 0:
        raise ValueError(f"num_lanes must be positive (got {num_lanes=})")
    return stable_hash64(seed, "lane", key) % num_lanes


def order_key_of(seed: int, key: str) -> int:
    """The document's position key inside its lane (uint64; rows are sorted by it)."""
    return stable_hash64(seed, "order", key)


def file_bucket(order_key: int, files_per_lane: int) -> int:
    """Which part file of its lane an order key falls into: contiguous ranges of the key.

    Because buckets are ranges, concatenating a lane's part files in part order yields the
    lane sorted by order key, and no single writer ever holds more than one part.
    """
    if files_per_lane <= 0:
        raise ValueError(f"files_per_lane must be positive (got {files_per_lane=})")
    return (order_key * files_per_lane) >> 64


# ---------------------------------------------------------------------------------------
# Vectorised permutations for epochs > 0.


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser over a uint64 array: a fixed bijective mixer, vectorised."""
    z = values.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z


def stable_permutation(n: int, *seed_parts: HashPart) -> np.ndarray:
    """A permutation of ``range(n)`` determined only by ``seed_parts`` (int64 array).

    Built by sorting the indices by a keyed SplitMix64 of each index, so it costs
    O(n log n) time and O(n) memory and is identical on every platform.
    """
    if n <= _SMALL_PERMUTATION:
        # The same keys and the same stable sort in Python ints: numpy's fixed cost per call
        # (~40 us) dominated the per-epoch file and row-group orders of every lane.
        if n < 0:
            raise ValueError(f"n must be >= 0 (got {n=})")
        base = stable_hash64("perm", *seed_parts)
        keys = [_splitmix64_int(i ^ base) for i in range(n)]
        return np.array(sorted(range(n), key=keys.__getitem__), dtype=np.int64)
    return stable_permutations(n, [seed_parts])[0]


_SMALL_PERMUTATION = 16  # up to this n the pure-Python path is faster (~6-14 us against ~20)


def _splitmix64_int(value: int) -> int:
    """:func:`_splitmix64` of one value, in Python ints."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def stable_permutations(n: int, seed_parts_per_row: list[tuple[HashPart, ...]]) -> np.ndarray:
    """``stable_permutation(n, *parts)`` for every ``parts`` in ``seed_parts_per_row``, as the
    rows of one int64 array: one pass of numpy calls for all of them."""
    if n < 0:
        raise ValueError(f"n must be >= 0 (got {n=})")
    bases = np.array([_permutation_base(tuple(parts)) for parts in seed_parts_per_row], dtype=np.uint64)
    keys = _splitmix64(np.arange(n, dtype=np.uint64)[None, :] ^ bases[:, None])
    # The keys of a row are distinct (SplitMix64 is a bijection and ``i ^ base`` differs for
    # every i), so every sort orders them alike: the default (unstable) kind gives the same
    # permutation as a stable one, ~3.5x faster at n = 512 (the mixing decisions per step).
    return np.argsort(keys, axis=1).astype(np.int64)


def _permutation_base(parts: tuple[HashPart, ...]) -> int:
    """``stable_hash64("perm", *parts)``, continuing a cached hash of all parts but the last
    (callers vary the last part: the step, the epoch's row group): the same bytes are hashed."""
    if not parts:
        return stable_hash64("perm")
    h = _hash_of_prefix(parts[:-1]).copy()
    h.update(_encode_part(parts[-1]))
    return int.from_bytes(h.digest(), "big")


@lru_cache(maxsize=256, typed=True)  # typed: True == 1, but a bool part must still be refused
def _hash_of_prefix(parts: tuple[HashPart, ...]) -> "hashlib._Hash":
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    for part in ("perm",) + parts:
        h.update(_encode_part(part))
    return h


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
