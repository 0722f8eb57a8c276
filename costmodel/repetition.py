"""Layer repetition: a whole model's objectives from two truncations of it.

A model of ``L`` identical layers (``ir.workloads``' ``gpt`` and ``llama``: ops and tensors of
layer ``i`` are named ``l<i>.…`` or ``l<i>_…``) laid out alike in every layer has a schedule that
repeats: after a few layers the list scheduler reaches a steady state in which each further
layer adds the same time to the step, the same bytes to every device's peak (weights, optimizer
states, activations saved for the backward) and the same energy. So a plan is evaluated on two
*truncations*, the plan with only ``k`` and ``k + 1`` (``KEEP``) members of each repeated layer class, and
each objective is extended along the line through them:

    f(L) = f(big) + x · (f(big) − f(small)),   x = members dropped from each class in ``big``.

So the simulation holds a few layers, not all of them (llama2-7b on 64 GPUs: 7 → 18 evaluations
a second; llama2-70b on 512: minutes → about one; docs/benchmarks.md).

**Layer classes.** Each layer gets a signature: its ops with layer numbers written relative to
the layer itself (``l7.q_proj`` reading ``l6.resid2.out`` in layer 7 is ``@0.q_proj`` reading
``@-1.resid2.out``), their kernels, params, input and output specs and their shards (boxes and
devices). Layers with equal signatures form a class. The first and last layers differ from the
middle ones (they read the embedding and the head's gradient), so they are always kept; a
pipeline stage's layers form one class per stage (their devices differ), and every class of at
least ``MIN_CLASS`` layers is shortened by the same number of layers, which keeps the stages'
balance and so the line. A pipeline with a stage that cannot shrink (a class too short to shorten,
or a first or last layer on devices of its own) is evaluated whole (shortening the other stages
alone would move the bottleneck between the truncations). Layers the search made different stay
whole in both truncations.

**Truncation.** Kept layers keep their numbers and are chained in order: a name inside layer
``o`` that refers to layer ``o ± d`` is re-pointed to the kept layer ``d`` places away (the next
kept layer stands for the next layer); names outside the layers must refer to kept layers
(``final_norm`` reads the last layer's output). Only ops at the cuts are renamed, memoised by
identity; every other op is the plan's own object, so truncations share lowering pieces with
each other and with related plans, and the lowering stays incremental. A truncation whose names
do not close up (a read of a tensor no kept op produces) is refused and the caller evaluates the
whole plan.

**What is exact and what is not.** The program facts (lower bound, model FLOPs, memory floor) are
those of the whole program, never extrapolated (a proxy's, with ``model_layers``, are extended from
its truncations' programs). Makespan, energy, bytes moved and per-device peak
memory are extrapolated; ``tests/costmodel/test_repetition.py`` measures the error against whole
evaluations (layouts, fused ops, recomputation, pipelines). Plans whose layers all differ, and
programs without numbered layers (imported models), are evaluated whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ir.graph import Graph
from ir.layers import layer_classes, layer_of, layer_ops

__all__ = ["AUTO_LAYERS", "MIN_CLASS", "Repetition", "layers_mode", "repetition"]

AUTO_LAYERS = 16  # ``layers: auto`` evaluates models of this many numbered layers or more by repetition
MIN_CLASS = 5  # a class of fewer layers is kept whole (shortening it saves little)
# members of each shortened class in the larger truncation (the smaller keeps one less): the first
# middle layers of a schedule run a little faster than the rest (prefetches and reductions overlap
# the embedding's and the head's work); by the fourth the increments are steady (gpt-2 XL on 8 GPUs,
# ZeRO-3: 1.392, 1.392, 1.471, 1.476, 1.476 ms per added layer; extended from 3 and 4 layers the
# step is 4.9% short, from 5 and 6 0.3%, from 6 and 7 exact; docs/benchmarks.md)
KEEP = 4


def layers_mode(g: Graph, setting: str = "auto") -> str:
    """``whole`` or ``repeat`` for a campaign's program ``g`` (the unsharded program):
    ``setting`` itself, or for ``auto``, ``repeat`` when ``g`` has at least ``AUTO_LAYERS``
    numbered layers (a 32-layer model on 64 GPUs is simulated four times faster by its
    truncations; a 12-layer one little), else ``whole``."""
    if setting != "auto":
        return setting
    classes = layer_classes(g)
    return "repeat" if classes is not None and len(classes) >= AUTO_LAYERS else "whole"


@dataclass(frozen=True)
class Repetition:
    """How a plan is evaluated from two truncations: ``small`` and ``big`` are the kept layers
    (original numbers, ascending), ``x`` the layers each shortened class lost in ``big``, so an
    objective of the whole plan is ``f(big) + x · (f(big) − f(small))``."""

    layers: int
    small: tuple[int, ...]
    big: tuple[int, ...]
    x: int

    @property
    def proxy(self) -> bool:
        """The plan is a proxy with fewer layers than the model (``model_layers``)."""
        return max(self.big) + 1 < self.layers

    def extend(self, small: float, big: float) -> float:
        return big + self.x * (big - small)


def _stages(g: Graph, groups: list[list[int]], n: int) -> str | None:
    """``equal`` when the middle classes ``groups`` (layer numbers) are equal pipeline stages:
    one class a stage, each stage's layers on devices no other stage uses, each stage as many
    layers long, counting the first and last layers in the stages they share most devices with;
    ``unequal`` when they are stages but not equal ones; None when they are not stages."""
    if len(groups) == 1:
        return "equal"
    first = {m[0] for m in groups}
    devices: dict[int, set[int]] = {i: set() for i in first | {0, n - 1}}
    for name, o in g.ops.items():
        i = layer_of(name)
        if i in devices:
            devices[i].update(o.shards.device.tolist())
    stage = [frozenset(devices[m[0]]) for m in groups]
    if sum(len(s) for s in stage) != len(frozenset().union(*stage)):
        return None  # classes share devices: not stages
    size = [len(m) for m in groups]
    for b in (0, n - 1):  # in the stage it shares most devices with (an op placed elsewhere aside)
        shared = [len(s & devices[b]) for s in stage]
        if max(shared) == 0:
            return "unequal"  # a first or last layer in a stage of its own: that stage cannot grow
        size[shared.index(max(shared))] += 1
    return "equal" if len(set(size)) == 1 else "unequal"


def _device_bits(o) -> int:
    """The devices op ``o``'s shards lie on, as the bits of an int (memoised on the op: a search's
    plans share most of their ops, and this runs at every evaluation)."""
    bits = o.__dict__.get("_devbits")
    if bits is None:
        bits = o.__dict__["_devbits"] = sum(1 << d for d in np.unique(o.shards.device).tolist())
    return bits


def _unshortened_stage(g: Graph, members: list[list[int]], long: list[list[int]]) -> bool:
    """Whether a class of layers that is not shortened (a middle class too short, the first or
    the last layer) runs on devices none of the ``long`` (shortened) classes use: a pipeline stage
    that would keep its length while the others lose layers, so that the stages' balance, and
    with it the bottleneck, differs between the truncations and the whole plan (the line through
    them is not the plan's). A class's layers are laid out alike: one member stands for it."""
    names, ops = layer_ops(g), g.ops

    def devices(layer: int) -> int:
        bits = 0
        for n in names.get(layer, ()):
            bits |= _device_bits(ops[n])
        return bits

    used = 0
    for m in long:
        used |= devices(m[0])
    shortened = {m[0] for m in long}
    return any(m[0] not in shortened and (d := devices(m[0])) and not d & used for m in members)


def repetition(g: Graph, min_class: int = MIN_CLASS, keep: int = KEEP,
               model_layers: int | None = None) -> Repetition | None:
    """The truncations to evaluate ``g`` by (see the module doc), or None: evaluate it whole.
    ``model_layers``: ``g`` is a proxy of a model with that many layers (more than its own): the
    missing ones are copies of its largest class of middle layers (a search on a few layers whose
    middle layers are tied, ``ir.rewrites.tie``, for a model of many), or, for a pipeline whose
    classes are its stages, added to every stage alike (stages of unequal length, or missing layers
    that do not split evenly over the stages: None)."""
    classes = layer_classes(g)
    if classes is None:
        return None
    n = len(classes)
    members: dict[int, list[int]] = {}
    for i, c in enumerate(classes):
        members.setdefault(c, []).append(i)
    if model_layers is not None and model_layers > n:
        middle: dict[int, list[int]] = {}
        for i in range(1, n - 1):
            middle.setdefault(classes[i], []).append(i)
        if not middle:
            return None
        groups = list(middle.values())
        c = len(groups)
        stages = _stages(g, groups, n)
        if stages == "unequal":
            return None  # a pipeline whose stages differ in length: no line stands for the model's
        if stages is not None and (model_layers - n) % c:
            return None  # the model's stages would differ in length: the same
        if stages is None:
            groups = [max(groups, key=len)]  # unequal classes: the missing layers copy the largest
            c = 1
        if _unshortened_stage(g, list(members.values()), groups):
            return None  # a stage that would not grow with the others: the bottleneck moves
        # balanced classes (a pipeline's stages): each grows alike, which keeps the stages' balance;
        # each drops as many members in ``big`` (the stages of the first and last layers have one
        # member fewer) and one more in ``small``
        k = min(keep, min(len(m) for m in groups))
        d = min(len(m) for m in groups) - k
        big = tuple(i for i in range(n) if not any(i in m[len(m) - d:] for m in groups if d))
        small = tuple(i for i in big if not any(i == m[len(m) - d - 1] for m in groups))
        return Repetition(model_layers, small, big, d + (model_layers - n) // c)
    long = [m for m in members.values() if len(m) >= max(min_class, keep + 1)]
    if not long:
        return None
    if _unshortened_stage(g, list(members.values()), long):
        return None  # a stage that keeps its length while the others shrink: the bottleneck moves
    x = min(len(m) for m in long) - keep
    if x < 1:
        return None
    drop_big = {i for m in long for i in m[keep:keep + x]}  # each long class loses x members
    drop_small = drop_big | {m[keep - 1] for m in long}
    big = tuple(i for i in range(len(classes)) if i not in drop_big)
    small = tuple(i for i in range(len(classes)) if i not in drop_small)
    return Repetition(len(classes), small, big, x)
