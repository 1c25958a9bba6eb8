"""Sequence-length balanced hand-out: split a batch over DP ranks so each gets about as many tokens.

A data-parallel update step takes as long as its slowest rank, and a rank's work grows with the
tokens it holds, not the samples. RL response lengths are skewed (a few long answers, many short
ones), so an equal split by sample count can leave one rank with far more tokens than the rest.

`balance_by_tokens` keeps the sample count per rank equal (DDP ranks step together on equal
shares) and greedily places the longest remaining unit (a sample, or a whole GRPO group) on the
rank with the fewest tokens that still has room: the longest-processing-time rule with a
cardinality bound. Swaps between the heaviest and the lightest rank then level what the greedy
pass left. Pure numpy, so the metadata controllers can call it without torch.
"""

from __future__ import annotations

import heapq

import numpy as np


def balance_by_tokens(tokens: np.ndarray, num_ranks: int, *, group_size: int = 1) -> list[np.ndarray]:
    """Indices into `tokens` (num_samples,) for each of `num_ranks` ranks, each ascending.

    With `group_size` > 1 the samples form consecutive groups (sample i is in group i // group_size)
    that are never split. Units (samples or groups) are dealt so that rank counts differ by at most
    one unit; within that bound the token totals are levelled.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D (num_samples,), got shape {tokens.shape}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if group_size < 1 or tokens.size % group_size:
        raise ValueError(f"{tokens.size} samples do not form whole groups of {group_size}")
    unit_tokens = tokens.reshape(-1, group_size).sum(axis=1)  # (num_units,)
    num_units = unit_tokens.size
    if num_units < num_ranks:
        raise ValueError(f"{num_units} units (samples or groups) cannot be spread over {num_ranks} ranks")
    # The first `num_units % num_ranks` ranks take one unit more.
    capacity = [num_units // num_ranks + (r < num_units % num_ranks) for r in range(num_ranks)]
    # Heap of (tokens so far, rank) over ranks with room; the stable sort keeps ties repeatable.
    heap = [(0, r) for r in range(num_ranks)]
    assigned: list[list[int]] = [[] for _ in range(num_ranks)]
    for unit in np.argsort(-unit_tokens, kind="stable"):
        load, rank = heapq.heappop(heap)
        assigned[rank].append(int(unit))
        if len(assigned[rank]) < capacity[rank]:
            heapq.heappush(heap, (load + int(unit_tokens[unit]), rank))
    _level_by_swaps(assigned, unit_tokens)
    offsets = np.arange(group_size)
    return [np.sort((np.asarray(units, dtype=np.int64)[:, None] * group_size + offsets).ravel()) for units in assigned]


def _level_by_swaps(assigned: list[list[int]], unit_tokens: np.ndarray, max_swaps: int = 1000) -> None:
    """Swap one unit of the heaviest rank with one of the lightest while that narrows their gap.

    Each swap lowers the sum of squared loads, so the loop cannot cycle; counts stay as they are.
    """
    loads = np.array([unit_tokens[units].sum() for units in assigned], dtype=np.int64)
    for _ in range(max_swaps):
        heavy, light = int(loads.argmax()), int(loads.argmin())
        gap = int(loads[heavy] - loads[light])
        if gap <= 1:
            return
        heavy_units = np.asarray(assigned[heavy])
        light_units = np.asarray(assigned[light])
        light_order = np.argsort(unit_tokens[light_units], kind="stable")
        light_sorted = unit_tokens[light_units][light_order]  # ascending
        # Trading a unit of t_a tokens for one of t_b changes the gap by -2 (t_a - t_b); the best
        # swap has t_a - t_b closest to gap / 2, and any 0 < t_a - t_b < gap helps.
        targets = unit_tokens[heavy_units] - gap / 2
        pos = np.clip(np.searchsorted(light_sorted, targets), 0, light_sorted.size - 1)
        best = None
        for shift in (0, -1):
            cand = np.clip(pos + shift, 0, light_sorted.size - 1)
            delta = unit_tokens[heavy_units] - light_sorted[cand]  # t_a - t_b per heavy unit
            new_gap = np.abs(gap - 2 * delta)
            i = int(new_gap.argmin())
            if new_gap[i] < gap and (best is None or new_gap[i] < best[0]):
                best = (int(new_gap[i]), i, int(cand[i]), int(delta[i]))
        if best is None:
            return
        _, i, j, delta = best
        a, b = int(heavy_units[i]), int(light_units[light_order[j]])
        assigned[heavy][i] = b
        assigned[light][int(light_order[j])] = a
        loads[heavy] -= delta
        loads[light] += delta


# Levelling across nodes stops once every rank is within this fraction of the mean token count:
# below it, a cross-node move costs more link time than the step time it saves.
LOCAL_TOLERANCE = 0.05


def balance_near_data(
    tokens: np.ndarray,
    num_ranks: int,
    *,
    group_size: int = 1,
    unit_site: np.ndarray,
    rank_site: list[int],
    tolerance: float = LOCAL_TOLERANCE,
) -> tuple[list[np.ndarray], int]:
    """Like `balance_by_tokens`, but each rank first gets units stored on its own site (node).

    `unit_site` (num_units,) is the site that stores each unit (-1: a site no rank is on);
    `rank_site[r]` is rank r's site (-1: unknown, it only gets what other sites cannot take).
    Returns (indices per rank, ascending; the number of units placed off their site).

    1. Locality: every site's ranks take the units stored there, longest first onto the lightest
       of them, up to their room (counts differ by at most one unit, as in balance_by_tokens).
       Only the units a site cannot hold (or stored where no rank is) move: the fewest moves the
       counts allow.
    2. Levelling: swaps between the heaviest and lightest rank, free within a site; across sites
       only while some rank is more than `tolerance` off the mean token count.
    Bound (tested): each rank ends within `tolerance` of the mean, or no single swap between the
    heaviest and lightest rank narrows their gap (the limit balance_by_tokens stops at too).
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    unit_tokens = _unit_tokens(tokens, num_ranks, group_size)
    num_units = unit_tokens.size
    unit_site = np.asarray(unit_site, dtype=np.int64)
    if unit_site.shape != (num_units,) or len(rank_site) != num_ranks:
        raise ValueError(
            f"unit_site must have one site per unit ({num_units}) and rank_site one per rank "
            f"({num_ranks}), got {unit_site.shape} and {len(rank_site)}"
        )
    capacity = [num_units // num_ranks + (r < num_units % num_ranks) for r in range(num_ranks)]
    assigned: list[list[int]] = [[] for _ in range(num_ranks)]
    loads = np.zeros(num_ranks, dtype=np.int64)
    # Per site, a heap of (tokens so far, rank) over its ranks with room.
    heaps: dict[int, list[tuple[int, int]]] = {}
    for r, site in enumerate(rank_site):
        if site >= 0:
            heaps.setdefault(site, []).append((0, r))
    overflow = []
    for unit in np.argsort(-unit_tokens, kind="stable"):
        heap = heaps.get(int(unit_site[unit]))
        if not heap:
            overflow.append(int(unit))
            continue
        load, rank = heapq.heappop(heap)
        assigned[rank].append(int(unit))
        loads[rank] = load + int(unit_tokens[unit])
        if len(assigned[rank]) < capacity[rank]:
            heapq.heappush(heap, (int(loads[rank]), rank))
    # What no site could hold, longest first, onto the lightest rank anywhere with room.
    anywhere = [(int(loads[r]), r) for r in range(num_ranks) if len(assigned[r]) < capacity[r]]
    heapq.heapify(anywhere)
    for unit in overflow:
        load, rank = heapq.heappop(anywhere)
        assigned[rank].append(unit)
        loads[rank] = load + int(unit_tokens[unit])
        if len(assigned[rank]) < capacity[rank]:
            heapq.heappush(anywhere, (int(loads[rank]), rank))
    sites = sorted(set(rank_site))
    for site in sites:  # free: within a site nothing changes node
        members = [r for r in range(num_ranks) if rank_site[r] == site]
        if len(members) > 1:
            part = [assigned[r] for r in members]
            _level_by_swaps(part, unit_tokens)
            for r, units in zip(members, part):
                assigned[r] = units
    loads = np.array([unit_tokens[units].sum() for units in assigned], dtype=np.int64)
    for _ in range(1000):  # across sites: while some rank is off by more than the tolerance
        mean = loads.mean()
        if mean <= 0 or np.abs(loads - mean).max() <= tolerance * mean:
            break
        heavy, light = int(loads.argmax()), int(loads.argmin())
        pair = [assigned[heavy], assigned[light]]
        before = loads[heavy] - loads[light]
        _level_by_swaps(pair, unit_tokens, max_swaps=1)
        assigned[heavy], assigned[light] = pair
        loads[heavy], loads[light] = unit_tokens[pair[0]].sum(), unit_tokens[pair[1]].sum()
        if loads[heavy] - loads[light] == before:
            break  # no swap narrows the gap: the bound's other case
    moved = sum(int((unit_site[units] != rank_site[r]).sum()) for r, units in enumerate(assigned))
    offsets = np.arange(group_size)
    parts = [np.sort((np.asarray(units, dtype=np.int64)[:, None] * group_size + offsets).ravel()) for units in assigned]
    return parts, moved


def _unit_tokens(tokens: np.ndarray, num_ranks: int, group_size: int) -> np.ndarray:
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D (num_samples,), got shape {tokens.shape}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if group_size < 1 or tokens.size % group_size:
        raise ValueError(f"{tokens.size} samples do not form whole groups of {group_size}")
    unit_tokens = tokens.reshape(-1, group_size).sum(axis=1)  # (num_units,)
    if unit_tokens.size < num_ranks:
        raise ValueError(f"{unit_tokens.size} units (samples or groups) cannot be spread over {num_ranks} ranks")
    return unit_tokens
