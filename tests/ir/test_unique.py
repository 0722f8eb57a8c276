"""``ir.unique`` against ``np.unique``: the same values, first indices and counts."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ir.unique import distinct, first_indices

INTS = arrays(st.sampled_from([np.int32, np.int64]), st.integers(0, 300),
              elements=st.integers(-50, 50))


@settings(max_examples=200, deadline=None)
@given(INTS)
def test_distinct_and_first_indices_equal_numpy(x):
    assert np.array_equal(distinct(x), np.unique(x))
    assert distinct(x).dtype == x.dtype
    u, first, counts = first_indices(x, counts=True)
    nu, nfirst, ncounts = np.unique(x, return_index=True, return_counts=True)
    assert np.array_equal(u, nu) and np.array_equal(first, nfirst) and np.array_equal(counts, ncounts)
    u2, first2 = first_indices(x)
    assert np.array_equal(u2, nu) and np.array_equal(first2, nfirst)


def test_a_hand_worked_case():
    x = np.array([5, 3, 5, 1, 3, 3])
    assert distinct(x).tolist() == [1, 3, 5]
    u, first, counts = first_indices(x, counts=True)
    assert (u.tolist(), first.tolist(), counts.tolist()) == ([1, 3, 5], [3, 1, 0], [1, 3, 2])
    assert distinct(np.zeros(0, np.int64)).size == 0


def test_two_dimensional_input_is_refused():
    # np.unique flattens a 2-D array; a sort here would run along rows: refused rather than wrong
    for f in (distinct, first_indices):
        with pytest.raises(ValueError, match="1-D"):
            f(np.array([[1, 2], [2, 1]]))
