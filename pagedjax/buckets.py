"""The fixed, enumerable set of step shapes the jitted step is compiled for.

A step is one or two padded grids of tokens, [S, Q]: S rows, Q query tokens each.
A decode-only step is one grid [Sd, 1] with Sd on a power-of-two ladder. A step with prompt
work has a decode grid of max_num_seqs rows (idle rows cost little) plus a prompt grid
[Sp, Qp] with Sp and Qp from power-of-two ladders, so decodes and prompt chunks share the
step. A prompt row holds at most `prefill_row_tokens` tokens; a longer prompt takes several
rows of the same step (its later rows attend to the KV its earlier rows write in that
step), so rows stay nearly full and padding stays small whatever the prompt lengths.
Everything the scheduler admits lands in one of these buckets, so after warm-up serving
compiles nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_PREFILL_Q = 16
PREFILL_ROW_TOKENS = 128  # longest query chunk of one prompt row


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _ladder(lo: int, hi: int) -> list[int]:
    """Powers of two from lo up to hi, with hi itself added when it is not one."""
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= 2
    out.append(hi)
    return out


@dataclass(frozen=True)
class Buckets:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    prefill_row_tokens: int = PREFILL_ROW_TOKENS

    @property
    def max_prefill_q(self) -> int:
        """Largest query chunk of one prompt row."""
        cap = min(self.max_num_batched_tokens, next_pow2(self.max_model_len), self.prefill_row_tokens)
        return max(MIN_PREFILL_Q, 1 << (cap.bit_length() - 1))

    @property
    def max_prefill_rows(self) -> int:
        """Rows of the prompt grid: a full token budget of max_prefill_q chunks, or max_num_seqs."""
        return max(self.max_num_seqs, self.max_num_batched_tokens // self.max_prefill_q)

    def seq_bucket(self, n: int) -> int:
        return min(next_pow2(n), self.max_num_seqs)

    def row_bucket(self, n: int) -> int:
        return min(next_pow2(n), self.max_prefill_rows)

    def q_bucket(self, q: int) -> int:
        return min(max(MIN_PREFILL_Q, next_pow2(q)), self.max_prefill_q)

    def prefill_fits(self, num_rows: int, max_q: int) -> bool:
        """Whether a prompt grid of this size stays within the rows and the padded token budget."""
        return num_rows <= self.max_prefill_rows and \
            self.row_bucket(num_rows) * self.q_bucket(max_q) <= max(self.max_num_batched_tokens, self.max_prefill_q)

    def decode_shapes(self) -> list[tuple[int, int]]:
        return [(s, 1) for s in _ladder(1, self.max_num_seqs)]

    def prefill_shapes(self) -> list[tuple[int, int]]:
        shapes = []
        for q in _ladder(MIN_PREFILL_Q, self.max_prefill_q):
            for s in _ladder(1, self.max_prefill_rows):
                if s == 1 or s * q <= self.max_num_batched_tokens:
                    shapes.append((s, q))
        return shapes

    def step_shape(self, num_decode: int, num_prefill: int, max_q: int) -> tuple[tuple[int, int], ...]:
        """The grids of a step: ((Sd, 1),) or ((max_num_seqs, 1), (Sp, Qp))."""
        if not num_prefill:
            return ((self.seq_bucket(num_decode), 1),)
        return ((self.max_num_seqs, 1), (self.row_bucket(num_prefill), self.q_bucket(max_q)))

    def all_shapes(self) -> list[tuple[tuple[int, int], ...]]:
        return ([(shape,) for shape in self.decode_shapes()]
                + [((self.max_num_seqs, 1), shape) for shape in self.prefill_shapes()])
