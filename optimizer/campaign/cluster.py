"""Dask clients: join an existing scheduler, or start a local cluster sized to the machine.

A local cluster whose workers advertise a ``GPU`` resource gives each worker process its own
GPU through ``CUDA_VISIBLE_DEVICES`` (round-robin over the machine's GPUs, so several workers
may share one), as dask-cuda's ``LocalCUDACluster`` does; inside a worker the GPU is then
device 0. Remote workers are started by the user (``dask worker ADDR --resources GPU=1``, or
``dask cuda worker`` on machines with several GPUs).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import logging
import os
import warnings
from typing import Any, Iterator


class ClusterError(RuntimeError):
    """The Dask scheduler cannot be reached."""


def trim_memory() -> bool:
    """Give the C heap's free pages back to the operating system (glibc ``malloc_trim(0)``:
    since glibc 2.8 it releases free pages anywhere in the heap, not only at its top). True if
    memory was released; False where there is no glibc.

    Why: a process that allocates and frees many small blocks for days (plan JSON, pickled
    task results, NumPy temporaries) leaves free pages scattered in its heap that ``free``
    alone does not return, so resident memory creeps up although live data does not (issue
    16). Dask's nanny sets ``MALLOC_TRIM_THRESHOLD_`` for its workers, which trims only the
    heap's top; the driver has no nanny. The farm calls this in the driver and, through
    ``client.run``, in every worker, once a minute."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim this way
        return False


async def trim_memory_async() -> bool:
    """:func:`trim_memory` as a coroutine function: ``client.run(..., wait=False)`` (fire and
    forget) accepts only those, and runs them on each worker's event loop (a trim takes
    milliseconds)."""
    return trim_memory()


#: what :func:`trim_spans` leaves of each span's submission metadata and of its finished groups
SPAN_KEEP = 8


def trim_spans(dask_scheduler: Any) -> int:
    """Bound what Dask's spans extension keeps on the scheduler; returns the entries dropped.

    Why: a span (``distributed.spans``) appends one ``{"type": "Future"}`` entry to its
    metadata per ``client.submit`` and keeps every task group ever attached to it, forgotten or
    not; the farm's span lives for the whole campaign (tasks are always in flight), so both grow
    with the task count for days (issue 16). Kept: the last ``SPAN_KEEP`` metadata entries, every
    group the scheduler still knows, and the newest ``SPAN_KEEP`` forgotten ones (a finished span's
    ``stop`` needs at least one). Run on the scheduler's event loop (``client.run_on_scheduler``);
    a scheduler without the extension, or a future Dask that keeps these differently, is left
    alone."""
    ext = getattr(dask_scheduler, "extensions", {}).get("spans")
    live = getattr(dask_scheduler, "task_groups", None)
    if ext is None or live is None:
        return 0
    live_ids = {id(tg) for tg in live.values()}
    dropped = 0
    for span in list(getattr(ext, "spans", {}).values()):
        collections = (getattr(span, "_metadata", None) or {}).get("collections")
        if isinstance(collections, list) and len(collections) > SPAN_KEEP:
            dropped += len(collections) - SPAN_KEEP
            del collections[:-SPAN_KEEP]
        groups = getattr(span, "groups", None)
        if isinstance(groups, set) and len(groups) > SPAN_KEEP:
            gone = sorted((tg for tg in groups if id(tg) not in live_ids and tg.done), key=lambda tg: tg.stop)
            for tg in gone[:-SPAN_KEEP]:
                groups.discard(tg)
                dropped += 1
    return dropped


def local_gpus() -> list[str]:
    """The GPUs local workers may use, as ``CUDA_VISIBLE_DEVICES`` entries: the entries of that
    variable when it is set, else ``0..n-1`` for the n GPUs CuPy sees, else none."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [v.strip() for v in visible.split(",") if v.strip()]
    try:
        import cupy  # noqa: PLC0415  (optional dependency)

        return [str(i) for i in range(int(cupy.cuda.runtime.getDeviceCount()))]
    except Exception:  # noqa: BLE001  (no CuPy, no driver, no device: all mean "no GPUs")
        return []


def _local_cluster_class() -> type:
    from distributed import LocalCluster
    from distributed.deploy.cluster import Cluster

    class FarmLocalCluster(LocalCluster):
        """A LocalCluster that leaves a worker's nanny alone when the worker leaves the scheduler.
        ``SpecCluster`` closes the nanny of a worker gone for ``lost-worker-timeout`` (15 s) unless
        a worker of its name is registered at that instant; the farm restarts workers through their
        nannies (``Farm.restart_old_workers``), so a timer left by one restart that fires while a
        later restart of the same worker is under way closed its nanny, and the campaign lost its
        only worker (seen with 4-second lifetimes on a loaded host). A nanny whose worker process
        dies restarts it by itself; nothing else here needs the timer."""

        def _update_worker_status(self, op: str, msg: Any) -> None:
            if op == "remove":
                Cluster._update_worker_status(self, op, msg)  # the bookkeeping, without the timer
                return
            super()._update_worker_status(op, msg)

    return FarmLocalCluster


def _gpu_cluster_class() -> type:
    class GpuLocalCluster(_local_cluster_class()):
        """A LocalCluster whose worker ``i`` sees only GPU ``gpus[i % len(gpus)]``."""

        def __init__(self, gpus: list[str], **kwargs: Any) -> None:
            self.gpus = list(gpus)
            super().__init__(n_workers=0, **kwargs)

        def new_worker_spec(self) -> dict[Any, dict]:
            (name, spec), = super().new_worker_spec().items()
            spec = copy.deepcopy(spec)
            env = dict(spec["options"].get("env") or {})
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[int(name) % len(self.gpus)]
            spec["options"]["env"] = env
            return {name: spec}

    return GpuLocalCluster


#: Dask settings for the driver's client, local or remote. Every Dask comm keeps its last
#: ``low-level-log-length`` (default 1000) message batches under 1 MB for debugging
#: (``distributed.batched.BatchedSend.recent_message_log``); the client's batches are our
#: ``update-graph`` messages, each with a pickled task spec and its parent plans (~40 kB for the
#: soak's transformer block, up to 1 MB for large models). Measured in a soak's driver at minute
#: 15: 282 such messages, 10.6 MB of frames, and the log at 716 of 1000 entries, still filling
#: (issue 16: the driver's +70-145 MB/h). 100 entries fill in the first minutes.
CLIENT_CONFIG: dict[str, Any] = {"distributed.admin.low-level-log-length": 100}

#: Dask settings for local clusters (the scheduler runs in the driver's process, the workers
#: get them from their nannies): no statistical profiler (each worker kept a call tree per
#: second for 1000 s, hundreds of MB for our deep stacks); a system monitor history of one
#: minute, not 7,200 samples (an hour at 2 a second: ~8 deques of floats in the scheduler, each
#: worker and nanny, found growing ~3 MB/h in a soak's driver under ``tracemalloc``, issue 16);
#: and Dask's other diagnostic logs,
#: bounded deques sized for interactive debugging, shortened: the scheduler's transition log
#: (``low-level-log-length`` entries), its streams to the workers (compute-task messages with
#: their specs), its last ``computations.max-history`` submissions (with task groups and
#: pickled specs) took 10-20 minutes of a campaign to fill, which a soak reads as growth.
#: Nobody reads them (there is no dashboard).
LOCAL_CLUSTER_CONFIG: dict[str, Any] = {
    **CLIENT_CONFIG,
    "distributed.worker.profile.enabled": False,
    "distributed.admin.system-monitor.log-length": 120,
    "distributed.admin.log-length": 1000,
    "distributed.diagnostics.computations.max-history": 10,
    "distributed.diagnostics.erred-tasks.max-history": 10,
}


@contextlib.contextmanager
def dask_client(scheduler: str | None, workers: int | None = None, threads: int = 1,
                resources: dict[str, float] | None = None, gpus: list[str] | None = None) -> Iterator[Any]:
    """A client of the scheduler at ``scheduler``, or of a local cluster (processes, ``threads``
    threads each, ``workers`` default: one per core up to 8; ``resources`` advertised by each
    local worker, e.g. ``{"GPU": 1}``, in which case each worker is pinned to one of ``gpus``
    (default :func:`local_gpus`), round-robin)."""
    import dask
    from distributed import Client

    # For the client's whole life, not only its start: comms opened later (a reconnect, a
    # restarted worker's stream) read the log lengths when they open.
    with dask.config.set(CLIENT_CONFIG):
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
        # CRITICAL, not ERROR: a worker whose heartbeat races the scheduler's shutdown logs a
        # CommClosedError traceback at ERROR (seen in CI on a loaded 2-core machine). Task errors
        # still reach the driver through their futures.
        kw: dict[str, Any] = dict(threads_per_worker=threads, processes=True, dashboard_address=None,
                                  silence_logs=logging.CRITICAL, memory_limit=0)
        if resources:
            kw["resources"] = resources
        pin = (local_gpus() if gpus is None else list(gpus)) if resources and resources.get("GPU") else []
        # Nannies hand LOCAL_CLUSTER_CONFIG to the worker processes they start (and restart).
        with warnings.catch_warnings(), dask.config.set(LOCAL_CLUSTER_CONFIG):
            # the scheduler's HTTP server moves off a busy port 8787: harmless
            warnings.filterwarnings("ignore", message=r"Port \d+ is already in use")
            if pin:
                cluster = _gpu_cluster_class()(pin, **kw)
                cluster.scale(n)
            else:
                cluster = _local_cluster_class()(n_workers=n, **kw)
        client = Client(cluster)
        try:
            if pin:
                client.wait_for_workers(n, timeout=120)
            yield client
        finally:
            client.close()
            cluster.close()


@contextlib.contextmanager
def grid_client(scheduler: str | None, workers: int | None, backend: str = "numpy",
                n_devices: int = 1) -> Iterator[Any]:
    """A client for running a plan: local workers default to one per plan device (at most the
    CPU count and 8), each advertising a GPU when the backend is CuPy."""
    n = workers or max(1, min(n_devices, os.cpu_count() or 1, 8))
    with dask_client(scheduler, n, 1, {"GPU": 1} if backend == "cupy" else None) as client:
        yield client
