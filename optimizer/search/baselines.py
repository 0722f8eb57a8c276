"""Hand-built reference plans (the experts' recipes), each only where it is valid:

- ``single_device``; ``data_parallel`` (batch rows over the devices; in a training step the
  weight gradients are reduced to device 0, which updates and holds all state: plain DP, whose
  memory is the whole model's state on one device);
- ``zero3`` (FSDP / ZeRO-3: batch-parallel compute, gradients reduce-scattered, the optimizer
  update and so every parameter and state sharded, gathered where read). ZeRO-1/2 (state
  sharded, parameters replicated) have no plan of their own here: a parameter has one home (the
  shards of its update op), so sharding the update shards the parameter too;
- ``megatron`` (Megatron-LM tensor parallelism inside each node x data parallel across nodes;
  ``megatron_mlp`` is the hand-written MLP form);
- ``dp_cp`` (data parallel across nodes x context parallel inside a node: sequence split, keys
  and values gathered), for programs with a sequence (attention);
- ``expert_parallel`` (data parallel across nodes x expert parallel inside a node: each device
  holds its experts, the tokens reach them by all-to-all; the rest data parallel over all
  devices), for programs with a mixture of experts (``workloads.llama(experts=...)``).

The mesh recipes are ``ir.rewrites.layout`` layouts, so each is one ``layout`` move away from any
plan. They seed the search's first population (unless ``search.seed_baselines: false``) and are
the yardsticks in ``summary.md``, the benchmarks and tests.
"""

from __future__ import annotations

from ir.graph import Graph
from ir.mesh import Mesh
from ir.rewrites import RewriteError, place, retile, split_reduction, unshard
from ir.rewrites.layout import has_experts, layout


def single_device(g: Graph) -> Graph:
    """Every op as one shard on device 0."""
    return unshard(g)


def data_parallel(g: Graph, n: int) -> Graph:
    """Every op split along its first index dim (batch rows) over devices ``0..n-1``.

    Weights are read whole by every shard, i.e. replicated. Ops whose first dim is shorter than
    ``n`` are split as far as it goes.
    """
    g = unshard(g)
    for name in list(g.ops):
        sig = g.signature(name)
        if not sig.dims:
            continue
        k = min(n, sig.extents[0])
        if k > 1:
            g = retile(g, name, [k] + [1] * (len(sig.dims) - 1), list(range(k)))
    return g


def megatron_mlp(g: Graph, n: int) -> Graph:
    """Megatron tensor parallelism for an MLP: odd layers split by output columns, the next layer
    by its reduction (the same columns), one accumulation, all over ``0..n-1``."""
    g = unshard(g)
    layers = sorted((name for name in g.ops if name.startswith("fc")), key=lambda s: int(s[2:]))
    for i, name in enumerate(layers):
        if i % 2 == 0:
            g = retile(g, name, [1, n], list(range(n)))
            act = f"act{name[2:]}"
            if act in g.ops:
                g = retile(g, act, [1, n], list(range(n)))
        else:
            g = split_reduction(g, name, n)
            g = retile(g, name, [n, 1, 1], list(range(n)))
            acc = f"{name}.acc"
            rows = g.signature(acc).extents[0]
            k = min(n, rows)
            g = retile(g, acc, [k, 1], list(range(k)))
    return g


# Megatron-LM's recipes keep tensor (and context, expert) parallelism to one 8-GPU NVLink board; a
# larger NVLink domain (a GB200 NVL72 rack) runs several such groups side by side, data parallel.
INNER_MAX = 8


def inner_group(n: int, per_node: int) -> int:
    """Devices of a recipe's inner (tensor, context or expert parallel) group on ``n`` devices in
    nodes of ``per_node``: a node's devices (at most ``n``), or in a node of more than
    ``INNER_MAX`` the largest power of two up to ``INNER_MAX`` that divides both."""
    per = min(per_node, n)
    if per <= INNER_MAX:
        return per
    return max(d for d in (1, 2, 4, 8) if d <= INNER_MAX and per % d == 0 and n % d == 0)


def _mesh(n: int, per_node: int, inner: str, outer: str) -> tuple[Mesh, tuple[str, ...]]:
    """Groups (``inner_group``: a node's devices, as a rule) x the devices of a group, uses (outer,
    inner); one group: the inner use alone."""
    group = inner_group(n, per_node)
    if n <= group:
        return Mesh((n,), per_node), (inner,)
    return Mesh((n // group, group), per_node), (outer, inner)


def _training(g: Graph) -> bool:
    return bool(g.carried)


def zero3(g: Graph, n: int, per_node: int = 8) -> Graph:
    """FSDP / ZeRO-3 over ``n`` devices: every mesh axis splits the batch; the weight gradients'
    accumulates are reduce-scattered and the update ops (the state's home) inherit that split."""
    mesh, use = _mesh(n, per_node, "b", "b")
    return layout(unshard(g), "all", mesh, use)


def _home_on_device0(g: Graph) -> Graph:
    """Optimizer updates (and the accumulates of the gradients they read, with the casts between:
    a bf16 gradient's fp32 copy) whole on device 0."""
    upd = [g.producers[nxt] for nxt in g.carried.values()]
    todo = set(upd)
    for u in upd:
        for _, t in g.ops[u].inputs:
            p = g.producers.get(t)
            chain = []
            while p is not None and g.ops[p].kernel == "cast":
                chain.append(p)
                p = g.producers.get(g.ops[p].inputs[0][1])
            if p is not None and g.ops[p].kernel == "accumulate":
                todo.update(chain + [p])
    for name in todo:
        nd = len(g.signature(name).dims)
        if len(g.ops[name].shards) > 1 or int(g.ops[name].shards.device[0]) != 0:
            g = retile(g, name, [1] * nd, [0])
    return g


def data_parallel_step(g: Graph, n: int, per_node: int = 8) -> Graph:
    """Plain data parallelism of a training step: batch-parallel compute, every gradient reduced
    to device 0, which runs the optimizer and holds all parameters and state (read from there)."""
    return _home_on_device0(zero3(g, n, per_node))


def megatron(g: Graph, n: int, per_node: int = 8) -> Graph:
    """Megatron-LM tensor parallelism inside each node (weights split by heads / columns, row-
    parallel layers reduced) x data parallelism across nodes."""
    mesh, use = _mesh(n, per_node, "t", "b")
    return layout(unshard(g), "all", mesh, use)


def dp_cp(g: Graph, n: int, per_node: int = 8) -> Graph:
    """Data parallelism across nodes x context parallelism inside a node (sequence split)."""
    mesh, use = _mesh(n, per_node, "s", "b")
    return layout(unshard(g), "all", mesh, use)


def expert_parallel(g: Graph, n: int, per_node: int = 8) -> Graph:
    """Data parallelism across nodes x expert parallelism inside a node (DeepSpeed-MoE's and
    Megatron-LM's EP): the experts' weights, gradients and states split over a node's devices,
    the dispatched tokens moved to them (all-to-all), the other ops batch-parallel."""
    mesh, use = _mesh(n, per_node, "e", "b")
    return layout(unshard(g), "all", mesh, use)


def megatron_3d(g: Graph, n: int, per_node: int = 8, pp: int | None = None, m: int | None = None) -> Graph:
    """Megatron-LM's 3D parallelism (Narayanan et al. 2021): tensor parallelism inside a node x
    data parallelism x ``pp`` pipeline stages of contiguous layers, the batch in ``m``
    microbatches (default: ``2·pp``, fewer where the batch does not divide). Across nodes: the
    stages, each a whole number of nodes (default ``pp``: 4 or 2 node groups where the nodes
    divide so, else 3, else one stage a node); on one node: TP of half the node x 2 stages."""
    from ir.rewrites.pipeline import microbatch, op_layers, pipeline

    _, n_layers = op_layers(g)
    if n_layers < 2:
        raise RewriteError("megatron_3d: the program has fewer than two layers (ops named l<k>.…)")
    nodes = max(1, n // per_node)
    if pp is None:
        pp = next((k for k in (4, 2, 3) if nodes % k == 0 and nodes >= k), nodes if nodes > 1 else 2)
    pp = min(pp, n_layers)
    if n % pp:
        raise RewriteError(f"megatron_3d: {n} devices do not split into {pp} stages")
    group = n // pp
    if n > per_node and (group % per_node if group >= per_node else per_node % group):
        raise RewriteError(f"megatron_3d: stages of {group} devices do not fall on whole nodes of {per_node} "
                           f"(tensor parallelism would cross nodes)")
    mesh, use = _mesh(group, per_node if group > per_node else max(1, group), "t", "b")
    if group <= per_node and group > 1:
        tp = inner_group(group, group)
        mesh, use = (Mesh((group,), per_node), ("t",)) if tp == group else (Mesh((group // tp, tp), per_node),
                                                                             ("b", "t"))
    staged = pipeline(layout(unshard(g), "all", mesh, use), pp, group)
    last: RewriteError | None = None
    for k in ([m] if m else [2 * pp, pp, 2]):
        try:
            return microbatch(staged, "all", k)
        except RewriteError as e:
            last = e
    raise last or RewriteError("megatron_3d: no microbatch count applies")


def recompute_layers(plan: Graph) -> Graph:
    """``plan`` with every layer's forward recomputed in the backward (Megatron-LM's full
    activation recomputation, ``--recompute-granularity full``: only each layer's input is kept;
    Korthikanti et al. 2022), and its weights' casts too, so a sharded weight is gathered again
    for the backward instead of held from the forward (FSDP's ``reshard_after_forward``): what
    makes large models fit when their activations and gathered weights do not."""
    from ir.rewrites.pipeline import op_layers
    from ir.rewrites.recompute import recompute_block

    for i in range(op_layers(plan)[1]):
        for prefix in (f"l{i}.", f"l{i}_"):
            try:
                plan = recompute_block(plan, prefix)
            except RewriteError:
                continue  # a layer without forward ops of its own, or without weights
    return plan


def _has_layers(g: Graph) -> bool:
    from ir.rewrites.pipeline import LAYER_RE

    return sum(1 for n in g.ops if LAYER_RE.match(n)) > 0 and any(n.startswith("l1.") for n in g.ops)


def _has_sequence(g: Graph) -> bool:
    return any(o.kernel in ("softmax", "attention") for o in g.ops.values())


def baselines(g: Graph, n_devices: int, devices_per_node: int | None = None) -> dict[str, Graph]:
    """The baselines that apply to ``g`` on ``n_devices`` (nodes of ``devices_per_node``, 8 where
    it divides; the inner groups of a larger NVLink domain are 8 of its devices, ``inner_group``): single device, data parallel, ZeRO-3 (training steps), Megatron TP x DP,
    DP x CP (programs with attention), DP x EP (mixtures of experts), Megatron-LM 3D TP x PP x DP
    (training steps of layered models), ZeRO-3 and 3D with full activation recomputation (``…-recompute``, layered training
    steps), and the hand-written Megatron MLP (MLPs)."""
    per = devices_per_node or (8 if n_devices % 8 == 0 else n_devices)
    inner = inner_group(n_devices, per)  # a node's devices, or 8 of a larger NVLink domain's
    outer = max(1, n_devices // inner)
    train = _training(g)
    out = {"single-device": single_device(g)}
    out[f"data-parallel-{n_devices}"] = data_parallel_step(g, n_devices, per) if train else data_parallel(g, n_devices)
    recipes = [(f"zero3-{n_devices}", zero3, train),
               (f"megatron-tp{inner}-dp{outer}", megatron, True),
               (f"dp{outer}-cp{inner}", dp_cp, _has_sequence(g)),
               (f"dp{outer}-ep{inner}", expert_parallel, has_experts(g)),
               ("megatron-3d", megatron_3d, train and n_devices >= 4 and _has_layers(g))]
    for name, build, valid in recipes:
        if n_devices > 1 and valid:
            try:
                out[name] = build(g, n_devices, per)
            except RewriteError:
                pass
    if train and _has_layers(g):
        for name in (f"zero3-{n_devices}", "megatron-3d"):
            if name in out:
                out[f"{name}-recompute"] = recompute_layers(out[name])
    if all(o.kernel in ("linear", "relu", "gelu", "tanh") for o in unshard(g).ops.values()):
        try:
            out[f"megatron-{n_devices}"] = megatron_mlp(g, n_devices)
        except RewriteError:
            pass
    return out


__all__ = ["INNER_MAX", "baselines", "data_parallel", "inner_group", "data_parallel_step", "dp_cp", "expert_parallel", "megatron", "megatron_3d",
           "megatron_mlp", "place", "recompute_layers", "single_device", "zero3"]
