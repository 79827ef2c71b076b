"""Whole-loader fuzzer: random resume schedules against one uninterrupted W=1 run.

A schedule is a packing mode, text or pre-tokenized lanes, 0-3 checkpoint steps and, for
every segment between them, a world size W in {1, 2, 4, 8}, a micro-batch size dividing
B/W and a prefetch depth. Drawn segments run in-process (num_workers=0) to keep the
fuzzer fast; the explicit examples add worker processes (3 workers do not divide a
rank's lanes). Each schedule must reproduce the W=1 fingerprints, and every checkpoint
must equal the uninterrupted run's state at that step (harness ``compare_states``).
"""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.loader.settings import GLOBAL_BATCH, PACKINGS
from tests.resume_harness import check_resume, loader_runs

STEPS = 16
WORLD_SIZES = (1, 2, 4, 8)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def topologies(draw) -> dict:
    world_size = draw(st.sampled_from(WORLD_SIZES))
    return dict(
        world_size=world_size,
        micro_batch_size=draw(st.sampled_from(divisors(GLOBAL_BATCH // world_size))),
        prefetch=draw(st.integers(1, 4)),
        num_workers=0,
    )


@st.composite
def schedules(draw):
    packing = draw(st.sampled_from(PACKINGS))
    pretokenized = draw(st.booleans())
    cuts = sorted(draw(st.lists(st.integers(0, STEPS), min_size=0, max_size=3)))
    segments = [draw(topologies()) for _ in range(len(cuts) + 1)]
    return packing, pretokenized, cuts, segments


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(("concat", False, [6], [dict(world_size=1, micro_batch_size=4, prefetch=1, num_workers=3),
                                 dict(world_size=4, micro_batch_size=1, prefetch=3, num_workers=0)]))
@example(("best_fit", True, [4, 11], [dict(world_size=8, micro_batch_size=1, prefetch=2, num_workers=0),
                                      dict(world_size=2, micro_batch_size=8, prefetch=1, num_workers=1),
                                      dict(world_size=2, micro_batch_size=2, prefetch=2, num_workers=0)]))
@given(schedule=schedules())
def test_random_resume_schedules_match_one_uninterrupted_run(make_config, baseline, schedule):
    packing, pretokenized, cuts, segments = schedule
    config = make_config(packing, pretokenized=pretokenized)
    # make(0) is the uninterrupted W=1 run; make(k) runs segment k-1 of the schedule.
    check_resume(loader_runs(config, [dict(world_size=1)] + segments), steps=STEPS, cut_points=cuts,
                 expected=baseline(packing, STEPS))
