"""Schedule changes of a mix, also at a resume and on other world sizes.

Every case compares step fingerprints (``STEP SHA256 name=count ...``) with a W = 1 run of
``collect_fingerprints``; the resume cases go through the shared harness
(``tests/resume_harness.py``), which also checks that a checkpoint is the same JSON however
it was reached. A mix without a schedule on every topology and across resumes is a row of the
elastic matrix (``tests/elastic``).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from loader.commands.fingerprints import collect_fingerprints
from tests.mixing.conftest import GLOBAL_BATCH, THIRDS, WEIGHTS
from tests.mixing.mix_helpers import count_bounds
from tests.resume_harness import check_resume, loader_runs

UNITS = ("sequence", "token")
PACKINGS = ("concat", "best_fit")
X = {"web": 0.2, "code": 0.2, "math": 0.6}
Y = {"web": 0.7, "code": 0.1, "math": 0.2}


def lines(config, start: int, end: int, **kwargs) -> list[str]:
    results, _ = collect_fingerprints(config, start_step=start, end_step=end, **kwargs)
    return [r.line() for r in results]


def counts_of(line: str) -> list[int]:
    return [int(part.split("=")[1]) for part in line.split()[2:]]


def assert_counts_follow(line: str, weights: dict[str, float]) -> None:
    for count, (lo, hi) in zip(counts_of(line), count_bounds(weights, GLOBAL_BATCH)):
        assert lo <= count <= hi, (line, weights)


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("unit", UNITS)
def test_schedule_change_keeps_the_past_and_resumes_exactly(mix_config, unit, packing) -> None:
    """A change at step 10: steps 0..9 as without it, 10.. with the new weights; resumable."""
    plain = mix_config(mixing_unit=unit, packing=packing)
    changed = plain.replace(schedule=[{"step": 10, "weights": THIRDS}])
    before = lines(plain, 0, 20)
    after = lines(changed, 0, 20)
    assert after[:10] == before[:10]
    assert after[10] != before[10]
    if unit == "sequence":  # token mixing counts majority sources: no per-batch count guarantee
        for line in after[:10]:
            assert_counts_follow(line, WEIGHTS)
        for line in after[10:]:
            assert_counts_follow(line, THIRDS)
    # Resuming at the change step and after it, on other world sizes, reproduces the stream.
    topologies = [dict(world_size=1), dict(world_size=4), dict(world_size=2, micro_batch_size=14)]
    check_resume(loader_runs(changed, topologies), steps=20, cut_points=[10, 15], expected=after)


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("unit", UNITS)
def test_resume_with_a_new_schedule_takes_effect_from_the_resume_step(mix_config, unit, packing) -> None:
    """Checkpoint at 15 made under schedule B; resumed under C; C's past is ignored, history recorded."""
    plain = mix_config(mixing_unit=unit, packing=packing)
    b = plain.replace(schedule=[{"step": 10, "weights": THIRDS}])
    # C says nothing about step 10 and changes weights at 5 (in the past at the resume: ignored
    # there, but X is what C says is active at 15) and at 18.
    c = plain.replace(schedule=[{"step": 5, "weights": X}, {"step": 18, "weights": Y}])
    # The run B -> C must equal a fresh run of the recorded history.
    history = plain.replace(schedule=[
        {"step": 10, "weights": THIRDS}, {"step": 15, "weights": X}, {"step": 18, "weights": Y},
    ])
    expected = lines(history, 0, 30)

    _, state = collect_fingerprints(b, end_step=15, save_state_step=15)
    resumed, state_25 = collect_fingerprints(
        c, world_size=2, start_step=15, end_step=25, load_state=state, save_state_step=25,
    )
    assert [r.line() for r in resumed] == expected[15:25]
    assert state_25["schedule"] == [
        {"step": 0, "weights": {"web": "11/20", "code": "3/10", "math": "3/20"}},
        {"step": 10, "weights": {"web": "1/3", "code": "1/3", "math": "1/3"}},
        {"step": 15, "weights": {"web": "1/5", "code": "1/5", "math": "3/5"}},
        {"step": 18, "weights": {"web": "7/10", "code": "1/10", "math": "1/5"}},
    ]
    if unit == "sequence":
        for line in expected[15:18]:
            assert_counts_follow(line, X)
        for line in expected[18:30]:
            assert_counts_follow(line, Y)
    # Resumed again under C (same schedule as recorded): the stream goes on unchanged.
    again = lines(c, 25, 30, world_size=4, load_state=state_25)
    assert again == expected[25:30]
    # Resumed under the original B: B's weights (1/3) apply from the resume step, history kept.
    back, state_30 = collect_fingerprints(b, start_step=25, end_step=30, load_state=state_25, save_state_step=30)
    assert [p["step"] for p in state_30["schedule"]] == [0, 10, 15, 18, 25]
    assert state_30["schedule"][-1]["weights"] == {"web": "1/3", "code": "1/3", "math": "1/3"}
    assert [r.line() for r in back][0] != expected[25]
    if unit == "sequence":
        for r in back:
            assert_counts_follow(r.line(), THIRDS)


def test_a_resume_at_the_step_of_a_new_phase_does_not_record_a_duplicate(mix_config) -> None:
    b = mix_config(schedule=[{"step": 10, "weights": THIRDS}])
    _, state = collect_fingerprints(b, end_step=10, save_state_step=10)
    _, after = collect_fingerprints(b, start_step=10, end_step=12, load_state=state, save_state_step=12)
    assert [p["step"] for p in after["schedule"]] == [0, 10]
    weights = [Fraction(w) for w in after["schedule"][1]["weights"].values()]
    assert weights == [Fraction(1, 3)] * 3 and np.isclose(float(sum(weights)), 1.0)
