"""``_kernels.exchange_facts`` (the lowering's per-exchange facts in one compiled pass) against
the Python reference it must equal bit for bit: ``collectives.classify``, ``ranks_by_node``,
``all_to_all_time``'s busiest rank per link, NumPy's sums and ``bincount``."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel import collectives as C
from costmodel._kernels import exchange_facts
from ir.unique import distinct

N_DEV, PER_NODE = 16, 4


@st.composite
def groups(draw):
    """A group's transfers cut into exchanges: replicated reads (each shard's box to several
    devices, the all-gathers and broadcasts), reductions and arbitrary traffic."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n_ex = draw(st.integers(1, 4))
    src, dst, shard, nbytes, content, ex = [], [], [], [], [], []
    next_shard = 0
    for c in range(n_ex):
        kind = draw(st.sampled_from(["replicated", "reduce", "random", "tiny"]))
        n_shards = int(rng.integers(1, 6))
        for _ in range(n_shards):
            s, dev = next_shard, int(rng.integers(0, N_DEV))
            next_shard += 1
            copies = 1 if kind == "tiny" else int(rng.integers(1, 70))  # long runs: pairwise sums past 128
            size = float(rng.choice([8.0, 1e6 / 3, rng.random() * 1e9]))
            box = float(rng.integers(0, 3))
            for _ in range(copies):
                src.append(dev)
                dst.append(int(rng.integers(0, N_DEV)) if kind != "reduce" else int(rng.integers(0, 2)))
                shard.append(s if kind != "random" else int(rng.integers(0, next_shard)))
                nbytes.append(size if kind != "random" else float(rng.random() * 1e7))
                content.append(box if kind != "random" else float(rng.integers(0, 2)))
                ex.append(c)
    a = np.array
    ex = a(ex)
    order = np.argsort(ex, kind="stable")
    ptr = np.zeros(n_ex + 1, np.int64)
    np.cumsum(np.bincount(ex, minlength=n_ex), out=ptr[1:])
    reduce = draw(st.booleans())
    epb = rng.random(len(src)) * 1e-10
    return (order, ptr, a(src, np.int64), a(dst, np.int64), a(shard, np.int64), a(nbytes), epb, a(content), reduce)


@settings(max_examples=300, deadline=None)
@given(groups())
def test_exchange_facts_equal_the_python_reference(group):
    order, ptr, src, dst, shard, nbytes, epb, content, reduce = group
    iv, fv, r_ptr, ranks, recv, n_ptr, per_node = exchange_facts(
        order, ptr, src, dst, shard, nbytes, epb, content, reduce, N_DEV, PER_NODE, C.MIN_RANKS)
    for c in range(len(ptr) - 1):
        sel = order[ptr[c]:ptr[c + 1]]
        kind = C.classify(reduce, src[sel], dst[sel], nbytes[sel], shard[sel], content[sel])
        assert iv[c, 0] == (0 if kind is None else C.KIND_CODES[kind])
        assert iv[c, 1] == np.isin(dst[sel], src[sel]).all()
        r = distinct(np.concatenate((src[sel], dst[sel])))
        assert ranks[r_ptr[c]:r_ptr[c + 1]].tolist() == r.tolist()
        assert recv[r_ptr[c]:r_ptr[c + 1]].tolist() == np.bincount(dst[sel], weights=nbytes[sel],
                                                                   minlength=N_DEV)[r].tolist()
        assert per_node[n_ptr[c]:n_ptr[c + 1]].tolist() == C.ranks_by_node(r, PER_NODE)
        assert fv[c, 0] == nbytes[sel].sum() and fv[c, 1] == (nbytes[sel] * epb[sel]).sum()  # bit for bit
        inter = src[sel] // PER_NODE != dst[sel] // PER_NODE
        for k, on in enumerate((~inter, inter)):
            assert bool(iv[c, 2] & (1 << k)) == bool(on.any())
            if on.any():
                w = np.where(on, nbytes[sel], 0.0)
                busiest = max(np.bincount(src[sel], weights=w).max(), np.bincount(dst[sel], weights=w).max())
                assert fv[c, 2 + k] == busiest


def test_a_hand_worked_all_gather_and_reduce_scatter():
    # three devices on one node, each sending its 8-byte box to the two others
    src, dst, shard = np.array([0, 0, 1, 1, 2, 2]), np.array([1, 2, 0, 2, 0, 1]), np.array([0, 0, 1, 1, 2, 2])
    nbytes, content = np.full(6, 8.0), np.zeros(6)
    args = (np.arange(6), np.array([0, 6]), src, dst, shard, nbytes, np.full(6, 1e-11), content)
    for reduce, code in ((False, C.KIND_CODES["all_gather"]), (True, C.KIND_CODES["reduce_scatter"])):
        iv, fv, r_ptr, ranks, recv, n_ptr, per_node = exchange_facts(*args, reduce, N_DEV, PER_NODE, C.MIN_RANKS)
        assert iv.tolist() == [[code, 1, 1]]
        assert fv[0, :3].tolist() == [48.0, 48.0 * 1e-11, 16.0] and fv[0, 3] == 0.0
        assert ranks.tolist() == [0, 1, 2] and recv.tolist() == [16.0, 16.0, 16.0] and per_node.tolist() == [3]
    # two devices: point to point (code 0)
    iv = exchange_facts(np.arange(2), np.array([0, 2]), np.array([0, 1]), np.array([1, 0]), np.array([0, 1]),
                        np.full(2, 8.0), np.zeros(2), np.zeros(2), False, N_DEV, PER_NODE, C.MIN_RANKS)[0]
    assert iv[0, 0] == 0
