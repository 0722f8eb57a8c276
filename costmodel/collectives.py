"""Collectives: which groups of transfers are NCCL collectives, and what they cost.

The lowering (``costmodel.lowering``) finds, for every produced tensor (and every loop-carried
state read away from its home), the point-to-point transfers its readers need. Some of those
groups are what a training framework runs as one NCCL collective, and NCCL runs them faster than
the same bytes sent point to point (it relays through node peers instead of sending every byte
over the NIC, and reaches a known fraction of the line rate):

- **reduce-scatter**: the partials of a split reduction read by the shards of its ``accumulate``
  op on several devices (data-parallel weight gradients, Megatron's row-parallel output);
- **reduce**: the same into one device;
- **all-gather**: every source shard sends the same box to several devices (the reads of a
  sharded state: FSDP/ZeRO's parameter gather; a replicated read of an activation); the
  lowering compares what the transfers carry (their boxes), not only their sizes;
- **broadcast**: one source shard sends the same box to several devices (a different box to each
  is a scatter, costed as an all-to-all: the source's ports carry every piece);
- **all-to-all**: any other exchange, a reshuffle between layouts (different boxes to different
  devices), which frameworks run as one grouped send/recv to every peer (PyTorch's
  ``all_to_all_single`` on NCCL, DTensor's redistribute between shardings).

A group's transfers fall into *exchanges*, the sets of devices that send to or receive from one
another (``costmodel.lowering._exchanges``): under tensor x data parallelism each replica's
tensor-parallel reduction is one, inside its node, and NCCL runs each on its own communicator.
Each exchange becomes a collective when it spans at least ``MIN_RANKS`` devices (sources and
destinations); between two devices it stays point to point, which is what NCCL's send/recv
does. (A 512-way reshuffle sent point to point is 261,632 simulator nodes; as an all-to-all, one.)
A collective is one
simulator node that holds the ports of every participating device (NVLink ports, and NIC ports
if it crosses nodes) for its duration: all ranks of a NCCL collective progress together. In a
group whose producer or readers are microbatched (at least two shards per device on average;
``costmodel.lowering._microbatched``) the exchanges are found over shards instead of devices
(``_kernels.shard_exchanges``), so each microbatch's exchange among the same devices is a
collective of its own (Megatron-LM's tensor-parallel reduction per microbatch), never one over
all microbatches (which would make each wait for all of them); such a group stays point to point
where an exchange sends a microbatch's data to devices that hold none of it (a pipeline's send
between stages, posted rank to rank). Partials of several microbatches reduced together (weight
gradients under a pipeline) are summed in place on each device first, as Megatron-LM's
``main_grad`` does, and reduced once, one collective per exchange of devices moving one copy. A
weight read by every microbatch (data holding no batch: a state, or its cast) is gathered once.

Cost (NCCL's algorithms; nccl-tests ``doc/PERFORMANCE.md`` defines algorithm and bus bandwidth):
with ``S`` the collective's buffer size in bytes (the whole gathered / reduced tensor), ``n``
ranks, ``B`` the bus bandwidth NCCL reaches on a link (``BUS_EFFICIENCY`` × the link's
bandwidth per direction) and ``α`` the link latency per algorithm step,

- ring reduce-scatter or all-gather inside a node: ``(n-1)/n · S / B_nvlink + (n-1)·α_nvlink``;
- ring broadcast or reduce (pipelined chunks): ``S / B + (n-1)·α``;
- all-reduce = reduce-scatter + all-gather: ``2(n-1)/n · S / B + 2(n-1)·α``;
- across ``N`` nodes of ``g`` ranks, NCCL picks the faster of a ring striped over the ``g`` NICs
  of every node (``(n-1)/n · S / min(B_nvlink, g·B_nic)``, its ``n-1`` steps ``N-1`` NIC and
  ``n-N`` NVLink latencies, as NCCL's tuning model charges a ring: ``(nsteps - nInterSteps) ·
  intraLat + nInterSteps · interLat``, ``src/graph/tuning.cc``) and
  the hierarchical algorithm (reduce-scatter inside each node over NVLink, then over the NICs
  among the ``N`` nodes on the ``S/g`` bytes each rank holds, the gathers in reverse):
  ``(g-1)/g · S / B_nvlink + (N-1)/N · (S/g) / B_nic`` plus ``(g-1)`` NVLink and ``(N-1)`` NIC
  latencies; nodes holding different numbers of ranks: ``g`` is the most ranks on a node for the
  NVLink terms, and the NIC terms are those of the node with the fewest, ``h``, which receives
  ``(n-h)/n · S`` over its ``h`` NICs (ring: ``S / min(B_nvlink, h·B_nic)``) (Jeaugey, "Massively
  Scale Your Deep Learning Training with NCCL 2.4", NVIDIA blog 2019; Hu et al., "Demystifying
  NCCL", arXiv:2507.04786, 2025, sections 4-5);
- all-to-all: every rank sends to and receives from all its peers at once, over NVLink and the
  NIC in parallel, so it lasts as long as its busiest port: the largest bytes any rank sends or
  receives over a link / that link's bandwidth, plus one latency of the slowest link it uses.
  Its sends are the point-to-point transfers it replaces, grouped, so they move as those do here
  (at the line rate, their latencies overlapped), not at ``B``; only the synchronisation
  changes (every reader waits for the whole exchange, as after ``all_to_all_single``).
  nccl-tests (``doc/PERFORMANCE.md``) gives all-to-all's bus bandwidth as algorithm bandwidth x
  (n-1)/n: each rank's (n-1)/n of the data crosses its links once.

``BUS_EFFICIENCY`` (fraction of the per-direction line rate NCCL reaches on large messages) is
an ESTIMATE from published nccl-tests runs on HGX/DGX H100: ``all_reduce_perf`` without NVLink
SHARP reaches a bus bandwidth of about 360-370 GB/s of NVLink 4's 450 GB/s per direction (0.8);
over 400 Gb/s NDR InfiniBand about 45-48 GB/s of 50 (0.9) (NVIDIA DGX SuperPOD H100 reference
architecture and nccl-tests results reported by cloud providers). Calibrate where it matters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from costmodel.hardware import Hardware
from ir.unique import distinct

__all__ = ["BUS_EFFICIENCY", "KINDS", "MIN_RANKS", "CollectiveCost", "all_to_all_time", "buffer_bytes", "classify",
           "collective_time", "pairwise_time", "ranks_by_node"]

#: fraction of the link's per-direction bandwidth NCCL reaches on large messages (see above)
BUS_EFFICIENCY = {"intra": 0.80, "inter": 0.90}
#: a group of transfers spanning fewer devices stays point to point
MIN_RANKS = 3
KINDS = ("reduce_scatter", "all_gather", "all_reduce", "broadcast", "reduce", "all_to_all")
KIND_CODES = {k: i + 1 for i, k in enumerate(KINDS)}  # 0 = point to point


@dataclass(frozen=True)
class CollectiveCost:
    """``seconds`` = ``bandwidth_s + latency_s``; ``algorithm``: ring, hierarchical, pairwise
    (all-to-all); ``nbytes``: the buffer ``S`` (all-to-all: the bytes it moves)."""

    kind: str
    algorithm: str
    nbytes: float
    ranks: int
    nodes: int
    bandwidth_s: float
    latency_s: float

    @property
    def seconds(self) -> float:
        return self.bandwidth_s + self.latency_s


def _phases(kind: str) -> tuple[float, bool]:
    """(how many reduce-scatter/all-gather passes the data makes, pipelined one-to-all/all-to-one)."""
    if kind in ("reduce_scatter", "all_gather"):
        return 1.0, False
    if kind == "all_reduce":
        return 2.0, False
    if kind in ("broadcast", "reduce"):
        return 1.0, True
    if kind == "all_to_all":
        raise ValueError("an all-to-all's time depends on what each rank sends: all_to_all_time")
    raise ValueError(f"unknown collective {kind!r}; known: {', '.join(KINDS)}")


def collective_time(kind: str, nbytes: float, ranks_per_node: list[int] | tuple[int, ...] | int, hw: Hardware,
                    efficiency: dict[str, float] | None = None) -> CollectiveCost:
    """NCCL's time for collective ``kind`` over a buffer of ``nbytes`` on the ranks given by
    ``ranks_per_node`` (one count per node taking part, or one int for a single node) of ``hw``;
    the fastest of the algorithms in the module docstring."""
    counts = [ranks_per_node] if isinstance(ranks_per_node, (int, np.integer)) else list(ranks_per_node)
    counts = [int(c) for c in counts if c > 0]
    n = sum(counts)
    N = len(counts)
    if n < 2 or nbytes <= 0:
        return CollectiveCost(kind, "none", float(nbytes), n, N, 0.0, 0.0)
    eff = {**BUS_EFFICIENCY, **(efficiency or {})}
    b_nv = hw.intra_link.bandwidth * eff["intra"]
    b_ib = hw.inter_link.bandwidth * eff["inter"]
    a_nv, a_ib = hw.intra_link.latency, hw.inter_link.latency
    passes, pipelined = _phases(kind)
    S = float(nbytes)
    if N == 1:
        frac = 1.0 if pipelined else (n - 1) / n
        return CollectiveCost(kind, "ring", S, n, 1, passes * frac * S / b_nv, passes * (n - 1) * a_nv)
    g = max(counts)  # the busiest node sets the pace over NVLink
    # and the node with the fewest ranks over the NICs: it receives the others' (n - h)/n of the
    # buffer over its h NICs (equal counts: (N-1)/N · S/g, the docstring's form)
    h = min(counts)
    frac = 1.0 if pipelined else (n - 1) / n
    ring = CollectiveCost(kind, "ring", S, n, N, passes * frac * S / min(b_nv, h * b_ib),
                          passes * ((n - N) * a_nv + (N - 1) * a_ib))
    inner = 1.0 if pipelined else (g - 1) / g
    outer = 1.0 if pipelined else (n - h) / n
    hier = CollectiveCost(kind, "hierarchical", S, n, N,
                          passes * (inner * S / b_nv + outer * S / (h * b_ib)),
                          passes * ((g - 1) * a_nv + (N - 1) * a_ib))
    return min((ring, hier), key=lambda c: (c.seconds, c.algorithm))


def all_to_all_time(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, hw: Hardware) -> CollectiveCost:
    """NCCL's time for the all-to-all made of the point-to-point transfers ``src[i] -> dst[i]``
    of ``nbytes[i]`` bytes on ``hw`` (the module docstring's closed form)."""
    src = np.asarray(src, np.int64)
    dst = np.asarray(dst, np.int64)
    nbytes = np.asarray(nbytes, np.float64)
    ranks = distinct(np.concatenate((src, dst)))
    nodes = len(ranks_by_node(ranks, hw.devices_per_node))
    inter = src // hw.devices_per_node != dst // hw.devices_per_node
    busiest = []
    for on in (~inter, inter):
        w = np.where(on, nbytes, 0.0)
        busiest.append(max(np.bincount(src, weights=w).max(), np.bincount(dst, weights=w).max()) if on.any()
                       else None)
    return pairwise_time(float(nbytes.sum()), ranks.shape[0], nodes, busiest[0], busiest[1], hw)


def pairwise_time(nbytes: float, ranks: int, nodes: int, busiest_intra: float | None, busiest_inter: float | None,
                  hw: Hardware) -> CollectiveCost:
    """``all_to_all_time`` from its sums: ``nbytes`` moved among ``ranks`` ranks on ``nodes``
    nodes, of which a rank sends or receives at most ``busiest_intra`` bytes over NVLink and
    ``busiest_inter`` over the NIC (None: no transfer uses that link)."""
    if not nbytes > 0:
        return CollectiveCost("all_to_all", "none", 0.0, ranks, nodes, 0.0, 0.0)
    seconds = 0.0
    for busiest, link in ((busiest_intra, hw.intra_link), (busiest_inter, hw.inter_link)):
        if busiest is not None:
            seconds = max(seconds, busiest / link.bandwidth)
    latency = hw.inter_link.latency if busiest_inter is not None else hw.intra_link.latency
    return CollectiveCost("all_to_all", "pairwise", nbytes, ranks, nodes, seconds, latency)


def classify(reduce: bool, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, shard: np.ndarray,
             content: np.ndarray | None = None) -> str | None:
    """The collective a group of point-to-point transfers is (``None``: it stays point to point).

    ``src``/``dst``: devices of each transfer; ``shard``: the source shard it comes from;
    ``nbytes``: its bytes; ``content``: what it carries (equal values: the same box; the lowering
    passes a hash of its bounding box; None: judged by bytes alone); ``reduce``: the readers are
    ``accumulate`` ops (partials of a split reduction). Rules in the module docstring. The
    lowering applies them compiled, to every exchange of a group at once
    (``_kernels.exchange_facts``; ``tests/costmodel/test_exchange_facts.py`` holds the two equal)."""
    if src.shape[0] < 2:
        return None
    if _distinct(np.concatenate((src, dst))) < MIN_RANKS:
        return None
    if reduce:
        return "reduce" if np.all(dst == dst[0]) else "reduce_scatter"
    # a replicated read: every source shard sends the same bytes to at least two devices (the
    # lowering lists a shard's transfers together, so equal shards are adjacent)
    new = np.empty(shard.shape[0], np.bool_)
    new[0] = True
    np.not_equal(shard[1:], shard[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    counts = np.diff(np.append(starts, shard.shape[0]))
    if counts.min() < 2 or _distinct(shard) != starts.shape[0]:
        return "all_to_all"
    if not np.all(nbytes == np.repeat(nbytes[starts], counts)):
        return "all_to_all"
    # equal sizes are not enough: a reshuffle between layouts (rows to columns) sends each device
    # a different block of one size, which NCCL cannot ring-gather (each rank's data is not the
    # same for every peer): an all-to-all
    if content is not None and not np.all(content == np.repeat(content[starts], counts)):
        return "all_to_all"
    return "broadcast" if starts.shape[0] == 1 else "all_gather"


def buffer_bytes(total: float, ranks: int, most_received: float = 0.0) -> float:
    """The collective's buffer size ``S`` from the bytes its point-to-point form moves: a
    reduce-scatter or all-gather of ``S`` over ``n`` ranks moves ``(n-1)·S``, and so does a
    broadcast or reduce to ``n-1`` others. ``most_received`` (reduce-scatter and all-gather):
    the most bytes one rank receives; a ring rank receives ``(n-1)/n·S``, so ``S`` is at least
    ``n/(n-1)`` times that (ranks that hold none of the data, such as readers on other devices
    than the sources, receive more than ``(n-1)/n`` of ``total/(n-1)``)."""
    k = max(ranks - 1, 1)
    return max(total / k, most_received * max(ranks, 2) / k)


def ranks_by_node(ranks: np.ndarray, devices_per_node: int) -> list[int]:
    """Ranks per node taking part (nodes in increasing order)."""
    per_node = np.bincount(np.asarray(ranks, np.int64) // devices_per_node)
    return per_node[per_node > 0].tolist()


def _distinct(ids: np.ndarray) -> int:
    """How many distinct values the non-negative integers ``ids`` hold (devices, shards: a
    count of bins, cheaper than sorting them)."""
    return int(np.count_nonzero(np.bincount(ids))) if ids.size else 0
