"""The continuous-batching scheduler and its per-step output."""
