"""Micro-batches assembled in pinned (page-locked) host memory: ``ZephonLoader(pin_memory=True)``.

A copy from pinned memory to a GPU can run asynchronously (``tensor.to("cuda",
non_blocking=True)``) and at full bus speed; from ordinary memory the driver first copies
through a pinned staging buffer of its own. As with ``torch.utils.data.DataLoader(pin_memory=True)``,
the batch's tensors are pinned; unlike it, there is no second copy: the collator writes the
large arrays (``input_ids``, ``labels``, ``position_ids``) straight into pinned tensors
through their NumPy views (:meth:`PinnedBuffers.empty`), the one copy out of a worker's
shared-memory slot. The small ones (per-sequence ids, ``cu_seqlens``, features) are copied in.

The tensors handed out are the pinned allocations themselves, not ``from_numpy`` wrappers of
their memory: torch's caching host allocator tracks a pinned block through its own tensor,
which is what keeps a ``non_blocking`` copy's source alive until the copy has finished.

Pinned memory needs an accelerator backend (CUDA, ROCm, XPU, ...). Without one (a CPU-only
torch, or no device visible) ``pin_memory=True`` is a no-op with one warning, as for torch's
DataLoader: the batches are the same, in ordinary memory (:func:`pinning_available`).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def pinning_available() -> bool:
    """Whether this process can allocate pinned host memory (an accelerator is available)."""
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())


def warn_pinning_unavailable() -> None:
    log.warning("ZephonLoader(pin_memory=True): no accelerator is available to this process (torch %s, "
                "torch.cuda.is_available() is False), so there is no pinned memory to use; batches are "
                "delivered in ordinary memory (the same batches). Pass pin_memory=False to silence this.",
                __import__("torch").__version__)


class PinnedBuffers:
    """The collator's allocator while pinning: each array a NumPy view of a new pinned tensor.

    ``empty(shape, dtype)`` is called by :class:`~loader.stages.collate.Collator` for the arrays
    it fills itself; :meth:`to_torch` then hands out those tensors and copies every other array
    of the batch into a pinned tensor. Allocation goes through torch's caching host allocator,
    so after the first batches a pinned block of the right size is reused, not allocated anew.
    """

    def __init__(self, allocate=None) -> None:
        import torch

        self._torch = torch
        # allocate(shape, torch dtype) -> tensor in pinned memory; a test may pass its own.
        self._allocate = allocate or (lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=True))
        self._by_array: dict[int, tuple[np.ndarray, Any]] = {}

    def empty(self, shape: tuple, dtype) -> np.ndarray:
        tensor = self._allocate(tuple(shape), self._torch.from_numpy(np.empty(0, dtype)).dtype)
        array = tensor.numpy()
        self._by_array[id(array)] = (array, tensor)
        return array

    def to_torch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch as pinned tensors: the collator's own allocations as they are, other arrays copied."""
        from_numpy, ndarray = self._torch.from_numpy, np.ndarray
        out: dict[str, Any] = {}
        for name, value in batch.items():
            if type(value) is not ndarray:
                out[name] = value
                continue
            held = self._by_array.get(id(value))
            if held is not None and held[0] is value:
                out[name] = held[1]
            else:
                pinned = self._allocate(value.shape, from_numpy(np.empty(0, value.dtype)).dtype)
                pinned.copy_(from_numpy(np.ascontiguousarray(value)))
                out[name] = pinned
        self._by_array.clear()  # the batch owns its tensors now
        return out
