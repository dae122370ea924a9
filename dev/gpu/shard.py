"""Split the GPU lane's test files into shards that one device call each can hold (``TEST_GPU_SHARD=k/n``).

Greedy by file size (a stand-in for how many tests a file holds, which the lane cannot know before collection):
largest file first, each into the shard with the fewest bytes so far. Deterministic, and every file lands in exactly
one shard, so running shards 1..n on one machine runs the whole lane.

    python dev/gpu/shard.py 2/3 tests/test_a.py tests/test_b.py ...   # prints shard 2's files, one per line
"""

from __future__ import annotations

import os
import sys


def parse(spec: str) -> tuple[int, int]:
    """``"k/n"`` -> ``(k, n)`` with ``1 <= k <= n``; a clear ValueError otherwise."""
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"TEST_GPU_SHARD must read k/n (for example 1/2), got {spec!r}") from None
    if not 1 <= k <= n:
        raise ValueError(f"TEST_GPU_SHARD must have 1 <= k <= n, got {spec!r}")
    return k, n


def shards(files: list[str], n: int) -> list[list[str]]:
    """``files`` in ``n`` groups balanced by size (each group sorted by name)."""
    groups: list[list[str]] = [[] for _ in range(n)]
    load = [0] * n
    for f in sorted(set(files), key=lambda f: (-os.path.getsize(f), f)):
        i = min(range(n), key=lambda j: (load[j], j))
        groups[i].append(f)
        load[i] += os.path.getsize(f)
    return [sorted(g) for g in groups]


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        k, n = parse(argv[0])
    except ValueError as e:
        print(f"test-gpu: FAIL: {e}", file=sys.stderr)
        return 2
    print("\n".join(shards(argv[1:], n)[k - 1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
