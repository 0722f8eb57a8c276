"""Reading plans back from the archive, deltas included.

The archive stores some plans as a delta: the rewrite text (``ir.rewrites.moves``, e.g.
``split{op=fc1,dim=o,parts=4}``) that turns the stored parent into the plan. Storage knows no
graphs, so the optimizer hands it :func:`replay_rewrite`, which parses and applies the text and
returns the child's JSON and digest (the archive checks the digest at every step). A crossover's
text names its mate, not its shards: it raises ``storage.NotReplayable`` (the plan stays whole).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ir.rewrites.moves import parse_move
from ir.serialize import dumps, from_json
from optimizer.search.mutation import Crossover
from storage import NotReplayable

__all__ = ["fetch_plan", "replay_rewrite"]


def replay_rewrite(parent_json: str, rewrite: str) -> tuple[str, str]:
    """Apply the stored rewrite text ``rewrite`` to the plan ``parent_json``; return the child's
    JSON (compact) and digest. Raises ``storage.NotReplayable`` for a crossover's lineage text,
    ``ir.rewrites.RewriteError`` (or ``ValueError`` for text that does not parse) when the rewrite
    cannot be replayed."""
    if rewrite.startswith(Crossover.kind + "{"):
        raise NotReplayable(f"{rewrite!r} records a crossover: its plan needs the mate's shards too")
    parent = from_json(json.loads(parent_json), validate=False)
    child = parse_move(rewrite).apply(parent)
    return dumps(child, indent=None), child.digest


def fetch_plan(archive: Any, campaign: str) -> Callable[[str], str]:
    """``digest -> graph JSON`` for one campaign, replaying deltas (for resume and export)."""

    def fetch(digest: str) -> str:
        return archive.get_graph_json(campaign, digest, replay=replay_rewrite)

    return fetch
