"""Arithmetic on time intervals: (start, end) pairs, end > start, in any one unit.

`union` turns any list into a sorted list of disjoint intervals; `intersect` and `length` take such
lists. What a profiled step's time split is made of (measure/time_split.py)."""

from __future__ import annotations

from collections.abc import Iterable

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly what `intervals` cover (touching ones merged,
    empty ones dropped)."""
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersect(x: list[Interval], y: list[Interval]) -> list[Interval]:
    """What two sorted, disjoint interval lists (`union`'s) both cover, sorted and disjoint."""
    out: list[Interval] = []
    i = j = 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def length(intervals: list[Interval]) -> float:
    """Total length of sorted, disjoint intervals."""
    return sum(b - a for a, b in intervals)
