"""The load window (ds_hecate.planning.predictor.LoadPredictor): what the planner predicts the next call from."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_hecate.planning.predictor import LoadPredictor


def test_predictor_empty():
    p = LoadPredictor(5)
    assert len(p) == 0
    assert p.predict() is None
    assert p.expert_loads() is None


@pytest.mark.parametrize("window", [0, -1, -5])
def test_predictor_rejects_window_below_one(window):
    with pytest.raises(ValueError, match="window"):
        LoadPredictor(window)


def test_predictor_window_average_hand_computed():
    p = LoadPredictor(3)
    p.push([[3, 0], [1, 4]])
    assert p.predict() == [[3.0, 0.0], [1.0, 4.0]]
    p.push([[5, 2], [1, 0]])
    assert p.predict() == [[4.0, 1.0], [1.0, 2.0]]
    p.push([[1, 1], [4, 2]])
    assert p.predict() == [[3.0, 1.0], [2.0, 2.0]]
    # the fourth push evicts the first: average of pushes 2..4
    p.push([[0, 6], [7, 1]])
    assert len(p) == 3
    assert p.predict() == [[2.0, 3.0], [4.0, 1.0]]
    # one more: pushes 3..5
    p.push([[2, 2], [1, 0]])
    assert p.predict() == [[1.0, 3.0], [4.0, 1.0]]
    assert p.expert_loads() == [5.0, 4.0]


def test_predictor_window_one_is_last_push():
    p = LoadPredictor(1)
    for m in ([[1, 2]], [[7, 0]], [[3, 9]]):
        p.push(m)
        assert p.predict() == [[float(x) for x in m[0]]]
    assert len(p) == 1


@settings(max_examples=100, deadline=None)
@given(window=st.integers(1, 6), world=st.integers(1, 4), experts=st.integers(1, 5), data=st.data())
def test_predictor_window_average_property(window, world, experts, data):
    pushes = data.draw(st.lists(st.lists(st.lists(st.integers(0, 1000), min_size=experts, max_size=experts),
                                         min_size=world, max_size=world), min_size=1, max_size=12))
    p = LoadPredictor(window)
    for i, m in enumerate(pushes):
        p.push(m)
        last = pushes[max(0, i + 1 - window):i + 1]
        assert len(p) == len(last)
        pred = p.predict()
        assert pred is not None
        for r in range(world):
            for e in range(experts):
                assert pred[r][e] == pytest.approx(sum(h[r][e] for h in last) / len(last), rel=1e-12)
        loads = p.expert_loads()
        assert loads is not None
        for e in range(experts):
            assert loads[e] == pytest.approx(sum(pred[r][e] for r in range(world)), rel=1e-12)
            assert loads[e] == pytest.approx(sum(h[r][e] for h in last for r in range(world)) / len(last),
                                             rel=1e-12)


def test_predictor_state_dict_round_trip():
    p = LoadPredictor(2)
    for m in ([[1, 2], [3, 4]], [[5, 6], [7, 8]], [[9, 10], [11, 12]]):
        p.push(m)
    state = p.state_dict()
    assert state["window"] == 2
    assert state["history"] == [[[5, 6], [7, 8]], [[9, 10], [11, 12]]]
    q = LoadPredictor(2)
    q.load_state_dict(state)
    assert len(q) == 2
    assert q.predict() == p.predict() == [[7.0, 8.0], [9.0, 10.0]]
    assert q.expert_loads() == p.expert_loads()
    # the restored window keeps sliding with the same length
    p.push([[1, 1], [1, 1]])
    q.push([[1, 1], [1, 1]])
    assert len(q) == 2
    assert q.predict() == p.predict() == [[5.0, 5.5], [6.0, 6.5]]
    # the snapshot taken before is unaffected by later pushes
    assert state["history"] == [[[5, 6], [7, 8]], [[9, 10], [11, 12]]]
    # restoring into a fresh predictor, then mutating the state, does not alter the predictor
    r = LoadPredictor(2)
    r.load_state_dict(state)
    state["history"][0][0][0] = 1000
    assert r.predict() == [[7.0, 8.0], [9.0, 10.0]]


def test_predictor_state_dict_of_empty_predictor():
    q = LoadPredictor(3)
    q.load_state_dict(LoadPredictor(3).state_dict())
    assert q.predict() is None and len(q) == 0


# -- the robust window (hecate.load_predictor "robust", the planner's default) ---------------------------------------
def _uniform(world=4, experts=8, n=100.0):
    return [[n] * experts for _ in range(world)]


def _hot(expert, world=4, experts=8, n=100.0, extra=700.0):
    rows = _uniform(world, experts, n)
    for row in rows:
        row[expert] += extra
    return rows


def test_robust_window_leaves_a_burst_out_and_says_the_newest_call_disagreed():
    p = LoadPredictor(5, "robust")
    for _ in range(4):
        p.push(_uniform())
    p.push(_hot(3))                                       # a one-step burst
    assert p.predict() == _uniform() and not p.newest_agrees
    p.push(_uniform())                                    # gone again: the burst is still in the window, left out
    assert p.predict() == _uniform() and p.newest_agrees
    mean = LoadPredictor(5, "mean")
    for m in [_uniform()] * 4 + [_hot(3), _uniform()]:
        mean.push(m)
    assert mean.predict() != _uniform() and mean.newest_agrees   # the paper's mean carries a fifth of the burst


def test_robust_window_follows_a_lasting_move_once_most_of_the_window_saw_it():
    p = LoadPredictor(5, "robust")
    for _ in range(5):
        p.push(_hot(0))
    moved = []
    for _ in range(4):
        p.push(_hot(5))                                   # the hot spot moved for good
        moved.append((p.predict() == _hot(5), p.newest_agrees))
    # 1 and 2 of 5 calls: still the old routing (the newest disagrees, so nothing speculative is prefetched);
    # from 3 of 5 on: the new routing, averaged over the calls that saw it
    assert moved == [(False, False), (False, False), (True, True), (True, True)]


def test_robust_window_without_a_majority_averages_everything():
    p = LoadPredictor(3, "robust")
    for m in (_hot(0), _hot(3), _hot(6)):
        p.push(m)
    everything = np.mean(np.array([_hot(0), _hot(3), _hot(6)]), axis=0).tolist()
    assert p.predict() == everything and not p.newest_agrees


def test_unknown_predictor_is_refused():
    with pytest.raises(ValueError, match="load predictor"):
        LoadPredictor(5, "median")


def test_window_median_is_numpys_median():
    """The predictor's sorted median equals ``np.median`` bit for bit, odd and even windows, ties and zeros."""
    from ds_hecate.planning.predictor import window_median
    rng = np.random.default_rng(5)
    for n in range(1, 8):
        for margins in (rng.random((n, 12)) * 100, rng.integers(0, 4, (n, 12)).astype(np.float64)):
            assert np.array_equal(window_median(margins), np.median(margins, axis=0)), n
