"""L2 prefetch of a kernel's weights before its PDL wait (sm_90: ``cp.async.bulk.prefetch.L2.global``).

A decode step at small batch is a chain of short kernels, each waiting (``T.pdl_sync``) for the previous one before
it reads anything. The weights a projection streams are written by no kernel, so its CTAs, placed on the SMs while
the previous kernel still runs (PDL), can ask the L2 for their weight slice first: the HBM reads then overlap the
previous kernel instead of following it, and the kernel's own loads hit the L2. The prefetch is a hint (no
completion to wait for, no register or shared memory), issued once per weight row by one thread each.

Use: ``T.Kernel(..., prelude=PRELUDE)`` and, before ``T.pdl_sync()``, ``T.evaluate(prefetch(address, bytes))``
with a 16-byte aligned address and a byte count a multiple of 16.
"""

from ._tilelang import T

PRELUDE = r"""
__device__ __forceinline__ void deepinfer_l2_prefetch(const void* ptr, unsigned int bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(ptr), "r"(bytes) : "memory");
}
"""


def prefetch(address, num_bytes):
    """The call expression prefetching ``num_bytes`` from ``address`` (``T.address_of(buffer[...])``) into the L2."""
    return T.call_extern("handle", "deepinfer_l2_prefetch", address, num_bytes)
