"""The elastic matrix: every kind of data, in each packing, gives bit-identical global batches on
every topology and across resumes that change the topology at each cut.

One row per (kind, packing) in :mod:`tests.elastic.cases`; each row runs

* its reference (W1, no workers) and every ``spread`` topology, whose lines must be equal;
* :func:`tests.resume_harness.check_resume` over its ``resume`` topologies: the uninterrupted run
  (saving at every cut) and the run cut at ``cuts`` and resumed each time on another world size
  and worker count must both give the reference lines, and a state saved at a cut must be the
  same JSON however it was reached;
* its extra check (supervised counts, offline == online, pixels in the fingerprint, transform
  counters in the state).

Worker processes serve from their first batch (``workers_serve``), so what only they do (import
a named kind's module, render chat online, ship pixels in their messages, load a state) is on
the compared path. A step line is the harness's (``StepFingerprint.line()``: ids and labels,
image pixels, per-source counts) and, for chat rows, the SHA-256 of the step's loss masks
(``MaskedLoaderRun``).
"""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from loader.config import LoaderConfig
from tests.elastic.cases import CASES, Case, Outcome
from tests.resume_harness import check_resume, loader_runs, run_lines


def _name(topology: dict) -> str:
    return "W{}-workers{}-micro{}".format(topology["world_size"], topology.get("num_workers", 0),
                                          topology["micro_batch_size"])


ROWS = [pytest.param(case, id=case.id, marks=case.marks) for case in CASES]
SPREAD = [pytest.param(case, topology, id=f"{case.id}-{_name(topology)}", marks=case.marks)
          for case in CASES for topology in case.spread]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Callable[[Callable], Any]:
    """A writer's data, written once for the module (rows of one writer share it)."""
    cache: dict = {}

    def get(writer: Callable) -> Any:
        if writer not in cache:
            cache[writer] = writer(tmp_path_factory.mktemp(writer.__name__))
        return cache[writer]

    return get


@pytest.fixture(scope="module")
def lines_on() -> Callable[..., list[str]]:
    """A config's lines on a topology, run once for the module: a row's reference serves its
    spread and resume tests, and another row's untransformed or offline comparison."""
    cache: dict = {}

    def lines(config: LoaderConfig, topology: dict, case: Case) -> list[str]:
        key = (json.dumps(config.to_dict(), sort_keys=True), json.dumps(topology, sort_keys=True), case.steps,
               case.run)
        if key not in cache:
            make = loader_runs(config, [topology], run=case.run, workers_serve=True)
            cache[key] = run_lines(make, case.steps)
        return cache[key]

    return lines


def _reference(case: Case, built, lines_on) -> tuple[Any, LoaderConfig, list[str]]:
    data = built(case.data)
    config = case.config(data)
    reference = lines_on(config, case.reference, case)
    assert len(reference) == case.steps
    assert len(set(reference)) == case.steps  # the steps differ from each other: nothing vacuous
    return data, config, reference


@pytest.mark.parametrize("case,topology", SPREAD)
def test_every_topology_gives_the_reference_batches(case, topology, built, lines_on):
    _, config, reference = _reference(case, built, lines_on)
    assert lines_on(config, topology, case) == reference, f"{_name(topology)} vs {_name(case.reference)}"


@pytest.mark.parametrize("case", ROWS)
def test_resumes_on_other_topologies_give_the_reference_batches(case, built, lines_on):
    data, config, reference = _reference(case, built, lines_on)
    make = loader_runs(config, case.resume, run=case.run, workers_serve=True)
    report = check_resume(make, steps=case.steps, cut_points=case.cuts, expected=reference)
    if case.check is not None:
        case.check(Outcome(data, config, reference, report, lambda other: lines_on(other, case.reference, case)))
