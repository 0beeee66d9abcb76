"""Challenge 12: the same bytes, spread over the senders.

Exercise 12 A's plan sends every element a rank lacks from the first holder after it in ring
order. When a few ranks hold everything (ranks 0 and 1 of 4, say, after a pipeline of two
stages gives way to one that puts the whole model on ranks 2 and 3), the same rank comes first
for every destination: rank 0 sends all of it, rank 1 nothing, and the switch takes twice as
long as it needs to. Between real layouts (pp=3·tp=2 → dp=6, dp=2·pp=3 → dp=3·pp=2, ...) some
elements have one holder and others several, and the busiest sender sets the switch's time.

Write ``balanced_plan(old, new, sizes)``: the same inputs and output as
``minipar.adapt.moves.plan`` (lists of holdings by rank, ``{key: global flat indices}``; a
``minipar.adapt.Plan`` of ``minipar.adapt.Move(src, dst, key, src_pos, dst_pos)``, positions
local to each rank). The graded tests run it on four hand-made switches where a few ranks hold
everything, and on six switches between layouts of a small GPT on 4 and 6 ranks (sizes the world
does not divide, ZeRO-3 on either side, its optimizer's momentum too):

* **goal 1**: every element of a new holding gets one source that holds it;
* **goal 2**: the fewest bytes: exactly the elements missing at their destination are sent
  (``plan.bytes(4)`` = 4 × their number), never one the destination holds;
* **goal 3**: the largest per-rank send (``plan.sent(4)``) is the least any plan can have:
  for every set T of ranks, the M_T elements sent whose every holder is in T can only leave
  from T, so some rank of T sends at least ⌈M_T / |T|⌉ of them; the goal is the largest of
  these bounds, × 4 bytes (a plan always reaches it). With one holder set S for everything it
  is ⌈M / |S|⌉, M the elements sent in all.

Grade it with ``python -m minipar.grade ch12`` (this challenge alone; ``grade ex12`` grades the
core exercise, then this challenge). Stuck? ``minipar.hint("ch12")``.
"""


def balanced_plan(old, new, sizes):
    """A ``minipar.adapt.Plan`` from ``old`` to ``new`` meeting the three goals."""
    raise NotImplementedError("Challenge 12: balanced_plan")
