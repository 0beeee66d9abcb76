"""Exercise 12: a live layout switch, its plan of moves and its one all-to-all.

A rank's *holding* maps each key of the job's state (``param/<name>``, ``exp_avg/<name>``, ...)
to the global flat indices (int64) of the single-device tensor that its local tensor keeps, in
local order. Switching layouts gives every rank a new holding; the state must reach it without
a disk and without sending what a rank already has.

A. ``plan(old, new, sizes)`` (``minipar.moves``, the mechanism chapter 04's re-partitioning
   shares): who sends which element to whom.
B. ``execute(p, tensors, new_tensors, group=None, name="reshard")`` (``minipar.moves``): the plan
   carried out on this rank of ``group``; how the moves are packed into one exchange is yours to
   design.
C. ``runs_of(index)`` and ``from_runs(runs)`` (``minipar.adapt.switch``): holdings that travel as
   a few numbers.

Each function's docstring below is its contract: clauses ``ex12.P.word`` that must hold (the
grader names the clause a failure breaks). Derived in notebook 12, "The plan of moves" and "A
live switch" (the resharding of Megatron-LM's and veScale's checkpoint conversion, done in
memory). Stuck? ``minipar.hint("ex12", "A")`` (or "B", "C"). Grade it with
``python -m minipar.grade ex12``.
"""
import torch

import minipar
from minipar.adapt.moves import Move, Plan, plan
from minipar.adapt.switch import from_runs, runs_of
from minipar.course import grading
from minipar.course.grading import breaks, expect, expect_equal, observes

EXERCISE = "ex12_adaptive"
HINTS = {   # sealed: python -m minipar.course.hints --unseal to read and edit, --seal after
    'A': (
        'sealed:eNpVjkEKAjEMRa/y95aCbt17jzDN0NKajmlgmNsbOyi4SfiP5PEfXcG0ZFQ+QJLOILxDSWrA2Fox7'
        'JkMvoU5DRSx/kOZxvz75kZLHXes7v1DAaYHLDO6D536j+pEmhy9Ltfg4xYQY5zSyrzNg7XoMHRhTy7NvXmPW'
        'ZUbP1ksvgFtfkUD',
        'sealed:eNpFjUtOAzEQRK9SygaQhihsQQHlFCyiLMy4Bls07tDd0TC3x/lILKtU9d4OkT6EmAuNexvAA7awO'
        '4fomARH9RpVG3QChd9sAeJeDY9PD0jNZ5pjlZUOQ1HJ4ND7fCW+rTD1bepJu6W2zF+kgLaRzzfpz4BG5gNet'
        '9ggGRGFN/2ox0pf4z3J16W22j4v+KmKdK7ryUZ2nixXHJq2LnI4Awvjpa+XKOebcArMNYqe4v/ap2cwzdTWf'
        '31yXRs=',
        'sealed:eNpF0EFOwzAQBdCrfBYgWwSrbBPCDThB5IWbTGioY5OxS9VehANwFPaciYkjgeSVZ+b5e8bIONKlQ'
        'sAUkKYrJTNlmpPSNc4HYkKL8eS9UufIfpBGXeHhUTdbteMK0Q8d204Ya6XbsQuv1GAUmlx/wFJjnsIKbSOLI'
        'ESDbeBj7zxe4gcpuZRjjNFlsAw8t9htDq/p1HL/pnGLEqRGdsfVVIl7PGGncQf1l4kpZVsASRrFKo/w/yPvJ'
        'KrgU3DeXzBLOZkUOSv5R6uGlCuIrDWUQ8pu7wlrWRskCrnGzxfCaSaP70+UjcnuIAqvY7hpIYT5BXoKcF8=',
    ),
    'B': (
        'sealed:eNpVjkEOgzAMBL+yxyIhPtBf9NKzS4yICHYUp6D+vg7ppSfL8uyOHyQbDJnmzUYsWsA0rwhsNQrVq'
        'IIoKI3SEriMqCuDE+8s1aALoo9dDzZU9aXhOZF0/N6jAW+5FDhXqu4zT//g1me0cw/g9tK64qS0XZfe7Jq2Z'
        'IoO+J9h+NcME56tmLpuY87W6mfN0eNJZ0rpA5IA4cMt7g82fQE0LFin',
        'sealed:eNpVkEFOBDEMBL/Sx4w0u+IM4swH9gOZpAMRSRw5mZX2PfyHN+EZcYCTJbtd7fabyt4xP4gqdw5sD'
        '7ihYUUcc4G0wCtuNh1sEaOXPDEFEXng+wttryyQ9AfgKm15gXtCEjXlKyqfT0GR4AuC9Gw6r0SURmw0HZf1l'
        'CgD852/Tkml4r+RG6vxlhd0Hz6Rmx1zQLrSl4M/GbHtKVHt7lx5Um10mXKxYhsjR+uqt2TmJhpze3c33bkcy'
        'Yxj4ebxiMlx/QE/7mNv',
        'sealed:eNp9kFFqwzAQRK+y5MuhwgdIyElCMIo0aYwlbdiVHdzr9D49U9c2lLYf+VrEaHbeTuLgEwV+9NADF'
        'TzPeWoHzJdlRq3dg/VCJ+IUfysqYVNuLFTvoMwTlJoMRxn7IylKNBvyo87N1yf1pdP+A7p3q3T29eArvVEZM'
        '9KrANsrFM1P4stALBFyNOCcW59SV7lbhvblPaERhGkLcMRj3SLdT7ij4jNOO4HevcSdcfJVIRMWVqO8zhXam'
        'b8S39a7MNlDyfYHUBUf0GYvQ2NWkws9fRrWj8qjBKvgD6h70ejC+q+G9hskko9v',
    ),
    'C': (
        'sealed:eNolycEJgDAQRNFWpgJ7sJQcBhKIs7I70fYNePuPfyKXUG7pwtuZfJhoAicvyhgFheFO3HuOWIXQx'
        'vzj+AAsLxg6',
        'sealed:eNo1jDEOwjAMRa/y2VohKnUtYuEaFUNInMYCOZXjguD0tKlYPDy//yyrT51k+ZLmhsd+uOFwAY/Dq'
        'b/hiL7dDiZ+UYElQjGnVuCikVYQWYud8SSZLK0PpYoDx0hK4tddjvBZCvnF1s4/0TgJVSUJbYer848BSjM5A'
        'zmfdg/3D3i19z62jQv7bs6FjbPgzZZYKtNFuh/Nx0lx',
        'sealed:eNpFjN0KwjAMhV8llylW0VvFJylFshpm2VYkyfb8hg7m3fn5zlEjMYUnFDJM1xxhEKZJwwO4vY9iD'
        'yOkmRvWkLP3alQmTDVp//BpX5zh8DenBofuIPxlsldtxjIzbYwdcrisi64L+u9onwAn2FWEf0JCbWRs4fID7'
        '5c6eA==',
    ),
}
TIMEOUT = grading.LAUNCH_TIMEOUT


def _moves(p):
    return [(mv.dst, mv.src, mv.key, mv.src_pos.tolist(), mv.dst_pos.tolist()) for mv in p.moves]


def _idx(*xs):
    return torch.tensor(xs, dtype=torch.long)


def _source_of(moves):
    """{(dst, key, destination position): src} of a plan's moves, and whether one position is given twice."""
    out, twice = {}, False
    for dst, src, key, _, dst_pos in moves:
        for i in dst_pos:
            twice |= (dst, key, i) in out
            out[dst, key, i] = src
    return out, twice


def _expect_moves(got, want, what):
    """The moves equal, else a failure naming the clause the first difference breaks: an element
    missing or given twice (once), a local copy taken from another rank (local), another source
    (ring), the same moves in another order (sorted)."""
    g, twice = _source_of(got)
    w, _ = _source_of(want)
    wrong = [k for k in w if g.get(k) != w[k]]
    clause = ("ex12.A.once" if twice or set(g) != set(w) else
              "ex12.A.local" if any(w[k] == k[0] for k in wrong) else
              "ex12.A.ring" if wrong else "ex12.A.sorted")
    with breaks(clause):
        expect_equal(got, want, what)


@observes("ex12.A.once", "ex12.A.local", "ex12.A.ring", "ex12.A.sorted")
def test_plan_by_hand(impl):
    """Hand cases: every plan's moves, in the contract's order."""
    # everyone holds everything before; the new ranks keep what they had: local copies only.
    full = [{"w": _idx(0, 1, 2, 3)} for _ in range(4)]
    halves = [{"w": _idx(0, 1)}, {"w": _idx(2, 3)}, {"w": _idx(3, 1)}, {}]
    _expect_moves(_moves(plan(full, halves, {"w": 4})),
                 [(0, 0, "w", [0, 1], [0, 1]), (1, 1, "w", [2, 3], [0, 1]), (2, 2, "w", [3, 1], [0, 1])],
                 "moves from 4 ranks holding all of [0, 1, 2, 3] (every element a local copy)")
    # 3 ranks, 6 elements: old rank r holds 2r, 2r+1; new rank 0 holds all, the others nothing.
    old = [{"w": _idx(0, 1)}, {"w": _idx(2, 3)}, {"w": _idx(4, 5)}]
    new = [{"w": _idx(5, 0, 3, 1, 2, 4)}, {}, {}]
    _expect_moves(_moves(plan(old, new, {"w": 6})),
                 [(0, 0, "w", [0, 1], [1, 3]), (0, 1, "w", [1, 0], [2, 4]), (0, 2, "w", [1, 0], [0, 5])],
                 "moves (dst, src, key, src_pos, dst_pos) from [[0, 1], [2, 3], [4, 5]] to rank 0 holding "
                 "[5, 0, 3, 1, 2, 4]")
    # ranks 0 and 3 hold everything, ranks 1 and 2 need it: the ring after 1 is 2, 3, 0; after 2: 3, 0.
    old = [{"w": _idx(0, 1, 2)}, {}, {}, {"w": _idx(2, 1, 0)}]
    new = [{}, {"w": _idx(0, 1, 2)}, {"w": _idx(1)}, {"w": _idx(0)}]
    _expect_moves(_moves(plan(old, new, {"w": 3})),
                 [(1, 3, "w", [2, 1, 0], [0, 1, 2]), (2, 3, "w", [1], [0]), (3, 3, "w", [2], [0])],
                 "moves when ranks 0 and 3 hold [0, 1, 2]")
    # two keys, several sources: (dst, src) order, keys in sizes' order within a pair.
    old = [{"a": _idx(0, 1), "b": _idx(0)}, {"a": _idx(2, 3), "b": _idx(1, 2)}]
    new = [{"a": _idx(3, 0), "b": _idx(2, 1, 0)}, {"a": _idx(1, 2)}]
    _expect_moves(_moves(plan(old, new, {"a": 4, "b": 3})),
                 [(0, 0, "a", [0], [1]), (0, 0, "b", [0], [2]), (0, 1, "a", [1], [0]), (0, 1, "b", [1, 0], [0, 1]),
                  (1, 0, "a", [1], [0]), (1, 1, "a", [0], [1])],
                 "moves for keys a (4 elements) and b (3) over 2 ranks")


def _random_case(seed, world, sizes):
    g = torch.Generator().manual_seed(seed)

    def holding(cover):
        hs = [{} for _ in range(world)]
        for k, n in sizes.items():
            owner = torch.rand(world, n, generator=g) < 0.4
            if cover:
                owner[torch.randint(0, world, (n,), generator=g), torch.arange(n)] = True
            for r in range(world):
                e = torch.nonzero(owner[r]).flatten()
                if len(e):
                    hs[r][k] = e[torch.randperm(len(e), generator=g)]
        return hs
    return holding(True), holding(False)


@observes("ex12.A.once", "ex12.A.ring", "ex12.A.bytes")
def test_plan_random(impl):
    """Random holdings: every new element arrives once, from the rank the contract names, with its index; the
    bytes."""
    sizes = {"param/w": 37, "exp_avg/w": 37, "param/b": 5}
    itemsize = {"param/w": 2, "exp_avg/w": 4, "param/b": 8}
    for seed, world in ((0, 3), (1, 4), (2, 5)):
        old, new = _random_case(seed, world, sizes)
        p = plan(old, new, sizes)
        where = f"seed {seed}, {world} ranks"
        got = [{k: torch.full((len(i),), -1.0) for k, i in h.items()} for h in new]
        for mv in p.moves:
            with breaks("ex12.A.once"):
                expect(mv.dst_pos.numel() == mv.src_pos.numel(), f"{where}: a move of {mv.key} to rank {mv.dst} "
                       f"with {mv.src_pos.numel()} source positions and {mv.dst_pos.numel()} destination positions")
            values = old[mv.src][mv.key][mv.src_pos].float()          # the value carried = its global index
            with breaks("ex12.A.once"):
                expect(bool((got[mv.dst][mv.key][mv.dst_pos] == -1).all()),
                       f"{where}: an element of rank {mv.dst}'s {mv.key} given two sources")
            got[mv.dst][mv.key][mv.dst_pos] = values
        for q, h in enumerate(new):
            for k, i in h.items():
                with breaks("ex12.A.once"):
                    expect_equal(got[q][k].tolist(), i.float().tolist(), f"{where}: rank {q}'s {k} after the plan")
        missing, count = [0] * world, [0] * world                      # an independent count
        for q, h in enumerate(new):
            for k, i in h.items():
                for e in i.tolist():
                    if not (k in old[q] and e in old[q][k].tolist()):
                        holds = [r for r in range(world) if k in old[r] and e in old[r][k].tolist()]
                        src = min(holds, key=lambda r: (r - q) % world)
                        missing[src] += itemsize[k]
                        count[src] += 1
        with breaks("ex12.A.bytes"):
            expect_equal(p.sent(itemsize), missing, f"{where}: bytes each rank sends (itemsize per key {itemsize})",
                         keys="rank")
            expect_equal(p.sent(4), [4 * c for c in count], f"{where}: bytes each rank sends at 4 bytes an element",
                         keys="rank")
        for mv in p.moves:
            for e in old[mv.src][mv.key][mv.src_pos].tolist():
                holds = [r for r in range(world) if mv.key in old[r] and e in old[r][mv.key].tolist()]
                want = mv.dst if mv.dst in holds else min(holds, key=lambda r: (r - mv.dst) % world)
                with breaks("ex12.A.ring"):
                    expect_equal(mv.src, want, f"{where}: the source of element {e} of {mv.key} for rank {mv.dst} "
                                 f"(held by {holds})")

def _raised(fn, *args):
    try:
        fn(*args)
    except NotImplementedError:
        raise
    except Exception as e:                                          # noqa: BLE001 (reported, not hidden)
        return type(e).__name__
    return "nothing"


def _message(fn, *args):
    try:
        fn(*args)
    except NotImplementedError:
        raise
    except Exception as e:                                          # noqa: BLE001
        return str(e)
    return ""


@observes("ex12.A.missing", "ex12.A.world")
def test_plan_errors(impl):
    """An element nobody holds, and a different number of ranks: ValueErrors."""
    old = [{"w": _idx(0, 1)}, {"w": _idx(1)}]
    new = [{"w": _idx(0)}, {"w": _idx(2, 1)}]
    with breaks("ex12.A.missing"):
        expect_equal(_raised(plan, old, new, {"w": 3}), "ValueError",
                     "plan to an element (2 of w) that no old rank holds: what it raises")
        expect("w" in _message(plan, old, new, {"w": 3}),
               f"plan to an element no rank holds: the ValueError does not name the key w: "
               f"{_message(plan, old, new, {'w': 3})!r}")
    with breaks("ex12.A.world"):
        expect_equal(_raised(plan, old, [{"w": _idx(1)}, {"w": _idx(0)}, {}], {"w": 3}), "ValueError",
                     "plan from 2 old holdings to 3 new ones: what it raises")
    p = plan(old, [{"w": _idx(1)}, {"w": _idx(0)}], {"w": 3})
    with breaks("ex12.A.bytes"):
        expect_equal(p.sent({"w": 8}), [8, 0], "sent({'w': 8}) when rank 0 keeps element 1 and sends element 0 to rank 1")
        expect_equal(Plan(2, p.moves).bytes(2), 2, "bytes(2) of the same plan")


def _own_plan(old, new, sizes, seed=11):
    """A plan built element by element here, not by part A (B is graded on its own, with any valid
    plan): an element comes from the rank itself when it holds it, else from a holder drawn at
    random (the same draw on every rank)."""
    g = torch.Generator().manual_seed(seed)
    world, moves = len(old), {}
    for q, h in enumerate(new):
        for k in sizes:
            for i, e in enumerate(h[k].tolist() if k in h else []):
                holders = [r for r in range(world) if k in old[r] and e in old[r][k].tolist()]
                r = q if q in holders else holders[int(torch.randint(len(holders), (1,), generator=g))]
                src, dst = moves.setdefault((q, r, k), ([], []))
                src.append(old[r][k].tolist().index(e))
                dst.append(i)
    out = [Move(r, q, k, _idx(*a), _idx(*b)) for (q, r, k), (a, b) in moves.items()]
    out.sort(key=lambda mv: (mv.dst, mv.src))
    return Plan(world, out)


def _switch(seed, sizes):
    import torch.distributed as dist

    from minipar.moves import execute as _execute
    me, world = dist.get_rank(), dist.get_world_size()
    old, new = _random_case(seed, world, sizes)
    p = _own_plan(old, new, sizes)
    tensors = {k: i.float() * 1.000001 + 0.5 for k, i in old[me].items()}
    new_tensors = {k: torch.full((len(i),), float("nan")) for k, i in new[me].items()}
    observed = _execute(p, tensors, new_tensors)
    try:
        _execute(p, {k: v.double() for k, v in tensors.items()}, new_tensors)
        refused = "nothing raised"
    except NotImplementedError:
        refused = ""
    except Exception as e:                                          # noqa: BLE001 (reported, not hidden)
        refused = f"a {type(e).__name__}"
    return {k: v.tolist() for k, v in new_tensors.items()}, observed, p.sent(4)[me], refused


@observes("ex12.B.values", "ex12.B.bytes", "ex12.B.fp32")
def test_execute_on_ranks(impl):
    """Three random switches on 3 ranks: values bit for bit, observed bytes = planned, fp64 refused."""
    sizes = {"param/w": 23, "exp_avg/w": 23, "param/b": 4}
    results = minipar.launch(_switch, 3, args=(7, sizes), timeout=TIMEOUT)
    old, new = _random_case(7, 3, sizes)
    for r, (got, observed, planned, refused) in enumerate(results):
        with breaks("ex12.B.bytes"):
            expect_equal(observed, planned, f"3 ranks, seed 7: bytes rank {r}'s all-to-all sent (observed vs the plan's)")
        with breaks("ex12.B.values"):
            for k, i in new[r].items():
                want = (i.float() * 1.000001 + 0.5).tolist()
                expect_equal(got[k], want, f"3 ranks, seed 7: rank {r}'s {k} after the switch (value = global index "
                             f"× 1.000001 + 0.5)", keys="position")
        with breaks("ex12.B.fp32"):
            expect(not refused, f"3 ranks: a switch of float64 state on rank {r}: {refused} instead of a "
                   f"NotImplementedError")


@observes("ex12.C.runs")
def test_runs(impl):
    """runs_of and from_runs: runs of consecutive elements and back."""
    cases = {"a": _idx(3, 4, 5, 9, 10, 0), "b": torch.zeros(0, dtype=torch.long), "c": _idx(7)}
    r = runs_of(cases)
    expect_equal(r["a"].tolist(), [[3, 3], [9, 2], [0, 1]], "runs_of([3, 4, 5, 9, 10, 0])")
    expect_equal(tuple(r["b"].shape), (0, 2), "the shape of runs_of of an empty index")
    back = from_runs(r)
    for k, i in cases.items():
        expect_equal(back[k].tolist(), i.tolist(), f"from_runs(runs_of({i.tolist()}))")
    g = torch.Generator().manual_seed(3)
    i = torch.randperm(200, generator=g)[:120].sort().values
    expect_equal(from_runs(runs_of({"x": i}))["x"].tolist(), i.tolist(), "from_runs(runs_of(120 sorted indices of 200))")
