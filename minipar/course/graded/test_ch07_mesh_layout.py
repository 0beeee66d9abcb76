"""Challenge 07: a 3D layout that fits, keeps the bubble small and sends the fewest bytes.

``layout(config, world_size, batch_size, microbatches, memory_per_rank)`` returns a valid
``{"dp", "pp", "tp"}`` on 8 ranks for four GPTs and budgets. Measured with the cost model:
the model states per rank (``hybrid_memory_per_rank``) within the budget, the 1F1B bubble at
most 0.5, and the bytes one rank sends per step (``hybrid_comm_bytes``) at most 1.25 × the
fewest of any valid configuration meeting the first two goals. Exercise 07 C's rule (the
least model parallelism) does not meet them. Grade it with ``python -m minipar.grade ch07``;
``minipar.hint("ch07")`` gives a nudge, then the idea, then the method.
"""
import dataclasses

import pytest

from minipar import cost

from minipar import hybrid
from minipar.course.grading import GradeFailure, observes
from minipar.models import GPTConfig

CHALLENGE = "ch07_mesh_layout"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    '': (
        'sealed:eNo9jLsNgDAMBVd5A7ADY1AH/FBcxJZiiyjb8ynoTifdbVWPCtFGC3VD0CSQlTg5GIl9JgOn9082N'
        'u8TmohyMRYUE4xaEuJ8u5f+2eHPQC2SRdYbMLEnIg==',
        'sealed:eNpNj0tqxEAMRK9SywTGE7IL5Bq5QH9kW6TdaiTZw9w+cpiFV0JQ9XjlA6lXjIEsvqLywZXgK2GTS'
        'g3mycm+4ZFrbVKqeyFDKs5HcpZu4A46SJ9o6Ul6O1lGvRqk0yWIQYqNi8qUk5f1hrw72C1uzo3wNqbP948Ni'
        '8rD8ODQOT3CYCG7o46XnaHL1e5/wFXubC2aKlP3KP7EW6TPvOz6UpYZX9DUf2OJBgBrMOa93f8AzvBhEw==',
        'sealed:eNpdj01qwzAQha8yOydgTLPopj/bXqIEoZ9RJGxpxGicoJ4op8mZ6tqhtFkMvAePj28+iAHPyA0sS'
        'NACoRmObjjrKTplKft4qsAoM+cKfllLQKg64VJmBs2nOWGW+gIjYoEoED1YqjJsJJUwETdVkBXrPO5u1x5c6'
        'aEsJ2X/2QmJnrojvL3DwxZ0dhvLzMZMqDxrK5Hyrjv4g+k2SIqWyWixAev+h/I0PL/elVdbygiXKGEtHi9Y5'
        'Z+hpZSUaYJ1lctq0g35r2UPK1/V+IVLnsiO95wVJuMeJH5/Gr4Bu9B+aQ==',
    ),
}
BUBBLE, BYTES = 0.5, 1.25
SMALL = GPTConfig(vocab_size=32, block_size=16, n_layer=4, n_head=4, n_embd=32)
WIDE = GPTConfig(vocab_size=64, block_size=64, n_layer=8, n_head=8, n_embd=64)
ODD = dataclasses.replace(SMALL, n_head=3, n_embd=48, vocab_size=48)
CASES = {  # name: (config, world_size, batch_size, microbatches, model states budget as a fraction of 16Ψ)
    "small, a quarter of 16Ψ": (SMALL, 8, 8, 2, 1 / 4),
    "wide, half of 16Ψ": (WIDE, 8, 16, 4, 1 / 2),
    "three heads, half of 16Ψ": (ODD, 8, 8, 2, 1 / 2),
    "wide, an eighth of 16Ψ": (WIDE, 8, 32, 4, 1 / 8),
}


def _measure(config, c, batch, m):
    psi = hybrid.num_params(config)
    return {"memory": cost.hybrid_memory_per_rank(psi, c["dp"], c["pp"], c["tp"])["total"],
            "bubble": cost.bubble_fraction("1f1b", c["pp"], m),
            "bytes": cost.hybrid_comm_bytes(psi, config.n_layer, c["dp"], c["pp"], c["tp"], batch,
                                            config.block_size, config.n_embd, m)["total"]}


@pytest.mark.parametrize("case", list(CASES))
@observes('ch07.*.valid', 'ch07.*.memory', 'ch07.*.bubble', 'ch07.*.bytes')
def test_layout_meets_the_goals(challenge, case):
    """Valid, within the memory budget, bubble <= 0.5, bytes <= 1.25 × the best that meets both."""
    config, world, batch, m, share = CASES[case]
    budget = 16 * hybrid.num_params(config) * share * 1.01
    got = challenge.layout(config, world, batch, m, budget)
    valid = hybrid.valid_configs(config, world, batch, m)
    got = {k: int(got[k]) for k in ("dp", "pp", "tp")} if isinstance(got, dict) and set(got) >= {"dp", "pp", "tp"} else got
    if got not in valid:
        raise GradeFailure(f"{case}: {got} is not a configuration the library can train here; valid: {valid}")
    mine = _measure(config, got, batch, m)
    where = f"{case}, your {got}"
    if mine["memory"] > budget:
        raise GradeFailure(f"{where}: model states {mine['memory']:,.0f} B per rank, the budget is {budget:,.0f} B")
    if mine["bubble"] > BUBBLE:
        raise GradeFailure(f"{where}: a bubble of {mine['bubble']:.2f} of the step (pp = {got['pp']}, "
                           f"{m} micro-batches), the goal is at most {BUBBLE}")
    ok = [(c, _measure(config, c, batch, m)) for c in valid]
    ok = [(c, v) for c, v in ok if v["memory"] <= budget and v["bubble"] <= BUBBLE]
    _, best = min(ok, key=lambda t: t[1]["bytes"])
    if mine["bytes"] > BYTES * best["bytes"]:
        raise GradeFailure(f"{where}: {mine['bytes']:,.0f} B sent per rank per step, "
                           f"{mine['bytes'] / best['bytes']:.2f} × the fewest of any configuration meeting the two "
                           f"goals above ({best['bytes']:,.0f} B); "
                           f"the goal is at most {BYTES} ×")
