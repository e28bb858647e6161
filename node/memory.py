"""Giving freed memory back to the operating system.

A node's memory churns: every batch of checks parses JSON, builds results
and drops them, the states dict and the replication sets grow by doubling
and free their old tables, and handoffs move millions of records through
transient lists. CPython returns what it frees to the C allocator, but
glibc's ``malloc`` keeps freed blocks below the top of its heap (and,
once a large block has been freed, serves even large requests from that
heap), so the process's RSS stays at its high-water mark: measured on a real
node filled with 1,000,000 token-bucket keys, about 10 bytes per key of RSS
was memory the node had already freed. ``malloc_trim(0)`` hands such free
pages back; on an idle or steadily loaded heap it takes a fraction of a
millisecond, so the node runs it with every periodic sweep.

Elsewhere than glibc (musl, macOS) :func:`release_free_memory` does nothing.

The same churn makes CPython's cyclic garbage collector run often: by default
every 700 net allocations of container objects, i.e. every batch or two of
decision-API checks, and each full collection walks every object the process
made at start (tens of thousands: modules, functions, classes). Measured on a
router under batches of 100, collections took a quarter of its CPU. A server
process calls :func:`tune_gc` once started: what exists then is frozen out of
collections for good, and young objects are collected every
``GC_THRESHOLD[0]`` allocations instead (a batch's temporaries are acyclic and
freed by reference counting anyway; collections only find cycles).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


_TRIM = _malloc_trim()


def release_free_memory() -> bool:
    """Return the C heap's free pages to the OS; True if that was possible here."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


#: ``gc.set_threshold`` for a server: young collections every 10,000 net container
#: allocations (CPython's default: 700), older generations as by default.
GC_THRESHOLD = (10_000, 10, 10)


def tune_gc() -> None:
    """Freeze what the process holds now out of garbage collection, and collect
    young objects less often (see the module's docstring). Once, at start."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


#: Holders of :func:`freeze_for_transfer` not yet released (the GC is process-wide:
#: so is this count, for in-process clusters of several nodes).
_transfers = [0]


def freeze_for_transfer() -> None:
    """Freeze the heap while a handoff's outbox travels (node/shard.py): millions
    of records that live for seconds, which every collection would walk."""
    _transfers[0] += 1
    gc.freeze()


def thaw_after_transfer() -> None:
    """The end of one :func:`freeze_for_transfer`. After the last one, the heap
    is thawed (``gc.unfreeze()`` thaws everything, also what :func:`tune_gc`
    froze) and, in a process that had called :func:`tune_gc` (its threshold
    says so), tuned again: one full collection, then frozen again."""
    _transfers[0] -= 1
    if _transfers[0] > 0:
        return
    gc.unfreeze()
    if gc.get_threshold() == GC_THRESHOLD:
        tune_gc()
