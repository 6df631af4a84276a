"""Sliding-window block release: KV blocks no future query can see go back to the pool.

In a model whose every layer attends to at most the last `window` positions (Mistral,
Mixtral with a sliding_window; not Gemma, whose global layers see every position), a query
at position p reads keys t with p - window < t <= p. A request's next query position is its
num_computed_tokens, and positions only grow, so its block b (positions
[b * block_size, (b + 1) * block_size)) is never read again once
(b + 1) * block_size <= num_computed_tokens - window + 1.

Such leading blocks are released: one reference each goes back to the pool (a full block
keeps its prefix-cache entry, so a later request with the same prefix may still hit it) and
`req.num_released_blocks` counts them. Their ids stay in `req.block_ids`, so logical block
i is still entry i of the block table; every attention path masks (or skips) positions
outside the window, so the stale ids are never read into a result. Only
`req.block_ids[req.num_released_blocks:]` (Request.held_block_ids) is held.
"""
from __future__ import annotations

from pagedjax.core.block_pool import BlockPool
from pagedjax.core.request import Request
from pagedjax.core.sched.scheduler import cdiv


class WindowBlockRelease:
    def __init__(self, window: int, block_size: int):
        if window < 1:
            raise ValueError(f"the sliding window must be at least 1 token, got {window}")
        self.window = window
        self.block_size = block_size
        self.num_released = 0  # blocks released so far (all requests)

    def num_outside(self, num_computed_tokens: int) -> int:
        """Leading blocks of a request with this many computed tokens that no query reads again."""
        return max(0, (num_computed_tokens - self.window + 1) // self.block_size)

    def max_blocks_held(self, step_tokens: int) -> int:
        """The most blocks a request holds at once when a step gives it at most `step_tokens`
        tokens: those its window sees and those the step writes (at most
        cdiv(window + step_tokens, block_size) + 1, whatever the request's length)."""
        return cdiv(self.window + step_tokens, self.block_size) + 1

    def release(self, req: Request, pool: BlockPool) -> None:
        """Returns req's blocks that are wholly outside the window of its next query."""
        end = min(self.num_outside(req.num_computed_tokens), len(req.block_ids))
        if end > req.num_released_blocks:
            pool.free(req.block_ids[req.num_released_blocks:end][::-1])
            self.num_released += end - req.num_released_blocks
            req.num_released_blocks = end


def window_release(layer_windows: tuple[int | None, ...], block_size: int) -> WindowBlockRelease | None:
    """The release for a model with these per-layer windows (None: a layer sees every
    position), or None when some layer sees every position, so no block ever leaves every
    window (Gemma's global layers, or no window at all)."""
    if not layer_windows or any(w is None for w in layer_windows):
        return None
    return WindowBlockRelease(max(layer_windows), block_size)
