"""Search strategies decide which Dask tasks to run and how their results update populations.

A strategy is driver-side state: ``next_task()`` returns ``(function, spec, meta)`` for the farm
to submit; ``on_result(meta, result)`` takes the task's plain-data result and returns the
records the farm should archive; ``to_json``/``load_json`` checkpoint it (no pickle).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from optimizer.search.worker import TaskConstraints

if TYPE_CHECKING:  # the config imports the search core, not the other way round
    from optimizer.campaign.config import SearchConfig


@dataclass(frozen=True)
class SearchContext:
    """What every strategy needs from the campaign (frozen inputs; values from the config)."""

    campaign: str
    hardware: dict
    objectives: tuple[str, ...]
    constraints: TaskConstraints
    search: SearchConfig    # the config's search section (its defaults are the only ones)
    seed: int
    base_json: str          # the unsharded program
    base_digest: str
    n_devices: int
    storage_url: str
    layers: str = "whole"   # how plans are evaluated: whole or repeat (search.layers, resolved)


class Strategy(ABC):
    name: str = "base"

    def __init__(self, ctx: SearchContext) -> None:
        self.ctx = ctx
        self.task_index = 0

    def common_spec(self) -> dict[str, Any]:
        """The task spec fields every strategy sets the same way (keyword arguments)."""
        return {"hardware": self.ctx.hardware, "objectives": tuple(self.ctx.objectives),
                "constraints": self.ctx.constraints, "max_shards_per_op": self.ctx.search.max_shards_per_op,
                "layers": self.ctx.layers}

    @abstractmethod
    def seed_population(self, records: list[dict]) -> None:
        """Start from evaluated initial plans (baselines) as records with graph JSON."""

    @abstractmethod
    def next_task(self, rng: np.random.Generator, front: list[dict] | None = None) -> tuple[Callable, Any, dict] | None:
        """The next task to submit, or ``None`` if the strategy has nothing to run now."""

    @abstractmethod
    def on_result(self, meta: dict, result: dict, front: list[dict]) -> list[dict]:
        """Absorb a finished task; return its records to archive."""

    def on_failure(self, meta: dict) -> None:
        """A task failed for good (e.g. ``KilledWorker``): forget it."""

    def to_json(self) -> dict:
        return {"task_index": self.task_index}

    def load_json(self, state: dict, fetch_graph: Callable[[str], str]) -> None:
        self.task_index = int(state.get("task_index", 0))
