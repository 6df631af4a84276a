"""Host-side core, no JAX: requests, the block pool, the scheduler, beam search."""
