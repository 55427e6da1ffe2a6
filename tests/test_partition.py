"""The partitioner against brute force, its memory limit, and the baselines."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jpipe.planner import (
    brute_force_partition,
    partition,
    proportional_partition,
    speed_costs,
    uniform_partition,
)


@st.composite
def instances(draw):
    num_layers = draw(st.integers(1, 12))
    num_stages = draw(st.integers(1, min(4, num_layers)))
    layer = st.integers(0, 20).map(float)
    hetero = draw(st.booleans())
    if hetero:  # an arbitrary cost per (stage, layer): devices that differ per layer kind
        cost = [
            draw(st.lists(layer, min_size=num_layers, max_size=num_layers))
            for _ in range(num_stages)
        ]
    else:
        layers = draw(st.lists(layer, min_size=num_layers, max_size=num_layers))
        speeds = draw(
            st.lists(
                st.sampled_from([0.25, 0.5, 1.0, 2.0]), min_size=num_stages, max_size=num_stages
            )
        )
        cost = speed_costs(layers, speeds)
    caps = None
    if draw(st.booleans()):  # a layer-count memory cap per stage
        caps = draw(st.lists(st.integers(1, num_layers), min_size=num_stages, max_size=num_stages))
    extra = None
    if draw(st.booleans()):  # a per-cut transfer cost, not additive over layers
        extra = (draw(st.lists(layer, min_size=num_layers, max_size=num_layers)),)
    return cost, caps, extra


@settings(max_examples=300, deadline=None)
@given(instances())
def test_partition_equals_brute_force(instance):
    cost, caps, extra = instance
    fits = None if caps is None else (lambda s, a, b: b - a <= caps[s])
    if extra is not None:
        send, num_stages = extra[0], len(cost)
        # a stage pays for sending its last layer's output on, unless it is the last stage
        extra = lambda s, a, b: send[b - 1] if s < num_stages - 1 else 0.0  # noqa: E731
    try:
        want = brute_force_partition(cost, fits, extra)
    except ValueError:
        with pytest.raises(ValueError, match="fits in the devices' memory"):
            partition(cost, fits, extra)
        return
    got = partition(cost, fits, extra)
    assert got.bottleneck == want.bottleneck
    assert sum(got.sizes) == len(cost[0]) and min(got.sizes) >= 1
    if caps is not None:
        assert all(n <= c for n, c in zip(got.sizes, caps))
    # the reported figures are those of the returned split
    for s, layers in enumerate(got.layers):
        own = extra(s, layers[0], layers[-1] + 1) if extra else 0.0
        assert got.stage_times[s] == sum(cost[s][l] for l in layers) + own
    assert [l for x in got.layers for l in x] == list(range(len(cost[0])))


def test_issue_example_speeds():
    # layers 3,1,4,1,5 on speeds 1,1,0.5: the last layer alone takes 5 / 0.5 = 10 on
    # the slow device, and every split must give the slow last stage at least it.
    p = partition(speed_costs([3, 1, 4, 1, 5], [1, 1, 0.5]))
    assert p.bottleneck == 10.0
    # on speeds 0.5,1,1 the slow device goes first and takes the cheap prefix
    p = partition(speed_costs([3, 1, 4, 1, 5], [0.5, 1, 1]))
    assert p.layers == ((0,), (1, 2), (3, 4)) and p.bottleneck == 6.0


def test_beats_the_baselines_on_mixed_speeds():
    cost = speed_costs([1.0] * 12, [1.0, 1.0, 0.5])
    best, uni, prop = partition(cost), uniform_partition(cost), proportional_partition(cost)
    assert uni.sizes == (4, 4, 4) and uni.bottleneck == 8.0
    assert prop.sizes == (5, 5, 2)
    assert best.bottleneck <= prop.bottleneck < uni.bottleneck


def test_errors_are_for_people():
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        partition([[1, 1]] * 3)
    with pytest.raises(ValueError, match="non-negative"):
        partition([[1, -1]])
    with pytest.raises(ValueError, match="memory"):
        partition([[1, 1, 1]] * 2, fits=lambda s, a, b: b - a <= 1)
