"""The α-β model and collective byte counts."""
import pytest

from minipar import cost


def test_collective_bytes_ring_formulas():
    N = 1200
    assert cost.collective_bytes("all_reduce", N, 4) == 2 * 3 / 4 * N
    assert cost.collective_bytes("reduce_scatter", N, 4) == 3 / 4 * N
    assert cost.collective_bytes("all_gather", N, 3) == 2 / 3 * N
    assert cost.collective_bytes("broadcast", N, 2) == N / 2
    assert cost.collective_bytes("all_reduce", N, 1) == 0
    # all-reduce = reduce-scatter + all-gather
    assert cost.collective_bytes("all_reduce", N, 8) == pytest.approx(
        cost.collective_bytes("reduce_scatter", N, 8) + cost.collective_bytes("all_gather", N, 8))


def test_bad_arguments():
    with pytest.raises(ValueError):
        cost.collective_bytes("all_to_all", 10, 2)
    with pytest.raises(ValueError):
        cost.collective_bytes("all_reduce", 10, 0)


def test_steps_and_alpha_beta_time():
    assert cost.collective_steps("all_reduce", 4) == 6
    assert cost.collective_steps("all_gather", 4) == 3
    assert cost.collective_steps("all_reduce", 8, "halving_doubling") == 6
    t = cost.alpha_beta_time("all_reduce", 1e6, 4, alpha=1e-5, beta=1e-9)
    assert t == pytest.approx(6e-5 + 1.5e6 * 1e-9)


def test_fit_recovers_alpha_and_beta():
    alpha, beta = 3e-5, 2e-9
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    times = [cost.alpha_beta_time("all_reduce", s, 4, alpha, beta) for s in sizes]
    a, b = cost.fit_alpha_beta("all_reduce", sizes, times, 4)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    with pytest.raises(ValueError):
        cost.fit_alpha_beta("all_reduce", [10, 10], [1, 1], 4)


def test_bus_bandwidth():
    assert cost.bus_bandwidth("all_reduce", 4e6, 4, 1.0) == pytest.approx(6e6)
