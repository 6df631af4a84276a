"""The engine: requests in, one scheduled step at a time, outputs out."""
