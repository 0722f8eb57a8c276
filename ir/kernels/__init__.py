"""Kernel registry: one list of every kernel signature, looked up by name."""

from __future__ import annotations

from functools import lru_cache

from ir.kernels import (attention, contraction, conv, elementwise, embedding, fused, layout, loss, optim, position,
                        prenorm, reduce, rowwise)
# kernels that imported programs use
from ir.kernels import (argreduce, batchnorm, groupnorm, masks, mathfn, mathfn_grads, padding, pooling, scan, select,
                        shape)
from ir.kernels.base import (DTYPES, ELEMENTWISE, FLOAT_DTYPES, INDEX_DTYPE, ITEMSIZE, MONOIDS, Kernel, Reduction,
                             Signature, SignatureError,
                             TensorSpec)

REGISTRY: dict[str, Kernel] = {
    cls.name: cls()
    for family in (elementwise, contraction, rowwise, reduce, layout, conv, fused, embedding, position, loss, optim,
                   mathfn, mathfn_grads, select, masks, shape, pooling, batchnorm, attention, prenorm, groupnorm,
                   padding, scan, argreduce)
    for cls in family.KERNELS
}


def get_kernel(name: str) -> Kernel:
    try:
        return REGISTRY[name]
    except KeyError:
        raise SignatureError(f"unknown kernel {name!r}; known kernels: {sorted(REGISTRY)}") from None


# ~3.4 kB per signature (tracemalloc, transformer ops): 4096 entries cap it near 14 MB per
# process; a search's working set is a few hundred (bench_costmodel reports the hit rate).
@lru_cache(maxsize=4096)
def cached_signature(kernel: str, params_key: str, in_specs: tuple[tuple[str, TensorSpec], ...]) -> Signature:
    """Signatures depend only on (kernel, params, input specs): computed once per process
    (least recently used dropped beyond 4096, so a worker's memory stays flat over days)."""
    import json

    return get_kernel(kernel).signature(dict(in_specs), json.loads(params_key))


__all__ = ["DTYPES", "ELEMENTWISE", "FLOAT_DTYPES", "INDEX_DTYPE", "ITEMSIZE", "MONOIDS", "REGISTRY", "Kernel", "Reduction", "Signature",
           "SignatureError", "TensorSpec", "cached_signature", "get_kernel"]
