"""The determinism probe of a transform chain: what makes a transform prove it is a function.

A transform must be a function of its document and arguments (:mod:`loader.transforms.document`).
:class:`~loader.transforms.chain.TransformChain` checks it in every process, on the first
:data:`CHECK_DOCUMENTS` documents each function sees (the *probe documents*), four ways:

1. **Twice at once.** Each probe document is transformed twice, on independent copies: an
   unseeded generator, the clock at fine resolution or ``id()`` of the document give two results.
2. **The global generators.** The states of Python's ``random`` and NumPy's legacy global
   generator (``numpy.random.*``) are compared before and after each call: a transform that
   draws from them, however rarely the draw changes its result, fails by name. (They are shared
   by every thread of the process; the loader's read-ahead threads run transforms concurrently.)
3. **Later, in reverse order.** Each probe document and its first result are kept (a copy,
   a few per function) and transformed again, last first, when the function has seen
   :data:`RECHECK_AT` documents: a counter, a cache, a list kept between calls or a quota
   changes the result by then.
4. **In another interpreter.** Once a chain's probe documents are all in, they go through the
   same functions in a fresh ``python`` with another string-hash seed (:func:`run_in_child`):
   ``set`` iteration order, ``hash()``, process ids and addresses differ there. Chains of
   built-in transforms only (:mod:`loader.transforms.builtins`) skip it.

What is left unchecked is hidden state whose effect shows only on documents the probe never
revisits (an order-dependent deduplication), and a clock read at coarse resolution (a date).
``zephon diff`` then runs the same probe, stage by stage, on the documents of the lane whose
sequence differs first, and names the transform (:func:`find_culprit`).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import random
import subprocess
import sys
from typing import Any, Optional, Sequence

import numpy as np

from loader.errors import TransformError
from loader.transforms.document import Document
from loader.transforms.spec import BUILTIN_MODULE, TransformSpec

CHECK_DOCUMENTS = 8  # documents per function and process checked for determinism (two calls each)
RECHECK_AT = (64, 1024, 16384, 262144)  # documents a chain has seen when its probe documents go through again
CHILD_TIMEOUT_S = 300
PREVIEW = 160  # characters of a result shown in a message
# The child runs with this set to the pid whose results it checks: a test transform that
# misbehaves in chosen processes only (by pid) behaves in the child as in its parent.
PROBE_OF_ENV = "ZEPHON_TRANSFORM_PROBE_OF"
CHILD = "from loader.transforms.probe import child_main; child_main()"


def probe_pid() -> int:
    """The pid whose transform results this process computes (its own, or its parent's in a probe child)."""
    value = os.environ.get(PROBE_OF_ENV, "")
    return int(value) if value.isdigit() else os.getpid()


# -- the global generators ---------------------------------------------------------------------
def _numpy_state() -> Any:
    """The legacy global generator's MT19937 state (key and position): its struct's bytes, read
    through the bit generator's ctypes interface (``get_state()`` costs ~200 us, this ~1 us)."""
    generator = np.random.mtrand._rand._bit_generator
    try:
        return ctypes.string_at(generator.ctypes.state_address, _MT19937_STATE_BYTES)
    except (AttributeError, TypeError, ValueError):
        _, key, pos, has_gauss, gauss = np.random.mtrand._rand.get_state()
        return key.tobytes(), pos, has_gauss, gauss


_MT19937_STATE_BYTES = 624 * 4 + 4  # uint32 key[624]; int pos


def global_rng_state() -> tuple:
    """What a draw from ``random`` or ``numpy.random`` (the legacy global generator) changes."""
    return random.getstate(), _numpy_state()


def same_rng_state(a: tuple, b: tuple) -> bool:
    return a == b


# -- documents and results ----------------------------------------------------------------------
def document_entry(document: Document) -> dict[str, Any]:
    """Every field of a document, read now (on a copy: ``document`` stays as it was) and copied
    out of its row group; arrays stay arrays (JSON lists only on the way to a child)."""
    doc = document.fresh_copy()
    ids = doc.input_ids
    return {"key": doc.key, "text": doc.text, "ids": None if ids is None else np.array(ids),
            "features": {name: [np.asarray(v).dtype.str, np.array(v)] for name, v in doc.features.items()},
            "metadata": doc.metadata, "record": doc.record, "seed_base": doc._seed_base, "position": doc._position}


def document_of(entry: dict[str, Any]) -> Document:
    """A standalone :class:`Document` (read-only arrays) from :func:`document_entry`."""
    def frozen(values, dtype):
        array = np.array(values, dtype=dtype)
        array.flags.writeable = False
        return array

    ids = None if entry["ids"] is None else frozen(entry["ids"], np.int32)
    features = {name: frozen(values, dtype) for name, (dtype, values) in entry["features"].items()}
    doc = Document(entry["key"], text=entry["text"], input_ids=ids, features=features,
                   metadata=dict(entry["metadata"] or {}), record=entry["record"], seed_base=entry["seed_base"])
    return doc.at_position(entry["position"])


def _json_default(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else repr(value)


def result_digest(result: Any) -> list[str]:
    """``[SHA-256, preview]`` of a transform's result: ``dropped``, or its fields as JSON."""
    if result is None:
        text = "dropped"
    elif not isinstance(result, Document):
        text = f"a {type(result).__name__}: {result!r:.200}"
    else:
        result = result.fresh_copy()  # reading its fields leaves the result itself as it was
        ids = result.input_ids
        text = json.dumps({"text": result.text, "ids": ids, "features": dict(result.features or {}),
                           "metadata": result.metadata, "record": result.record}, sort_keys=True, default=_json_default)
    return [hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest(),
            text if len(text) <= PREVIEW else text[:PREVIEW] + "..."]


# -- one probe document ------------------------------------------------------------------------
class Probed:
    """A probe document of one function: its input (:func:`document_entry`) and its first result
    (:func:`result_digest`)."""

    __slots__ = ("position", "entry", "first")

    def __init__(self, position: int, entry: dict[str, Any], first: list[str]) -> None:
        self.position, self.entry, self.first = position, entry, first


def call_watched(function, document: Document, args: dict, where: str):
    """``function(document, **args)``, refused when it draws from a global generator (seen twice:
    once could be another thread's draw)."""
    before = global_rng_state()
    result = function(document, **args)
    if same_rng_state(before, global_rng_state()):
        return result
    before = global_rng_state()
    function(document.fresh_copy(), **args)
    if not same_rng_state(before, global_rng_state()):
        raise TransformError(
            f"{where} is not deterministic: called on document {document.key!r} it drew from the global random "
            "generator (random.* or numpy.random.*), which every thread and process shares. A transform must be a "
            "function of the document and its arguments only: draw random numbers from doc.seed "
            "(random.Random(doc.seed), numpy.random.default_rng(doc.seed))")
    return result


def recheck(probes: Sequence[Probed], functions: Sequence, specs: Sequence[TransformSpec], where, seen: int) -> None:
    """Transform the probe documents again, last first; a different result names the function."""
    for probe in reversed(probes):
        document = document_of(probe.entry)
        try:
            again = result_digest(call_watched(functions[probe.position], document, specs[probe.position].args,
                                               where(probe.position)))
        except TransformError:
            raise
        except Exception as exc:  # it did not raise on this document the first time
            raise TransformError(f"{where(probe.position)} failed on document {document.key!r} when it went through "
                                 f"again after {seen} documents ({type(exc).__name__}: {exc}); a transform must "
                                 "give the same result every time") from exc
        if again[0] != probe.first[0]:
            raise TransformError(
                f"{where(probe.position)} is not deterministic: document {document.key!r} gave {probe.first[1]} "
                f"when first seen and {again[1]} after {seen} documents. A transform must be a function of the "
                "document and its arguments only: no counter, cache, list or other state kept between calls, no "
                "clock; draw random numbers from doc.seed")


# -- the other interpreter ---------------------------------------------------------------------
def needs_child(specs: Sequence[TransformSpec]) -> bool:
    """Whether a chain has a function that is not a built-in (built-ins are checked by their tests)."""
    return any(not spec.qualified_name.startswith(BUILTIN_MODULE + ":") for spec in specs)


def _other_hash_seed() -> str:
    current = os.environ.get("PYTHONHASHSEED", "")
    return str((int(current) + 1) % 2**32) if current.isdigit() else "1"


def run_in_child(specs: Sequence[TransformSpec], probes: Sequence[Probed]) -> list[str]:
    """The results of ``probes`` computed in a fresh interpreter with another string-hash seed."""
    payload = json.dumps({"sys_path": list(sys.path), "specs": [s.to_entry() for s in specs],
                          "probes": [[p.position, p.entry] for p in probes]}, default=_json_default)
    env = dict(os.environ, PYTHONHASHSEED=_other_hash_seed(), **{PROBE_OF_ENV: str(probe_pid())})
    try:
        done = subprocess.run([sys.executable, "-c", CHILD], input=payload, capture_output=True, text=True, env=env,
                              timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise TransformError(f"the determinism probe of transforms {[s.qualified_name for s in specs]} did not finish "
                             f"in {CHILD_TIMEOUT_S} s in a fresh interpreter (does a transform block?)") from exc
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        raise TransformError(f"transforms {[s.qualified_name for s in specs]} fail in a fresh interpreter (worker "
                             f"processes and Beam workers are ones): {tail[0]}")
    return json.loads(done.stdout)


def compare_in_child(probes: Sequence[Probed], specs: Sequence[TransformSpec], where) -> None:
    """:func:`run_in_child`, and a result that differs from this process's names its function."""
    for probe, theirs in zip(probes, run_in_child(specs, probes)):
        if theirs[0] != probe.first[0]:
            raise TransformError(
                f"{where(probe.position)} is not deterministic: document {probe.entry['key']!r} gave "
                f"{probe.first[1]} in this process and {theirs[1]} in another Python process (another "
                "string-hash seed). A transform must not depend on the process: no set iteration order of strings, "
                "hash(), id(), process id or clock; sort what you iterate, hash with hashlib")


def child_main() -> None:
    """The fresh interpreter's side of :func:`run_in_child` (JSON on stdin and stdout)."""
    payload = json.loads(sys.stdin.read())
    sys.path[:] = payload["sys_path"]
    specs = [TransformSpec(**entry) for entry in payload["specs"]]
    functions = [spec.load() for spec in specs]
    out = []
    for position, entry in payload["probes"]:
        try:
            out.append(result_digest(functions[position](document_of(entry), **specs[position].args)))
        except Exception as exc:  # reported as a difference, with what it raised
            out.append(["", f"raised {type(exc).__name__}: {exc}"])
    sys.stdout.write(json.dumps(out))
