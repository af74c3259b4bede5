"""Where a slime sample's response tokens sit on one context-parallel rank (docs/trainers.md,
"slime"; slime's ``cp_utils.py`` at 624b824a). Response token j (sequence position P + j) goes
with the logit predicting it, at P + j - 1; ``cp_local`` cuts a dense row as slime's
``slice_log_prob_with_cp`` does."""

from __future__ import annotations

import numpy as np

__all__ = ["cp_local", "cp_response_ranges"]


def cp_response_ranges(total_length: int, response_length: int, cp_rank: int, cp_size: int
                       ) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two half-open response ranges [a, b) rank ``cp_rank`` holds, in the order slime
    concatenates them; an empty range is (0, 0). With ``cp_size == 1`` the whole response."""
    if not 0 <= response_length <= total_length:
        raise ValueError(f"response_length {response_length} outside 0..total_length "
                         f"{total_length}")
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} of cp_size {cp_size}")
    if cp_size == 1:
        return (0, response_length), (0, 0)
    prompt = total_length - response_length
    chunk = -(-total_length // (2 * cp_size))
    first = (cp_rank * chunk, (cp_rank + 1) * chunk)
    second = ((2 * cp_size - cp_rank - 1) * chunk, (2 * cp_size - cp_rank) * chunk)
    out = []
    for lo, hi in (first, second):
        # logits of the response are sequence positions P-1 .. total-2
        a, b = max(lo, prompt - 1), min(hi, total_length - 1)
        out.append((a - (prompt - 1), b - (prompt - 1)) if a < b else (0, 0))
    return out[0], out[1]


def cp_local(row: np.ndarray, total_length: int, cp_rank: int, cp_size: int) -> np.ndarray:
    """This rank's part of a dense response row (``len(row)`` = the response length)."""
    (a0, b0), (a1, b1) = cp_response_ranges(total_length, len(row), cp_rank, cp_size)
    return np.concatenate([row[a0:b0], row[a1:b1]])
