"""Dask clients: join an existing scheduler, or start a local cluster sized to the machine."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Any, Iterator


class ClusterError(RuntimeError):
    """The Dask scheduler cannot be reached."""


@contextlib.contextmanager
def dask_client(scheduler: str | None, workers: int | None = None, threads: int = 1,
                resources: dict[str, float] | None = None) -> Iterator[Any]:
    """A client of the scheduler at ``scheduler``, or of a local cluster (processes, ``threads``
    threads each, ``workers`` default: one per core up to 8; ``resources`` advertised by each
    local worker, e.g. ``{"GPU": 1}``)."""
    from distributed import Client, LocalCluster

    if scheduler:
        try:
            client = Client(scheduler, timeout="20s")
        except OSError as e:
            raise ClusterError(f"cannot reach the Dask scheduler at {scheduler!r} ({e}); start one with "
                               f"'dask scheduler' or drop --scheduler to use a local cluster") from None
        try:
            yield client
        finally:
            client.close()
        return
    n = workers or max(1, min(os.cpu_count() or 1, 8))
    extra = {"resources": resources} if resources else {}
    with warnings.catch_warnings():  # the scheduler's HTTP server moves off a busy port 8787: harmless
        warnings.filterwarnings("ignore", message=r"Port \d+ is already in use")
        cluster = LocalCluster(n_workers=n, threads_per_worker=threads, processes=True, dashboard_address=None,
                               silence_logs=logging.ERROR, memory_limit=0, **extra)
    client = Client(cluster)
    try:
        yield client
    finally:
        client.close()
        cluster.close()
