"""The alpha-beta collective cost model: its closed forms, its fit, and its predictions against
all-reduces measured here (gloo, n = 2..4)."""

from __future__ import annotations

import os

import pytest

from benchmarks.collectives import allreduce_rows, cost_model
from policies.collective_cost import (
    Fabric,
    Link,
    allreduce_s,
    bucket_sizes,
    exposed_s,
    fit_link,
    hierarchical_s,
    ring_s,
)

NVLINK = Link(3.4e-6, 360e9)
IB = Link(9.6e-6, 45e9)
H100 = Fabric(NVLINK, IB)


def test_a_ring_is_2_n_minus_1_hops_with_the_crossings_on_the_slow_link():
    one_node = ring_s(8e6, 8, 1, H100)
    assert one_node == pytest.approx(14 * 3.4e-6 + 14 * 1e6 / 360e9)
    # 16 ranks on 2 nodes: 2 of the 30 hops cross nodes, and every hop waits for the slowest link.
    assert ring_s(16e6, 16, 2, H100) == pytest.approx(28 * 3.4e-6 + 2 * 9.6e-6 + 30 * 1e6 / 45e9)
    assert ring_s(1e6, 1, 1, H100) == 0.0


def test_hierarchical_keeps_the_inter_node_traffic_to_a_share_of_the_gradient():
    # 512 nodes of 8: the inter-node ring carries 1/8 of the gradient over 2 x 511 hops.
    size = 800e6
    expected = 2 * 7 * (3.4e-6 + 100e6 / 360e9) + 2 * 511 * (9.6e-6 + 100e6 / 512 / 45e9)
    assert hierarchical_s(size, 4096, 512, H100) == pytest.approx(expected)
    assert hierarchical_s(size, 4096, 512, H100) < ring_s(size, 4096, 512, H100) / 3
    assert hierarchical_s(size, 8, 1, H100) == ring_s(size, 8, 1, H100)  # one node: a ring
    with pytest.raises(ValueError, match="unknown algorithm 'tree'"):
        allreduce_s("tree", size, 8, 1, H100)


def test_ranks_sharing_cores_stretch_every_term():
    cpu = Fabric(Link(1e-4, 1e9), Link(1e-4, 1e9), cores_per_node=2)
    alone = Fabric(Link(1e-4, 1e9), Link(1e-4, 1e9))
    assert ring_s(4e6, 2, 1, cpu) == ring_s(4e6, 2, 1, alone)
    assert ring_s(4e6, 4, 1, cpu) == pytest.approx(2 * ring_s(4e6, 4, 1, alone))
    assert ring_s(4e6, 4, 2, cpu) == pytest.approx(ring_s(4e6, 4, 2, alone))  # 2 ranks per 2-core node


def test_buckets_overlap_backward_and_only_the_tail_is_exposed():
    assert bucket_sizes(100, 30) == [30, 30, 30, 10]
    assert exposed_s([], 1.0) == 0.0
    # Four buckets ready at 0.25 s intervals, each 0.1 s: all but the last hide in backward.
    assert exposed_s([0.1] * 4, 1.0) == pytest.approx(0.1)
    # Each 0.5 s: they queue; the last finishes at 0.25 + 4 x 0.5 = 2.25 s.
    assert exposed_s([0.5] * 4, 1.0) == pytest.approx(1.25)
    with pytest.raises(ValueError):
        bucket_sizes(0, 10)


def test_the_fit_recovers_a_link_from_exact_times():
    truth = Link(2e-4, 1.5e9)
    fabric = Fabric(truth, truth, cores_per_node=2)
    rows = [(n, s, ring_s(s, n, 1, fabric)) for n in (2, 3, 4) for s in (1e6, 4e6, 16e6)]
    fitted = fit_link(rows, cores_per_node=2)
    assert fitted.alpha_s == pytest.approx(truth.alpha_s, rel=1e-6)
    assert fitted.beta_bytes_s == pytest.approx(truth.beta_bytes_s, rel=1e-6)
    with pytest.raises(ValueError, match="two distinct"):
        fit_link([(2, 1e6, 1e-3)])


def test_the_model_predicts_all_reduces_measured_here():
    """Calibrated on n = 2 and 4 (gloo, this machine's cores), it predicts n = 3, which it never
    saw, on real all-reduces. How close is a bench figure (``bench allreduce`` reports it against
    25%), not a test: 16 runs of this very measurement here put the worst point anywhere from
    1.3x to 2.5x off (a bound of 50% failed 1 run in 3, CI included) while the median error stayed
    at or under 25%. The closed forms and the fit are checked exactly above; this catches what
    real timings show: a fit that calibrates a different model than the one predicting (dropping
    the core sharing from the fit fails the median here), a slip of units (ms for s fails the link
    range): every point within 4x, the median within 40%, links of a loopback's order."""
    rows = []
    for n in (2, 3, 4):
        rows += allreduce_rows(n, [4, 16], 1, 10)
    cores = len(os.sched_getaffinity(0))
    links, seen = cost_model([r for r in rows if r["workers"] != 3], cores)
    ratios = []
    for r in rows:
        if r["workers"] == 3:
            link = links["native" if r["algorithm"] == "native" else "ours"]
            fabric = Fabric(link, link, cores_per_node=cores)
            ratios.append(allreduce_s(r["algorithm"], r["size_bytes"], 3, 1, fabric) / r["time_s"])
    ratios += [1 + r["error"] for r in seen]
    assert all(0.25 < ratio < 4 for ratio in ratios), ratios
    assert sorted(abs(ratio - 1) for ratio in ratios)[len(ratios) // 2] < 0.4, ratios
    for link in links.values():
        assert 0 <= link.alpha_s < 0.01 and 0.05e9 < link.beta_bytes_s < 100e9, links
