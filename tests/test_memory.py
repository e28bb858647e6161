"""release_free_memory: freed heap pages really leave the process's RSS."""

from __future__ import annotations

import os
import sys

import pytest

from node.memory import release_free_memory


def rss() -> int:
    with open(f"/proc/{os.getpid()}/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_freed_holes_in_the_heap_are_given_back() -> None:
    if not release_free_memory():
        pytest.skip("no glibc malloc_trim here")
    # 48 MB of 4 KB blocks (malloc's heap, not mmap), then free all but every 16th:
    # the survivors pin the heap's top, so the holes stay resident until trimmed.
    blocks = [bytearray(4096) for _ in range(12_000)]
    for block in blocks:
        block[::512] = b"x" * 8  # touch every page
    keep = blocks[::16]
    del blocks
    holes = rss()
    assert release_free_memory()
    trimmed = rss()
    freed = 12_000 * 15 // 16 * 4096
    assert holes - trimmed > freed // 2, (holes, trimmed, freed)
    assert len(keep) == 750
