"""numba kernels of the lowering (see ``costmodel.lowering`` for what they compute and why).

All box arithmetic is on int64 and exact; volumes are integers (exact in float64 below 2**53),
so results do not depend on summation order. Float expressions repeat the NumPy reference's
operations in the same order (``max(f / (peak*ce), b / (bw*me)) + launch``, ``bytes / bw``)
and are therefore bit-identical to it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# Above this many cells of the compressed coordinate grid, unions are computed by box subtraction.
GRID_LIMIT = 1 << 21
# A GEMM with fewer output tiles than SMs is split along K (split-K, stream-K) into pieces of at
# least this many K-steps of ``k_half`` (``costmodel.efficiency``).
SPLIT_K_MIN_STEPS = 4.0


# ---------------------------------------------------------------------------------------------
# union volume of a few boxes
# ---------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _box_volume(lo, hi, i):
    v = 1
    for d in range(lo.shape[1]):
        e = hi[i, d] - lo[i, d]
        if e <= 0:
            return 0
        v *= e
    return v


@njit(cache=True, nogil=True)
def _grow(a, n):
    if n < a.shape[0]:
        return a
    b = np.empty((2 * a.shape[0], a.shape[1]), np.int64)
    b[: a.shape[0]] = a
    return b


@njit(cache=True, nogil=True)
def _union_by_subtraction(blo, bhi):
    """Σ_i vol(B_i minus (B_0 ∪ … ∪ B_{i-1})), each difference kept as disjoint pieces."""
    k, R = blo.shape
    total = 0
    for i in range(k):
        alo = np.empty((16, R), np.int64)
        ahi = np.empty((16, R), np.int64)
        alo[0, :] = blo[i, :]
        ahi[0, :] = bhi[i, :]
        n = 1
        for j in range(i):
            nlo = np.empty((max(16, 2 * n), R), np.int64)
            nhi = np.empty((max(16, 2 * n), R), np.int64)
            m = 0
            for q in range(n):
                hit = True
                for d in range(R):
                    if max(alo[q, d], blo[j, d]) >= min(ahi[q, d], bhi[j, d]):
                        hit = False
                        break
                if not hit:
                    nlo = _grow(nlo, m)
                    nhi = _grow(nhi, m)
                    nlo[m, :] = alo[q, :]
                    nhi[m, :] = ahi[q, :]
                    m += 1
                    continue
                cur_lo = alo[q, :].copy()
                cur_hi = ahi[q, :].copy()
                for d in range(R):  # slabs below and above box j along d, then clip to it
                    if cur_lo[d] < blo[j, d]:
                        nlo = _grow(nlo, m)
                        nhi = _grow(nhi, m)
                        nlo[m, :] = cur_lo
                        nhi[m, :] = cur_hi
                        nhi[m, d] = blo[j, d]
                        m += 1
                    if cur_hi[d] > bhi[j, d]:
                        nlo = _grow(nlo, m)
                        nhi = _grow(nhi, m)
                        nlo[m, :] = cur_lo
                        nhi[m, :] = cur_hi
                        nlo[m, d] = bhi[j, d]
                        m += 1
                    cur_lo[d] = max(cur_lo[d], blo[j, d])
                    cur_hi[d] = min(cur_hi[d], bhi[j, d])
            alo, ahi, n = nlo, nhi, m
            if n == 0:
                break
        for q in range(n):
            total += _box_volume(alo, ahi, q)
    return total


@njit(cache=True, nogil=True)
def union_volume(blo, bhi):
    """Exact volume (int64) of the union of boxes ``[blo[i], bhi[i])`` (empty boxes allowed)."""
    k, R = blo.shape
    nk = 0
    first = -1
    same = True
    for i in range(k):
        if _box_volume(blo, bhi, i) == 0:
            continue
        nk += 1
        if first < 0:
            first = i
        elif same:
            for d in range(R):
                if blo[i, d] != blo[first, d] or bhi[i, d] != bhi[first, d]:
                    same = False
                    break
    if nk == 0:
        return 0
    if same:  # one box, or copies of one box
        return _box_volume(blo, bhi, first)
    keep = np.empty(nk, np.int64)
    t = 0
    for i in range(k):
        if _box_volume(blo, bhi, i) > 0:
            keep[t] = i
            t += 1
    lo = np.empty((nk, R), np.int64)
    hi = np.empty((nk, R), np.int64)
    for t in range(nk):
        lo[t, :] = blo[keep[t], :]
        hi[t, :] = bhi[keep[t], :]
    # coordinate compression
    axes = np.empty((R, 2 * nk), np.int64)
    nu = np.empty(R, np.int64)
    cells = 1
    for d in range(R):
        c = np.empty(2 * nk, np.int64)
        c[:nk] = lo[:, d]
        c[nk:] = hi[:, d]
        c.sort()
        u = 0
        for x in range(2 * nk):
            if x == 0 or c[x] != c[x - 1]:
                axes[d, u] = c[x]
                u += 1
        nu[d] = u
        cells *= u - 1
        if cells > GRID_LIMIT:
            return _union_by_subtraction(lo, hi)
    stride = np.empty(R, np.int64)
    s = 1
    for d in range(R - 1, -1, -1):
        stride[d] = s
        s *= nu[d] - 1
    cover = np.zeros(cells, np.bool_)
    clo = np.empty(R, np.int64)
    chi = np.empty(R, np.int64)
    cur = np.empty(R, np.int64)
    for t in range(nk):
        for d in range(R):
            clo[d] = np.searchsorted(axes[d, : nu[d]], lo[t, d])
            chi[d] = np.searchsorted(axes[d, : nu[d]], hi[t, d])
            cur[d] = clo[d]
        while True:  # odometer over the box's cells
            f = 0
            for d in range(R):
                f += cur[d] * stride[d]
            cover[f] = True
            d = R - 1
            while d >= 0:
                cur[d] += 1
                if cur[d] < chi[d]:
                    break
                cur[d] = clo[d]
                d -= 1
            if d < 0:
                break
    total = 0
    for f in range(cells):
        if cover[f]:
            v = 1
            r = f
            for d in range(R - 1, -1, -1):
                j = r % (nu[d] - 1)
                r //= nu[d] - 1
                v *= axes[d, j + 1] - axes[d, j]
            total += v
    return total


# ---------------------------------------------------------------------------------------------
# one op: shard tasks and projected boxes
# ---------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _project(Ap, An, b, s, lo, hi, i, r, empty):
    """Row ``r`` of the image of index box ``i`` (interval arithmetic; empty box -> empty image)."""
    D = lo.shape[1]
    if empty:
        x = b[r]
        for j in range(D):
            x += (Ap[r, j] + An[r, j]) * lo[i, j]
        return x, x
    a = b[r]
    z = b[r] + s[r]
    for j in range(D):
        a += Ap[r, j] * lo[i, j] + An[r, j] * (hi[i, j] - 1)
        z += Ap[r, j] * (hi[i, j] - 1) + An[r, j] * lo[i, j]
    return a, z


@njit(cache=True)
def gemm_curve(points, k, curve):
    """Fraction of the tensor peak of a GEMM shard (``costmodel.efficiency.gemm_efficiency``):
    output tiles in waves over the SMs, split along K when there are fewer tiles than SMs."""
    tiles = max(np.ceil(points / curve[2]), 1.0)
    splits = max(1.0, min(np.floor(curve[3] / tiles), np.floor(k / (SPLIT_K_MIN_STEPS * curve[4]))))
    tiles *= splits
    kk = k / splits
    occ = tiles / (np.ceil(tiles / curve[3]) * curve[3])
    return curve[1] * occ * kk / (kk + curve[4])


@njit(cache=True, nogil=True)
def op_kernel(lo, hi, dev, in_Ap, in_An, in_b, in_s, in_shape, in_rank, in_item, out_Ap, out_An, out_b, out_s,
              out_shape, out_item, flops_per_point, flop_den, byte_den, launch, n_dev, src_port, curve, gemm):
    """Per shard: float64[n, 5] = (device, duration, output bytes, FLOPs, bytes read + written);
    output boxes int64[n, Ro] (unclipped images); input boxes int64[P, n, R] clipped to their
    tensors (rows beyond a port's rank are padding: [0, 1)); the first device outside
    ``0..n_dev-1`` (or -1); and for the ports with ``src_port[p]`` (they read a graph input),
    float64[P, n_dev] bytes of the union of the boxes read on each device (``resident_kernel``).

    ``curve`` float64[7] (``costmodel.efficiency.Curves.as_array``; ``curve[0] == 0``: off) scales
    the denominators per shard: the memory term by ``mem_peak · bytes / (bytes + mem_half)``, and,
    when ``gemm``, the FLOP term by ``gemm_peak · occupancy(tiles) · K / (K + k_half)`` with
    ``K = flops_per_point / 2``."""
    n, D = lo.shape
    P = in_Ap.shape[0]
    R = in_Ap.shape[1]
    Ro = out_Ap.shape[0]
    f = np.empty((n, 5), np.float64)
    out_lo = np.empty((n, Ro), np.int64)
    out_hi = np.empty((n, Ro), np.int64)
    in_lo = np.zeros((P, n, R), np.int64)
    in_hi = np.ones((P, n, R), np.int64)
    bad = -1
    for i in range(n):
        vol = 1
        empty = False
        for d in range(D):
            e = hi[i, d] - lo[i, d]
            if e <= 0:
                empty = True
            vol *= e
        flops = np.float64(vol) * flops_per_point
        read = 0.0
        for p in range(P):
            size = 1
            for r in range(in_rank[p]):
                a, z = _project(in_Ap[p], in_An[p], in_b[p], in_s[p], lo, hi, i, r, empty)
                a = min(max(a, 0), in_shape[p, r])
                z = min(max(z, a), in_shape[p, r])
                in_lo[p, i, r] = a
                in_hi[p, i, r] = z
                size *= z - a
            read += np.float64(size) * in_item[p]
        size = 1
        for r in range(Ro):
            a, z = _project(out_Ap, out_An, out_b, out_s, lo, hi, i, r, empty)
            out_lo[i, r] = a
            out_hi[i, r] = z
            a = min(max(a, 0), out_shape[r])
            z = min(max(z, a), out_shape[r])
            size *= z - a
        written = np.float64(size) * out_item
        nbytes = read + written
        tf = flops / flop_den
        tb = nbytes / byte_den
        if curve[0] != 0.0:
            if gemm and flops > 0.0:
                tf = flops / (flop_den * gemm_curve(np.float64(vol), max(flops_per_point / 2.0, 1.0), curve))
            if nbytes > 0.0:
                tb = nbytes / (byte_den * curve[5] * nbytes / (nbytes + curve[6]))
        if (dev[i] < 0 or dev[i] >= n_dev) and bad < 0:
            bad = dev[i]
        f[i, 0] = dev[i]
        f[i, 1] = max(tf, tb) + launch
        f[i, 2] = written
        f[i, 3] = flops
        f[i, 4] = nbytes
    res = np.zeros((P, n_dev), np.float64)
    if bad < 0:
        for p in range(P):
            if src_port[p]:
                res[p, :] = resident_kernel(in_lo[p, :, : in_rank[p]], in_hi[p, :, : in_rank[p]], dev, n_dev,
                                            in_item[p])
    return f, out_lo, out_hi, in_lo, in_hi, bad, res


# ---------------------------------------------------------------------------------------------
# one produced tensor: local edges and transfers to every reader
# ---------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _inter(p_lo, p_hi, pi, c_lo, c_hi, cj, ilo, ihi, row):
    """Intersection of producer box ``pi`` and reader box ``cj`` into row ``row``; its volume."""
    v = 1
    for d in range(p_lo.shape[1]):
        a = max(p_lo[pi, d], c_lo[cj, d])
        z = min(p_hi[pi, d], c_hi[cj, d])
        if z <= a:
            return 0
        ilo[row, d] = a
        ihi[row, d] = z
        v *= z - a
    return v


@njit(cache=True, nogil=True)
def _reader_index(c_lo, c_hi, r_counts, R):
    """Per reader (its shards ``[start, start + r_counts[k])`` of the concatenation), a sweep
    index for finding the shards that can meet a box: the dim with the most distinct starts
    (``dims[k]``), the shards sorted by their start on it (``order``), and whether their ends are
    sorted too (``ok[k]``: a tiling, with replicas; then the shards meeting ``[a, b)`` on that dim
    are one run of ``order``, found by two binary searches). A reader whose shards nest (``ok``
    false) is scanned whole."""
    K = r_counts.shape[0]
    dims = np.zeros(K, np.int64)
    ok = np.zeros(K, np.bool_)
    order = np.empty(c_lo.shape[0], np.int64)
    lo_s = np.empty(c_lo.shape[0], np.int64)
    hi_s = np.empty(c_lo.shape[0], np.int64)
    s = 0
    for k in range(K):
        n = r_counts[k]
        best, best_d = -1, 0
        for d in range(R):
            v = np.sort(c_lo[s:s + n, d])
            distinct = 1 if n else 0
            for i in range(1, n):
                if v[i] != v[i - 1]:
                    distinct += 1
            if distinct > best:
                best, best_d = distinct, d
        dims[k] = best_d
        o = np.argsort(c_lo[s:s + n, best_d], kind="mergesort")
        good = True
        for i in range(n):
            j = s + o[i]
            order[s + i] = j
            lo_s[s + i] = c_lo[j, best_d]
            hi_s[s + i] = c_hi[j, best_d]
            if i and hi_s[s + i] < hi_s[s + i - 1]:
                good = False
        ok[k] = good
        s += n
    return dims, ok, order, lo_s, hi_s


@njit(cache=True, nogil=True)
def _candidates(p_lo, p_hi, pi, r_counts, dims, ok, order, lo_s, hi_s, buf):
    """Reader shards (indices into the concatenation, increasing) that may meet producer box
    ``pi``: every shard of a reader without a sweep index, else the run whose interval on the
    reader's sweep dim meets the producer's. Returns how many are in ``buf``."""
    m = 0
    s = 0
    for k in range(r_counts.shape[0]):
        n = r_counts[k]
        if not ok[k]:
            for j in range(s, s + n):
                buf[m] = j
                m += 1
        else:
            d = dims[k]
            a = p_lo[pi, d]
            b = p_hi[pi, d]
            # first sorted shard whose end passes a; first whose start reaches b
            i0 = s + np.searchsorted(hi_s[s:s + n], a, side="right")
            i1 = s + np.searchsorted(lo_s[s:s + n], b, side="left")
            for i in range(i0, i1):
                buf[m] = order[i]
                m += 1
        s += n
    if m > 1:
        buf[:m] = np.sort(buf[:m])
    return m


@njit(cache=True, nogil=True)
def _box_hash(lo, hi, a, b, first):
    """53-bit hash (exact in a float64) of the bounding box of boxes ``a:b`` of ``lo``/``hi``
    over dims ``first:``: what a transfer carries, compared among one source's transfers
    (``collectives.classify``)."""
    h = np.uint64(0x9E3779B97F4A7C15)
    for j in range(first, lo.shape[1]):
        x = lo[a, j]
        y = hi[a, j]
        for i in range(a + 1, b):
            if lo[i, j] < x:
                x = lo[i, j]
            if hi[i, j] > y:
                y = hi[i, j]
        for v in (x, y):
            h = (h ^ np.uint64(v)) * np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(31)
    return np.float64(h >> np.uint64(11))


@njit(cache=True, nogil=True)
def _replica_classes(p_lo, p_hi):
    """Replicated producer shards (equal boxes: the same cells computed on several devices):
    ``cls[pi]``, the first shard of ``pi``'s box, and whether any box has more than one shard."""
    n = p_lo.shape[0]
    cls = np.arange(n)
    if n < 2:
        return cls, False
    h = np.empty(n, np.float64)
    for i in range(n):
        h[i] = _box_hash(p_lo, p_hi, i, i + 1, 0)
    o = np.argsort(h, kind="mergesort")
    any_rep = False
    a = 0
    while a < n:
        b = a + 1
        while b < n and h[o[b]] == h[o[a]]:
            b += 1
        # equal hashes: compare the boxes (a stable sort: the first of a box in the run is its
        # lowest shard, which represents it)
        for x in range(a + 1, b):
            i = o[x]
            for y in range(a, x):
                j = o[y]
                if cls[j] == j and _same_box(p_lo, p_hi, i, j):
                    cls[i] = j
                    any_rep = True
                    break
        a = b
    return cls, any_rep


@njit(cache=True, nogil=True)
def _same_box(lo, hi, i, j):
    for d in range(lo.shape[1]):
        if lo[i, d] != lo[j, d] or hi[i, d] != hi[j, d]:
            return False
    return True


@njit(cache=True, nogil=True)
def _serves(pi, d, cls, members, m_ptr, p_dev, dev_per_node):
    """Whether producer shard ``pi`` is the replica of its box that device ``d`` reads: the one
    on ``d`` if there is one, else one on ``d``'s node, else any; among several, the one at
    ``d`` modulo their number (readers on different devices spread over the replicas)."""
    c = cls[pi]
    a = m_ptr[c]
    b = m_ptr[c + 1]
    if b - a <= 1:
        return True
    same = 0
    for x in range(a, b):
        q = p_dev[members[x]]
        if q == d:
            return members[x] == pi
        if q // dev_per_node == d // dev_per_node:
            same += 1
    pick = d % same if same else d % (b - a)
    for x in range(a, b):
        if same == 0 or p_dev[members[x]] // dev_per_node == d // dev_per_node:
            if pick == 0:
                return members[x] == pi
            pick -= 1
    return False


@njit(cache=True, nogil=True)
def group_kernel(p_lo, p_hi, p_dev, c_lo, c_hi, c_dev, r_counts, n_dev, itemsize, dev_per_node,
                 lat_intra, bw_intra, epb_intra, lat_inter, bw_inter, epb_inter):
    """Edges from the producer's shards to every reader shard of one tensor.

    Returns ``counts`` int64[3] = (L, T, Q), ``ints`` int64[L + T + Q, 3] holding L local edges
    (producer shard, reader, reader shard), T transfers (producer shard, destination device, first
    reader) and Q transfer→reader edges (transfer, reader, reader shard), and ``flts``
    float64[T, 6] = (bytes, port seconds = bytes / bandwidth, joules per byte, latency seconds,
    link: 0 = intra-node port, 1 = inter-node port, content: a 53-bit hash of the bounding box of
    what it carries, equal for two transfers that carry the same box; the same without the first
    dim: for partials, the box of the sum they are part of, whatever their part) per transfer. One transfer per (producer shard, destination device) carries the union of what
    that device's reader shards need from it. A box computed on several devices (replicas) is
    read from one of them (``_serves``: the reader's own device, else its node, else any).
    Reader shards are concatenated reader by reader (``r_counts[k]`` shards of reader ``k``).
    """
    npr = p_lo.shape[0]
    nc = c_lo.shape[0]
    R = p_lo.shape[1]
    c_reader = np.empty(nc, np.int64)
    c_shard = np.empty(nc, np.int64)
    x = 0
    for k in range(r_counts.shape[0]):
        for j in range(r_counts[k]):
            c_reader[x] = k
            c_shard[x] = j
            x += 1
    one_lo = np.empty((1, R), np.int64)
    one_hi = np.empty((1, R), np.int64)
    # pass 1: counts
    L = 0
    Q = 0
    T = 0
    seen = np.full(n_dev, -1, np.int64)
    # only the reader shards a producer box can meet are tested (a sweep per reader): at 512
    # devices every pair of a 512-way tensor is 262,144 tests, most of them empty
    dims, ok, order, lo_s, hi_s = _reader_index(c_lo, c_hi, r_counts, R)
    buf = np.empty(nc, np.int64)
    # a replicated box is read from one of its replicas (``_serves``), not from each of them
    cls, any_rep = _replica_classes(p_lo, p_hi)
    m_ptr = np.zeros(npr + 1, np.int64)
    members = np.empty(npr, np.int64)
    if any_rep:
        for i in range(npr):
            m_ptr[cls[i] + 1] += 1
        for i in range(npr):
            m_ptr[i + 1] += m_ptr[i]
        fill = m_ptr[:npr].copy()
        for i in range(npr):
            members[fill[cls[i]]] = i
            fill[cls[i]] += 1
    for pi in range(npr):
        m = _candidates(p_lo, p_hi, pi, r_counts, dims, ok, order, lo_s, hi_s, buf)
        for q in range(m):
            cj = buf[q]
            if any_rep and not _serves(pi, c_dev[cj], cls, members, m_ptr, p_dev, dev_per_node):
                continue
            if _inter(p_lo, p_hi, pi, c_lo, c_hi, cj, one_lo, one_hi, 0) > 0:
                if c_dev[cj] == p_dev[pi]:
                    L += 1
                else:
                    Q += 1
                    if seen[c_dev[cj]] != pi:
                        seen[c_dev[cj]] = pi
                        T += 1
    ints = np.empty((L + T + Q, 3), np.int64)
    flts = np.empty((T, 7), np.float64)
    counts = np.empty(3, np.int64)
    counts[0] = L
    counts[1] = T
    counts[2] = Q
    if L + Q == 0:
        return counts, ints, flts
    # pass 2: fill
    pair_c = np.empty(nc, np.int64)
    plo = np.empty((nc, R), np.int64)
    phi = np.empty((nc, R), np.int64)
    slo = np.empty((nc, R), np.int64)
    shi = np.empty((nc, R), np.int64)
    tid = np.full(n_dev, -1, np.int64)
    first = np.empty(n_dev, np.int64)
    cnt = np.zeros(n_dev, np.int64)
    pos = np.empty(n_dev + 1, np.int64)
    l_row = 0
    t_row = L
    q_row = L + T
    t = 0
    for pi in range(npr):
        npair = 0
        m = _candidates(p_lo, p_hi, pi, r_counts, dims, ok, order, lo_s, hi_s, buf)
        for q0 in range(m):
            cj = buf[q0]
            if any_rep and not _serves(pi, c_dev[cj], cls, members, m_ptr, p_dev, dev_per_node):
                continue
            if _inter(p_lo, p_hi, pi, c_lo, c_hi, cj, plo, phi, npair) > 0:
                if c_dev[cj] == p_dev[pi]:
                    ints[l_row, 0] = pi
                    ints[l_row, 1] = c_reader[cj]
                    ints[l_row, 2] = c_shard[cj]
                    l_row += 1
                else:
                    d = c_dev[cj]
                    if cnt[d] == 0:
                        first[d] = c_reader[cj]
                    cnt[d] += 1
                    pair_c[npair] = cj
                    npair += 1
        if npair == 0:
            continue
        # the needed boxes grouped by destination device (counting sort), then one union each
        pos[0] = 0
        for d in range(n_dev):
            pos[d + 1] = pos[d] + cnt[d]
        for q in range(npair):
            d = c_dev[pair_c[q]]
            x = pos[d + 1] - cnt[d]
            slo[x, :] = plo[q, :]
            shi[x, :] = phi[q, :]
            cnt[d] -= 1
        src = p_dev[pi]
        for d in range(n_dev):  # transfers of this producer shard in destination order
            if pos[d + 1] == pos[d]:
                continue
            nbytes = np.float64(union_volume(slo[pos[d]:pos[d + 1]], shi[pos[d]:pos[d + 1]])) * itemsize
            if src // dev_per_node == d // dev_per_node:
                dur = nbytes / bw_intra
                lat = lat_intra
                epb = epb_intra
                lk = 0.0
            else:
                dur = nbytes / bw_inter
                lat = lat_inter
                epb = epb_inter
                lk = 1.0
            ints[t_row, 0] = pi
            ints[t_row, 1] = d
            ints[t_row, 2] = first[d]
            flts[t, 0] = nbytes
            flts[t, 1] = dur
            flts[t, 2] = epb
            flts[t, 3] = lat
            flts[t, 4] = lk
            flts[t, 5] = _box_hash(slo, shi, pos[d], pos[d + 1], 0)
            flts[t, 6] = _box_hash(slo, shi, pos[d], pos[d + 1], 1)
            tid[d] = t
            t += 1
            t_row += 1
        for q in range(npair):
            cj = pair_c[q]
            ints[q_row, 0] = tid[c_dev[cj]]
            ints[q_row, 1] = c_reader[cj]
            ints[q_row, 2] = c_shard[cj]
            q_row += 1
    return counts, ints, flts


@njit(cache=True, nogil=True)
def resident_kernel(lo, hi, dev, n_dev, itemsize):
    """float64[n_dev]: bytes of the union of the boxes read on each device."""
    n, R = lo.shape
    out = np.zeros(n_dev, np.float64)
    cnt = np.zeros(n_dev, np.int64)
    for i in range(n):
        cnt[dev[i]] += 1
    for d in range(n_dev):
        if cnt[d] == 0:
            continue
        glo = np.empty((cnt[d], R), np.int64)
        ghi = np.empty((cnt[d], R), np.int64)
        k = 0
        for i in range(n):
            if dev[i] == d:
                glo[k, :] = lo[i, :]
                ghi[k, :] = hi[i, :]
                k += 1
        out[d] = np.float64(union_volume(glo, ghi)) * itemsize
    return out


# ---------------------------------------------------------------------------------------------
# the whole plan
# ---------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _root(parent, a):
    """The root of ``a`` in a union-find forest, halving the path on the way."""
    while parent[a] != a:
        parent[a] = parent[parent[a]]
        a = parent[a]
    return a


@njit(cache=True, nogil=True)
def exchanges(src, dst, n_devices):
    """The connected sets of devices of a group's transfers (``src[i] -> dst[i]``), by union-find:
    the set of each transfer, numbered in order of first transfer, and how many there are."""
    parent = np.arange(n_devices)
    for i in range(src.shape[0]):
        a = _root(parent, src[i])
        b = _root(parent, dst[i])
        if a != b:
            parent[max(a, b)] = min(a, b)
    number = np.full(n_devices, -1, np.int64)
    out = np.empty(src.shape[0], np.int64)
    k = 0
    for i in range(src.shape[0]):
        a = _root(parent, src[i])
        if number[a] < 0:
            number[a] = k
            k += 1
        out[i] = number[a]
    return out, k


@njit(cache=True, nogil=True)
def shard_exchanges(rows, L, T, n_prod, r_counts, p_dev, n_devices):
    """The independent exchanges of a microbatched group, by union-find over *shards* rather
    than devices: a producer shard and the reader shards it feeds (``rows``: the group kernel's
    L local, T transfer and Q transfer->reader rows) are one exchange, so each microbatch's
    exchange among the same devices is its own. Returns the exchange of each transfer row,
    numbered in order of first transfer, and their count, or -1 when an exchange holds two
    producer shards on one device (partials of several microbatches reduced together: the
    lowering sums them on each device and reduces once per exchange of devices)."""
    n_read = 0
    for k in range(r_counts.shape[0]):
        n_read += r_counts[k]
    r_off = np.zeros(r_counts.shape[0] + 1, np.int64)
    for k in range(r_counts.shape[0]):
        r_off[k + 1] = r_off[k] + r_counts[k]
    parent = np.arange(n_prod + n_read)
    used = np.zeros(n_prod, np.bool_)
    Q = rows.shape[0] - L - T
    for i in range(L + Q):
        if i < L:
            p = rows[i, 0]
            c = n_prod + r_off[rows[i, 1]] + rows[i, 2]
        else:
            q = L + T + (i - L)
            p = rows[L + rows[q, 0], 0]
            c = n_prod + r_off[rows[q, 1]] + rows[q, 2]
        used[p] = True
        a = _root(parent, p)
        b = _root(parent, c)
        if a != b:
            parent[max(a, b)] = min(a, b)
    number = np.full(n_prod + n_read, -1, np.int64)
    out = np.empty(T, np.int64)
    k = 0
    for t in range(T):
        a = _root(parent, rows[L + t, 0])
        if number[a] < 0:
            number[a] = k
            k += 1
        out[t] = number[a]
    keys = np.empty(n_prod, np.int64)  # (exchange, device) of each producer shard taking part
    m = 0
    for p in range(n_prod):
        if used[p]:
            e = number[_root(parent, p)]
            if e >= 0:
                keys[m] = e * n_devices + p_dev[p]
                m += 1
    keys = np.sort(keys[:m])
    for i in range(1, m):
        if keys[i] == keys[i - 1]:
            return out, -1
    return out, k


@njit(cache=True, nogil=True)
def assemble(op_sizes, op_f, g_prod, g_rptr, g_rop, g_counts, g_ints, g_flts, res, n_dev, g_state, op_inplace,
             g_coll, c_parts):
    """Flat simulator arrays from the per-op and per-group pieces (see ``Lowerer._assemble``).

    ``g_state[g]`` = 1 marks the group of a loop-carried state ``P`` read from its home (the
    shards of ``P.next``'s producer): its transfers have no producer edge (the state is there
    before the step starts) and its local edges are dropped (a local read of the state is free).
    ``op_inplace[i]`` = 1 marks the producer of a ``P.next``: it writes into ``P``'s resident
    buffer, so its compute nodes allocate nothing.

    ``g_counts[g, 3]`` = K > 0 marks a group run as ``C = g_counts[g, 4]`` collectives
    (``costmodel.collectives``), one per independent exchange (a tensor-parallel reduction in each
    data-parallel replica is one): each becomes one node of kind 2, with a row of ``g_coll`` =
    (port seconds, latency, joules per byte, link mask, its transfer rows, its reader rows, its
    participants) and its participants in ``c_parts`` (device, bytes received); edges from every
    producer shard it reads (none for a state) and to every reader shard it feeds. Other groups
    have one row of zeros in ``g_coll``.
    Also returned: ``link`` int8[n] and the participants' CSR ``part_ptr``, ``part_dev``,
    ``part_alloc`` (the simulator's contract).

    Returns ``kind``, ``i32`` = rows (dev, dst), ``f64`` = rows (dur, alloc, lat), ``succ_ptr``,
    ``succ_idx``, ``resident``, ``ints`` = (op offsets [k+1], transfer_op [T], transfer_src_op [T])
    and ``flts`` = (flops [nc], nbytes [nc], transfer_epb [T]): few arrays, because returning each
    one from compiled code costs about half a microsecond."""
    k = op_sizes.shape[0]
    off = np.zeros(k + 1, np.int64)
    for i in range(k):
        off[i + 1] = off[i] + op_sizes[i]
    nc = off[k]
    roff = np.empty(g_rop.shape[0], np.int64)  # first node of each reader op
    for q in range(g_rop.shape[0]):
        roff[q] = off[g_rop[q]]
    G = g_prod.shape[0]
    L = 0
    T = 0
    Q = 0
    KP = 0
    for g in range(G):
        if g_counts[g, 3] > 0:
            T += g_counts[g, 4]
            KP += g_counts[g, 3]
        else:
            T += g_counts[g, 1]
        Q += g_counts[g, 2]
        if g_state[g] == 0:
            L += g_counts[g, 0] + g_counts[g, 1]  # local edges and producer -> transfer edges (upper bound)
    n = nc + T
    m = L + Q
    kind = np.zeros(n, np.int8)
    link = np.zeros(n, np.int8)
    part_ptr = np.empty(n + 1, np.int64)  # written per node: 0 up to the transfers, then below
    part_ptr[: nc + 1] = 0
    part_dev = np.empty(KP, np.int32)
    part_alloc = np.empty(KP, np.float64)
    stamp = np.full(nc, -1, np.int64)  # dedupes a collective's edges
    i32 = np.empty((2, n), np.int32)  # rows: dev, dst
    f64 = np.empty((3, n), np.float64)  # rows: dur, alloc, lat
    ints = np.empty(k + 1 + 2 * T, np.int64)  # op offsets, transfer_op, transfer_src_op
    flts = np.empty(2 * nc + T, np.float64)  # flops, nbytes, transfer_epb
    dev = i32[0]
    dst = i32[1]
    dur = f64[0]
    alloc = f64[1]
    lat = f64[2]
    flops = flts[:nc]
    nbytes = flts[nc : 2 * nc]
    t_epb = flts[2 * nc :]
    ints[: k + 1] = off
    t_op = ints[k + 1 : k + 1 + T]
    t_src_op = ints[k + 1 + T :]
    dst[:nc] = -1
    lat[:nc] = 0.0
    for i in range(nc):  # (a loop writing all seven rows at once is slower)
        dev[i] = np.int32(op_f[i, 0])
        dur[i] = op_f[i, 1]
        alloc[i] = op_f[i, 2]
        flops[i] = op_f[i, 3]
        nbytes[i] = op_f[i, 4]
    for i in range(k):
        if op_inplace[i] != 0:
            for x in range(off[i], off[i + 1]):
                alloc[x] = 0.0
    # the edges in the order generated, sorted by source below. Hot loops index slices from 0 and
    # src is unsigned, so numba can drop its negative-index wraparound.
    src = np.empty(m, np.uint32)
    tgt = np.empty(m, np.int32)
    e = 0
    t_base = 0  # node of the group's first transfer (or its collective), minus nc
    f_base = 0  # row of the group's first transfer in g_flts
    row = 0
    kp = 0
    crow = 0  # this group's first row of g_coll
    mark = 0  # stamp values: one pair per collective (producers mark + 1, readers -mark - 2)
    for g in range(G):
        lg = g_counts[g, 0]
        tg = g_counts[g, 1]
        qg = g_counts[g, 2]
        kg = g_counts[g, 3]
        p_off = off[g_prod[g]]
        r0 = g_rptr[g]
        state = g_state[g] != 0
        if not state:
            rows = g_ints[row : row + lg]
            es = src[e : e + lg]
            et = tgt[e : e + lg]
            for x in range(lg):
                es[x] = p_off + rows[x, 0]
                et[x] = roff[r0 + rows[x, 1]] + rows[x, 2]
            e += lg
        row += lg
        if kg > 0:  # the group's transfers as g_counts[g, 4] collectives, each its rows in turn
            for c in range(g_counts[g, 4]):
                tc = np.int64(g_coll[crow, 4])
                qc = np.int64(g_coll[crow, 5])
                kc = np.int64(g_coll[crow, 6])
                node = nc + t_base
                kind[node] = 2
                dst[node] = -1
                total = 0.0
                for x in range(tc):
                    total += g_flts[f_base + x, 0]
                dur[node] = g_coll[crow, 0]
                lat[node] = g_coll[crow, 1]
                alloc[node] = total
                t_epb[t_base] = g_coll[crow, 2]
                link[node] = np.int8(g_coll[crow, 3])
                t_op[t_base] = g_rop[r0 + g_ints[row, 2]]
                t_src_op[t_base] = g_prod[g]
                dev[node] = np.int32(c_parts[kp, 0])
                for x in range(kc):
                    part_dev[kp + x] = np.int32(c_parts[kp + x, 0])
                    part_alloc[kp + x] = c_parts[kp + x, 1]
                kp += kc
                part_ptr[node + 1] = kp
                mark += 1
                if not state:
                    rows = g_ints[row : row + tc]
                    es = src[e : e + tc]
                    sorted_ = True  # increasing shards are distinct: no stamp pass needed
                    for x in range(tc):
                        es[x] = p_off + rows[x, 0]
                        tgt[e + x] = node
                        if x > 0 and es[x] <= es[x - 1]:
                            sorted_ = False
                    if sorted_:
                        e += tc
                    else:
                        for x in range(tc):
                            s = es[x]
                            if stamp[s] != mark:
                                stamp[s] = mark
                                src[e] = s
                                e += 1
                row += tc
                rows = g_ints[row : row + qc]
                et = tgt[e : e + qc]
                for x in range(qc):  # reader shards, then a second stamp pass keeps each one's first
                    et[x] = roff[r0 + rows[x, 1]] + rows[x, 2]
                for x in range(qc):
                    r = et[x]
                    if stamp[r] != -1 - mark:
                        stamp[r] = -1 - mark
                        src[e] = node
                        tgt[e] = r
                        e += 1
                row += qc
                t_base += 1
                f_base += tc
                crow += 1
            continue
        crow += 1
        for x in range(tg):
            node = nc + t_base + x
            kind[node] = 1
            part_ptr[node + 1] = kp
            dev[node] = dev[p_off + g_ints[row + x, 0]]
            dst[node] = np.int32(g_ints[row + x, 1])
            dur[node] = g_flts[f_base + x, 1]
            lat[node] = g_flts[f_base + x, 3]
            alloc[node] = g_flts[f_base + x, 0]
            link[node] = np.int8(g_flts[f_base + x, 4])
            t_epb[t_base + x] = g_flts[f_base + x, 2]
            t_op[t_base + x] = g_rop[r0 + g_ints[row + x, 2]]
            t_src_op[t_base + x] = g_prod[g]
            if not state:
                src[e] = p_off + g_ints[row + x, 0]
                tgt[e] = node
                e += 1
        row += tg
        for x in range(qg):
            src[e] = nc + t_base + g_ints[row + x, 0]
            tgt[e] = roff[r0 + g_ints[row + x, 1]] + g_ints[row + x, 2]
            e += 1
        row += qg
        t_base += tg
        f_base += tg
    m = e
    # CSR by a stable counting sort on the source: nxt[s] (= ptr[s + 1]) counts s's edges, then
    # is s's next slot, and so ends as the end of its edges (no separate fill array)
    ptr = np.zeros(n + 1, np.int64)
    nxt = ptr[1:]
    if m > 0:  # sources come in runs (a shard's readers): count each run at once
        cur = src[0]
        c = 0
        for x in range(m):
            s = src[x]
            if s != cur:
                nxt[cur] += c
                cur = s
                c = 0
            c += 1
        nxt[cur] += c
    start = 0
    for i in range(n):
        c = nxt[i]
        nxt[i] = start
        start += c
    idx = np.empty(m, np.int32)
    if m > 0:  # ... and keep the run's next slot in a register
        cur = src[0]
        p = nxt[cur]
        for x in range(m):
            s = src[x]
            if s != cur:
                nxt[cur] = p
                cur = s
                p = nxt[s]
            idx[p] = tgt[x]
            p += 1
        nxt[cur] = p
    resident = np.zeros(n_dev, np.float64)
    for s in range(res.shape[0] // n_dev):  # one row of n_dev per input tensor, added in order
        for d in range(n_dev):
            resident[d] += res[s * n_dev + d]
    return kind, i32, f64, ptr, idx, resident, ints, flts, link, part_ptr, part_dev, part_alloc


@njit(cache=True, nogil=True)
def topo_hint(op_offsets, t_src_op, t_op, fetch_reader, n):
    """``Lowered.topo_hint``. Ops in program order; before op ``o``: the gathers of loop-carried
    states it reads first (their producer is the state's update, at the step's end), then the ops
    fed by sources only whose first reader is ``o`` (``fetch_reader``: a weight's cast, which the
    lookahead fetches just in time) with their transfers; then ``o``'s own compute nodes (already
    numbered in op order) and the transfers of its output. Counting sorts of the transfers and
    of the fetched ops only."""
    k = op_offsets.shape[0] - 1
    nc = op_offsets[k]
    T = n - nc
    # per op o, transfer slots 3o (state gathers read first by o), 3o + 1 (transfers of the ops
    # fetched for o), 3o + 2 (transfers of o's output)
    start = np.zeros(3 * k + 1, np.int64)
    key = np.empty(T, np.int64)
    for t in range(T):
        s = t_src_op[t]
        if s >= t_op[t]:
            key[t] = 3 * t_op[t]
        elif fetch_reader[s] >= 0:
            key[t] = 3 * fetch_reader[s] + 1
        else:
            key[t] = 3 * s + 2
        start[key[t] + 1] += 1
    for j in range(3 * k):
        start[j + 1] += start[j]
    tr = np.empty(T, np.int32)
    fill = start.copy()
    for t in range(T):
        tr[fill[key[t]]] = nc + t
        fill[key[t]] += 1
    # the fetched ops, by their reader (in op order)
    f_start = np.zeros(k + 1, np.int64)
    for o in range(k):
        if fetch_reader[o] >= 0:
            f_start[fetch_reader[o] + 1] += 1
    for j in range(k):
        f_start[j + 1] += f_start[j]
    f_ops = np.empty(f_start[k], np.int64)
    f_fill = f_start.copy()
    for o in range(k):
        if fetch_reader[o] >= 0:
            f_ops[f_fill[fetch_reader[o]]] = o
            f_fill[fetch_reader[o]] += 1
    out = np.empty(n, np.int32)
    m = 0
    for o in range(k):
        m = _put(out, m, tr[start[3 * o]:start[3 * o + 1]])
        for y in range(f_start[o], f_start[o + 1]):
            m = _put_range(out, m, op_offsets[f_ops[y]], op_offsets[f_ops[y] + 1])
        m = _put(out, m, tr[start[3 * o + 1]:start[3 * o + 2]])
        if fetch_reader[o] < 0:
            m = _put_range(out, m, op_offsets[o], op_offsets[o + 1])
        m = _put(out, m, tr[start[3 * o + 2]:start[3 * o + 3]])
    return out


@njit(cache=True, nogil=True)
def _put(out, m, items):
    """``out[m:m + len(items)] = items``; returns the next position."""
    for x in range(items.shape[0]):
        out[m + x] = items[x]
    return m + items.shape[0]


@njit(cache=True, nogil=True)
def _put_range(out, m, lo, hi):
    """``out[m:m + hi - lo] = lo, ..., hi - 1``; returns the next position."""
    for i in range(lo, hi):
        out[m + i - lo] = i
    return m + hi - lo


# ---------------------------------------------------------------------------------------------
# collectives: the facts of each exchange of a group at once
# ---------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _block_sum(a, lo, n):
    """``np.sum(a[lo:lo + n])`` for ``n <= 128``: one of NumPy's pairwise blocks (eight
    accumulators from eight values on)."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r = a[lo:lo + 8].copy()
    m = n - n % 8
    for i in range(8, m, 8):
        for j in range(8):
            r[j] += a[lo + i + j]
    res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    for i in range(m, n):
        res += a[lo + i]
    return res


@njit(cache=True, nogil=True)
def _np_sum(a, n):
    """``np.sum(a[:n])`` bit for bit: NumPy's pairwise summation, blocks of up to 128 values
    (``_block_sum``), a longer run split in two halves at a multiple of 8 and their sums added.
    The recursion runs on a stack (a recursive function defeats numba's cache)."""
    if n <= 128:
        return _block_sum(a, 0, n)
    los = np.empty(128, np.int64)  # pending runs: start, length, halves pushed yet
    lens = np.empty(128, np.int64)
    split = np.zeros(128, np.bool_)
    vals = np.empty(128, np.float64)  # sums of finished runs, left before right
    top = 0
    los[0], lens[0] = 0, n
    nv = 0
    while top >= 0:
        lo, m = los[top], lens[top]
        if m <= 128:
            vals[nv] = _block_sum(a, lo, m)
            nv += 1
            top -= 1
        elif split[top]:
            nv -= 1
            vals[nv - 1] = vals[nv - 1] + vals[nv]
            top -= 1
        else:
            split[top] = True
            half = m // 2
            half -= half % 8
            los[top + 1], lens[top + 1], split[top + 1] = lo + half, m - half, False
            los[top + 2], lens[top + 2], split[top + 2] = lo, half, False
            top += 2
    return vals[0]


@njit(cache=True, nogil=True)
def exchange_facts(order, ptr, src, dst, shard, nbytes, epb, content, reduce, n_dev, dev_per_node, min_ranks):
    """What ``Lowerer._collectives`` needs of each exchange ``c`` of a group, whose transfers
    are ``order[ptr[c]:ptr[c + 1]]`` (in row order; ``src``, ``dst``, ``shard``, ``nbytes``,
    ``epb``, ``content`` per transfer), as ``collectives.classify``, ``ranks_by_node`` and
    ``all_to_all_time`` and NumPy's sums and ``bincount`` give it, bit for bit.

    Returns ``iv`` int64[C, 3] = (``collectives.KIND_CODES`` code of ``classify``, 0 when it stays
    point to point; 1 when every destination is also a source; which links it uses: 1 NVLink,
    2 NIC), ``fv`` float64[C, 4] = (bytes, bytes x joules per byte, the most bytes a rank sends
    or receives over NVLink, over the NIC), the ranks of each exchange (CSR ``r_ptr``,
    ``ranks`` ascending, ``recv`` bytes each receives) and its ranks per node (CSR ``n_ptr``,
    ``per_node``, nodes ascending)."""
    C = ptr.shape[0] - 1
    iv = np.zeros((C, 3), np.int64)
    fv = np.zeros((C, 4), np.float64)
    r_ptr = np.zeros(C + 1, np.int64)
    n_ptr = np.zeros(C + 1, np.int64)
    most = min(C * n_dev, 2 * (ptr[C] - ptr[0]))  # ranks in all: at most each transfer's two
    ranks = np.empty(most, np.int64)
    recv = np.empty(most, np.float64)
    per_node = np.empty(most, np.int64)
    seen = np.zeros(n_dev, np.int64)  # c + 1 on the devices of exchange c
    is_src = np.zeros(n_dev, np.int64)  # c + 1 on its sources
    got = np.zeros(n_dev, np.float64)
    sent = np.zeros((2, n_dev), np.float64)
    taken = np.zeros((2, n_dev), np.float64)
    shard_seen = np.full(shard.max() + 1 if shard.shape[0] else 0, -1, np.int64)  # c: a run of exchange c
    buf = np.empty(ptr[C] - ptr[0], np.float64)
    for c in range(C):
        a, b = ptr[c], ptr[c + 1]
        n = b - a
        for x in range(a, b):
            t = order[x]
            is_src[src[t]] = c + 1
            for j in range(2):
                d = src[t] if j == 0 else dst[t]
                seen[d] = c + 1
                got[d] = 0.0
                for k in range(2):
                    sent[k, d] = 0.0
                    taken[k, d] = 0.0
        local = 1
        links = 0
        for x in range(a, b):  # bincount's sums, in row order
            t = order[x]
            got[dst[t]] += nbytes[t]
            k = 1 if src[t] // dev_per_node != dst[t] // dev_per_node else 0
            links |= k + 1
            sent[k, src[t]] += nbytes[t]
            taken[k, dst[t]] += nbytes[t]
            if is_src[dst[t]] != c + 1:
                local = 0
        m = r_ptr[c]
        q = n_ptr[c]
        node = -1
        for d in range(n_dev):
            if seen[d] == c + 1:
                ranks[m] = d
                recv[m] = got[d]
                m += 1
                if d // dev_per_node != node:
                    node = d // dev_per_node
                    per_node[q] = 0
                    q += 1
                per_node[q - 1] += 1
                for k in range(2):
                    fv[c, 2 + k] = max(fv[c, 2 + k], sent[k, d], taken[k, d])
        r_ptr[c + 1] = m
        n_ptr[c + 1] = q
        for x in range(a, b):
            buf[x - a] = nbytes[order[x]]
        fv[c, 0] = _np_sum(buf, n)
        for x in range(a, b):
            buf[x - a] = nbytes[order[x]] * epb[order[x]]
        fv[c, 1] = _np_sum(buf, n)
        iv[c, 1] = local
        iv[c, 2] = links
        if n < 2 or m - r_ptr[c] < min_ranks:
            continue
        if reduce:
            code = 5  # reduce
            for x in range(a, b):
                if dst[order[x]] != dst[order[a]]:
                    code = 1  # reduce_scatter
            iv[c, 0] = code
            continue
        # a replicated read: runs of one shard, each at least two transfers of the same bytes and
        # box, every shard in one run
        code = 2  # all_gather
        runs = 0
        x = a
        while x < b:
            s = shard[order[x]]
            y = x + 1
            while y < b and shard[order[y]] == s:
                if nbytes[order[y]] != nbytes[order[x]] or content[order[y]] != content[order[x]]:
                    code = 6
                y += 1
            if y - x < 2 or shard_seen[s] == c:
                code = 6  # all_to_all
            shard_seen[s] = c
            runs += 1
            x = y
        iv[c, 0] = 4 if code == 2 and runs == 1 else code  # broadcast
    return iv, fv, r_ptr, ranks[:r_ptr[C]], recv[:r_ptr[C]], n_ptr, per_node[:n_ptr[C]]


@njit(cache=True, nogil=True)
def compact_collective(ints, L, T, Q, t_ex, q_ex, C, flts, totals):
    """``lowering._compact_collective``'s rows: ``ints[:L]`` (local edges), then for each of the
    ``C`` exchanges (``t_ex``/``q_ex``: the exchange of each transfer row ``ints[L + x]`` and
    reader row ``ints[L + T + x]``) the first transfer row of each producer shard, then the first
    reader row of each (reader, reader shard), both in row order. Returns those rows, ``f``
    float64[kept transfers, flts columns]: zeros but for each exchange's first row, which is
    ``flts`` of its first transfer with ``totals[c]`` in column 0, and ``sizes`` int64[C, 2]
    (transfer rows, reader rows kept per exchange). Rows are taken exchange by exchange (counting
    sorts) and repeats dropped by stamps: what the NumPy version did with sorts and uniques."""
    t_ptr = np.zeros(C + 1, np.int64)
    q_ptr = np.zeros(C + 1, np.int64)
    for x in range(T):
        t_ptr[t_ex[x] + 1] += 1
    for x in range(Q):
        q_ptr[q_ex[x] + 1] += 1
    for c in range(C):
        t_ptr[c + 1] += t_ptr[c]
        q_ptr[c + 1] += q_ptr[c]
    t_order = np.empty(T, np.int64)
    q_order = np.empty(Q, np.int64)
    nxt = t_ptr[:C].copy()
    for x in range(T):
        c = t_ex[x]
        t_order[nxt[c]] = x
        nxt[c] += 1
    nxt = q_ptr[:C].copy()
    for x in range(Q):
        c = q_ex[x]
        q_order[nxt[c]] = x
        nxt[c] += 1
    n_shard = 1
    for x in range(T):
        n_shard = max(n_shard, ints[L + x, 0] + 1)
    n_reader = 1
    width = 1
    for x in range(Q):
        n_reader = max(n_reader, ints[L + T + x, 1] + 1)
        width = max(width, ints[L + T + x, 2] + 1)
    t_seen = np.full(n_shard, -1, np.int64)
    q_seen = np.full(n_reader * width, -1, np.int64)
    out = np.empty((L + T + Q, 3), ints.dtype)
    out[:L] = ints[:L]
    f = np.zeros((T, flts.shape[1]), np.float64)
    sizes = np.zeros((C, 2), np.int64)
    r = L
    nt = 0
    for c in range(C):
        if t_ptr[c] < t_ptr[c + 1]:
            f[nt] = flts[t_order[t_ptr[c]]]
            f[nt, 0] = totals[c]
        for y in range(t_ptr[c], t_ptr[c + 1]):
            row = L + t_order[y]
            s = ints[row, 0]
            if t_seen[s] != c:
                t_seen[s] = c
                out[r] = ints[row]
                r += 1
                nt += 1
                sizes[c, 0] += 1
        for y in range(q_ptr[c], q_ptr[c + 1]):
            row = L + T + q_order[y]
            k = ints[row, 1] * width + ints[row, 2]
            if q_seen[k] != c:
                q_seen[k] = c
                out[r] = ints[row]
                r += 1
                sizes[c, 1] += 1
    return out[:r], f[:nt], sizes
