"""Challenge 08: a balanced sequence layout for causal attention, for any length and any cp.

Zigzag (exercise 08 B) balances causal attention when the sequence cuts into 2·cp equal
chunks. Real batches do not: a 77-token sequence on cp = 5 ranks cannot be cut into 10
equal chunks, and chunks of unequal length unbalance the work again (the zigzag of
``torch.tensor_split`` is 8% off there, 17% on 37 tokens over 5 ranks).

Write ``layout(T, cp)``: the global positions (0 .. T-1) each of the ``cp`` ranks holds, as
``cp`` lists of ints (rank r's list in the order it stores its tokens). Any assignment of
positions to ranks is allowed; the graded tests measure it, for (T, cp) in (48, 3), (50, 3),
(77, 5), (90, 6), (37, 5) and (200, 8):

* **a partition**: every position 0 .. T-1 on exactly one rank; the causal attention each
  rank computes for its positions (``masked_attention`` with ``q_pos``) equals full
  attention there;
* **memory**: the ranks' token counts differ by at most 1 (each holds ⌊T/cp⌋ or ⌈T/cp⌉);
* **work**: a query at position p attends to p + 1 keys, so a rank's causal work is the sum
  of p + 1 over its positions (the query-key pairs it scores). Goal: the busiest rank's work
  at most **1.03 ×** the mean over ranks (contiguous shards are 1.6-1.9 × here).

Grade it with ``python -m minipar.grade ch08`` (this challenge alone; ``grade ex08`` grades the core
exercise, then this challenge). Stuck? ``minipar.hint("ch08")``.
"""


def layout(T: int, cp: int) -> list[list[int]]:
    """The positions rank 0, 1, ..., cp-1 hold."""
    raise NotImplementedError("Challenge 08: layout")
