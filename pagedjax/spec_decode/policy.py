"""The draft allocation policy and its cost model: how many drafts each request verifies
in a step (`allocate_drafts`), how deep a draft model drafts (`draft_depth`), and the
measured step costs both weigh (`MeasuredCosts`)."""
from __future__ import annotations

import collections
import heapq
import statistics
from typing import Callable

COST_SAMPLES = 9  # recent wall times a MeasuredCosts keeps per size
MAX_SAMPLE_AGE = 128  # measurements (of any size) after which a MeasuredCosts forgets a sample


def allocate_drafts(caps: list[int], rates: list[float], base_tokens: int, rungs: list[int], max_tokens: int,
                    max_drafts: int, cost, idle_caps: list[int] | None = None) -> list[int]:
    """How many drafts each decoding request verifies this step.

    caps [n]: drafts each request has (within its limits); rates [n]: its estimated chance
    that a draft is accepted; base_tokens: the step's tokens without drafts; rungs: the step
    sizes; cost(T): the expected time of a step of T tokens. Drafts are ranked best first:
    the j-th draft of a request is used with probability rate^j, so the next draft always
    goes to the request whose next one is most likely to be used. Each rung from the one the
    step needs anyway up to max_tokens is then filled with the best drafts that fit, and the
    rung with the most expected tokens per unit of step time wins (every rung is weighed:
    step costs need not rise smoothly, a bigger rung can pay where the next one up does not).

    idle_caps [n] (each >= caps[i]): the drafts each request has in all, the ones past caps
    for rows that the winning rung would pad anyway: once every draft within caps fits, the
    rung's idle rows take the next best drafts, up to idle_caps (deeper drafts when few
    requests remain). They cost no step size of their own: the step runs at the rung it was
    going to run at (a compiled shape), since the rung is chosen with caps alone; a step
    with no idle rows (a full batch) gets what it got without them."""
    alloc = [0] * len(caps)
    first = next((r for r in rungs if r >= base_tokens), None)
    if first is None or not any(caps):
        return alloc
    # the drafts best first, as far as the largest rung (or max_drafts) allows: request ids
    room = min(max_drafts, max([r for r in rungs if r <= max_tokens] + [first]) - base_tokens)
    order, values = [], [float(len(caps))]  # values[j]: expected decode tokens with the best j drafts
    for i, value in _best_drafts([0] * len(caps), caps, rates, room):
        order.append(i)
        values.append(values[-1] + value)
    best_j, best_rate, best_rung = 0, -1.0, None
    for rung in (r for r in rungs if first <= r <= max_tokens):
        j = min(len(order), rung - base_tokens)
        rate = values[j] / cost(rung)
        if rate > best_rate * (1 + 1e-9):
            best_j, best_rate, best_rung = j, rate, rung
        if j == len(order):  # every draft fits: bigger rungs only cost more
            break
    for i in order[:best_j]:
        alloc[i] += 1
    if idle_caps is not None and best_rung is not None:
        for i, _ in _best_drafts(alloc, idle_caps, rates, min(best_rung - base_tokens, max_drafts) - best_j):
            alloc[i] += 1
    return alloc


def _best_drafts(start: list[int], caps: list[int], rates: list[float], room: int):
    """Up to `room` more drafts, best first, as (request i, value): request i's j-th draft is
    worth rates[i]^j; it already has start[i] drafts and gets none beyond caps[i]."""
    heap = [(-rates[i] ** (start[i] + 1), i, start[i] + 1) for i in range(len(caps)) if caps[i] > start[i]]
    heapq.heapify(heap)  # (-value of its j-th draft, i, j)
    while heap and room > 0:
        neg, i, j = heapq.heappop(heap)
        yield i, -neg
        room -= 1
        if j < caps[i]:
            heapq.heappush(heap, (neg * rates[i], i, j + 1))


def acceptance_estimate(num_accepted: int, num_drafted: int) -> float:
    """A request's chance that its next draft is accepted: its record so far, from a prior of 1/2."""
    return (num_accepted + 1) / (num_drafted + 2)


class MeasuredCosts:
    """Wall seconds by size (a step's T, a draft model's depth): the median of a size's last
    COST_SAMPLES measurements (a median: one run slowed by a neighbour, or a first run, must not
    make a size look expensive for long), forgotten once MAX_SAMPLE_AGE measurements of any size
    have come since. A size that a slow minute made look expensive is one that the allocation
    then avoids, so it would never be measured again; forgotten, it is priced as an unmeasured
    size again and so tried again. An unmeasured size costs what the nearest measured one does,
    an optimistic guess, so it is tried once and then known; `unmeasured(size)` when nothing is
    measured yet."""

    def __init__(self, unmeasured: Callable[[int], float]):
        self._unmeasured = unmeasured
        self._count = 0  # measurements so far, of any size
        self._samples: dict[int, collections.deque] = {}  # size -> (measurement number, seconds)
        self._median: dict[int, float] = {}

    def add(self, size: int, seconds: float) -> None:
        self._count += 1
        self._samples.setdefault(size, collections.deque(maxlen=COST_SAMPLES)).append((self._count, seconds))
        oldest = self._count - MAX_SAMPLE_AGE  # samples numbered up to this are forgotten
        for s, samples in list(self._samples.items()):
            changed = s == size
            while samples and samples[0][0] <= oldest:
                samples.popleft()
                changed = True
            if not samples:
                del self._samples[s], self._median[s]
            elif changed:
                self._median[s] = statistics.median(x for _, x in samples)

    def __call__(self, size: int) -> float:
        if size in self._median:
            return self._median[size]
        if not self._median:
            return self._unmeasured(size)
        return self._median[min(self._median, key=lambda m: abs(m - size))]

    def as_dict(self) -> dict[int, float]:
        return dict(sorted(self._median.items()))


def draft_depth(rates: list[float], k: int, target_cost: Callable[[int], float],
                draft_cost: Callable[[int], float], rows: int | None = None,
                max_drafts: int | None = None) -> int:
    """How many drafts (0..k) a draft model proposes for the decoding requests of a step.

    rates [n]: each request's estimated chance that a draft is accepted; target_cost(T): the
    expected time of a target step of T tokens; draft_cost(j): of proposing j drafts (one
    draft-model step per draft, for all requests at once). With j drafts a request emits
    1 + a + ... + a^j tokens on average (draft m counts only if those before it were
    accepted; the bonus or redraw always comes), from a step of rows (1 + j) tokens (rows:
    the decoding requests of the largest data-parallel rank, default n); depths whose
    rows * j drafts exceed max_drafts (what a step can verify) are not tried. The depth with
    the most expected tokens per second wins, 0 (no drafting) when the draft model costs more
    than its accepted drafts save."""
    n = len(rates)
    if n == 0:
        return 0
    rows = n if rows is None else rows
    cost = lambda seconds: max(seconds, 1e-12)  # an unmeasured cost may read 0
    best, best_rate = 0, n / cost(target_cost(rows))
    for j in range(1, k + 1):
        if max_drafts is not None and rows * j > max_drafts:
            break
        tokens = sum(j + 1 if a >= 1 else (1 - a ** (j + 1)) / (1 - a) for a in rates)
        rate = tokens / cost(target_cost(rows * (j + 1)) + draft_cost(j))
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = j, rate
    return best
