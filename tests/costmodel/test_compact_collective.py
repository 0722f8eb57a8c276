"""``_kernels.compact_collective`` against the NumPy formulation it replaced (sorts and uniques)."""

import numpy as np
import pytest

from costmodel import _kernels as K
from costmodel.lowering import _compact_collective
from ir.unique import first_indices


def _reference(counts, ints, flts, t_ex, q_ex, C, totals):
    """The NumPy version ``lowering._compact_collective`` ran before the kernel."""
    L, T, Q = int(counts[0]), int(counts[1]), int(counts[2])

    def rows_of(ex):
        bounds = np.zeros(C + 1, np.int64)
        np.cumsum(np.bincount(ex, minlength=C), out=bounds[1:])
        return np.argsort(ex, kind="stable"), bounds

    t_order, t_ptr = rows_of(t_ex)
    q_order, _ = rows_of(q_ex)
    tc, qc = ints[L:L + T][t_order], ints[L + T:L + T + Q][q_order]
    te, qe = t_ex[t_order], q_ex[q_order]
    _, first = first_indices(te * (int(tc[:, 0].max()) + 1) + tc[:, 0])
    t_keep = np.sort(first)
    width = int(qc[:, 2].max()) + 1 if Q else 1
    qkey = qc[:, 1] * width + qc[:, 2]
    _, first = first_indices(qe * (int(qkey.max()) + 1 if Q else 1) + qkey)
    q_keep = np.sort(first)
    te, qe = te[t_keep], qe[q_keep]
    sizes = np.stack([np.bincount(te, minlength=C), np.bincount(qe, minlength=C)], axis=1)
    kept = np.concatenate((tc[t_keep], qc[q_keep]))
    by_exchange = np.argsort(np.concatenate((2 * te, 2 * qe + 1)), kind="stable")
    f = np.zeros((t_keep.shape[0], flts.shape[1]))
    firsts = np.cumsum(sizes[:, 0]) - sizes[:, 0]
    f[firsts] = flts[t_order[t_ptr[:-1]]]
    f[firsts, 0] = totals
    out = counts.copy()
    out[1], out[2] = t_keep.shape[0], q_keep.shape[0]
    return out, np.concatenate((ints[:L], kept[by_exchange])), f, sizes


@pytest.mark.parametrize("seed", range(40))
def test_compact_collective_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    C = int(rng.integers(1, 6))
    L, T, Q = int(rng.integers(0, 20)), int(rng.integers(C, 60)), int(rng.integers(0, 80))
    n_shard, n_reader, n_rshard = int(rng.integers(1, 12)), int(rng.integers(1, 4)), int(rng.integers(1, 10))
    ints = np.empty((L + T + Q, 3), np.int64)
    ints[:L] = rng.integers(0, 8, (L, 3))
    ints[L:L + T, 0] = rng.integers(0, n_shard, T)
    ints[L:L + T, 1:] = rng.integers(0, 8, (T, 2))
    ints[L + T:, 0] = rng.integers(0, T, Q)
    ints[L + T:, 1] = rng.integers(0, n_reader, Q)
    ints[L + T:, 2] = rng.integers(0, n_rshard, Q)
    t_ex = np.concatenate([np.arange(C), rng.integers(0, C, T - C)])  # every exchange has a transfer
    rng.shuffle(t_ex)
    q_ex = t_ex[ints[L + T:, 0]]
    flts = rng.random((T, 7))
    totals = rng.random(C)
    counts = np.array([L, T, Q, 3, C], np.int64)
    want = _reference(counts, ints, flts, t_ex, q_ex, C, totals)
    got = _compact_collective(counts, ints, flts, t_ex, q_ex, C, totals)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype and w.shape == g.shape and np.array_equal(w, g)
    assert K.compact_collective(ints, L, T, Q, t_ex, q_ex, C, flts, totals)[2].sum() == got[0][1] + got[0][2]
