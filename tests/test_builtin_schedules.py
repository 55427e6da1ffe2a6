"""The built-in schedules: complete, valid, and as fast as their closed forms say.

Default costs throughout (F = I = W = 1, B = I + W = 2, no transfer latency),
so with p ranks and m microbatches: GPipe and 1F1B take (m + p - 1)(F + B),
ZB-H1 takes m(F + I + W) + (p - 1)(F + I - W) once m >= p, and nothing beats
the start-up bound: a rank's own work plus the (p - 1)F it takes the first
microbatch to reach the last rank.
"""

import time
from collections import Counter

import pytest

import jpipe
from jpipe import Costs, Overlap, Schedule, get_schedule, simulate, testing, validate

NAMES = (
    "gpipe",
    "1f1b",
    "eager_1f1b",
    "interleaved_1f1b",
    "looped_bfs",
    "zb_h1",
    "zb_h2",
    "zbv",
    "dualpipev",
    "vhalf",
    "vmin",
)
ONE_STAGE = ("gpipe", "1f1b", "eager_1f1b", "zb_h1", "zb_h2")  # stage r on rank r
LOOPED = ("interleaved_1f1b", "looped_bfs")  # stage s on rank s % p
V_SHAPED = ("zbv", "dualpipev", "vhalf", "vmin")  # stages r and 2p-1-r on rank r
SPLIT = ("zb_h1", "zb_h2", "zbv", "vhalf", "vmin")  # every backward is an I and a W
FULL = ("gpipe", "1f1b", "eager_1f1b", "interleaved_1f1b", "looped_bfs")  # every backward a B
RANKS = (2, 4, 8)


def microbatch_counts(name, p):
    """Counts that divide p, that do not, and (where served) fewer than p."""
    if name == "dualpipev":
        return (2 * p, 2 * p + 1, 3 * p)
    return (1, p - 1, p, p + 1, 2 * p, 2 * p + 3, 4 * p)


def build(name, p, m, chunks=None):
    if chunks is None:
        chunks = 2 if name in LOOPED else 1
    return get_schedule(name, p, m, num_chunks=chunks)


def expected_placement(name, p, chunks):
    if name in ONE_STAGE:
        return tuple(range(p))
    if name in LOOPED:
        return tuple(s % p for s in range(p * chunks))
    return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))


def bubble(sim):
    return sim.bubble_fraction


def start_up_bound(schedule, p, m):
    """m(F + I + W) per stage a rank holds, plus (p - 1)F, in default costs."""
    return 3 * m * (schedule.num_stages // p) + (p - 1)


CASES = [(name, p, m) for name in NAMES for p in RANKS for m in microbatch_counts(name, p)]


def test_registry_lists_every_builtin():
    registered = jpipe.registered_schedules()
    assert set(NAMES) <= set(registered), f"missing: {set(NAMES) - set(registered)}"
    for name in NAMES:
        assert registered[name].strip(), (
            f"{name} needs a one-line summary as its docstring's first line"
        )


@pytest.mark.parametrize("name,p,m", CASES)
def test_valid_with_exactly_the_expected_actions(name, p, m):
    chunks = 2 if name in LOOPED else 1
    schedule = build(name, p, m, chunks)
    num_stages = len(expected_placement(name, p, chunks))
    validate(schedule, num_stages=num_stages, num_microbatches=m)
    assert schedule.num_ranks == p
    assert schedule.stage_to_rank == expected_placement(name, p, chunks)

    counts = Counter((a.kind, a.stage, a.microbatch) for _, _, a in schedule.all_actions())
    assert max(counts.values()) == 1, "an action appears twice"
    expected = set()
    for s in range(num_stages):
        for mb in range(m):
            expected.add(("F", s, mb))
            if name in FULL:
                expected.add(("B", s, mb))
            elif name in SPLIT or ("B", s, mb) not in counts:  # dualpipev splits some
                expected |= {("I", s, mb), ("W", s, mb)}
            else:
                expected.add(("B", s, mb))
    assert set(counts) == expected


@pytest.mark.parametrize("name,p,m", CASES)
def test_never_below_the_start_up_bound(name, p, m):
    schedule = build(name, p, m)
    assert simulate(schedule).makespan >= start_up_bound(schedule, p, m)


@pytest.mark.parametrize("p", RANKS)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_closed_forms(name, p):
    for m in (1, p - 1, p, p + 1, 3 * p + 1, 4 * p):
        sim = simulate(build(name, p, m))
        assert sim.makespan == (m + p - 1) * (1 + 2)
        assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        if name == "gpipe":
            assert sim.peak_activations == (m,) * p
        else:
            assert sim.peak_activations[0] == min(p, m)
            assert sim.peak_activations == tuple(min(p - r, m) for r in range(p))


@pytest.mark.parametrize("p", RANKS)
def test_zb_h1_closed_form_and_memory(p):
    for m in (p, p + 1, 2 * p + 3, 4 * p):
        sim = simulate(build("zb_h1", p, m))
        assert sim.makespan == m * (1 + 1 + 1) + (p - 1) * (1 + 1 - 1)
        assert max(sim.peak_activations) == p == sim.peak_activations[0]


@pytest.mark.parametrize("p", RANKS)
def test_zb_h2_at_or_below_zb_h1_and_below_1f1b(p):
    for m in (p, p + 1, 2 * p, 2 * p + 3, 4 * p):
        h2 = simulate(build("zb_h2", p, m))
        assert bubble(h2) <= bubble(simulate(build("zb_h1", p, m))) + 1e-12
        assert bubble(h2) < bubble(simulate(build("1f1b", p, m)))
        assert max(h2.peak_activations) <= 2 * p - 1
    assert max(simulate(build("zb_h2", p, 4 * p)).peak_activations) == 2 * p - 1


@pytest.mark.parametrize("p", RANKS)
def test_zbv_at_or_below_zb_h1_and_below_1f1b(p):
    for m in (2 * p, 2 * p + 1, 3 * p, 4 * p):
        zbv = simulate(build("zbv", p, m))
        assert bubble(zbv) <= bubble(simulate(build("zb_h1", p, m))) + 1e-12
        assert bubble(zbv) < bubble(simulate(build("1f1b", p, m)))
        # Zero bubble after the start-up: exactly the bound, 2m(F+I+W) + (p-1)F.
        assert zbv.makespan == 6 * m + p - 1
        # 2p + 1 half-size activations: about 1F1B's p full ones.
        assert max(zbv.peak_activations) <= 2 * p + 1
    for m in (1, p - 1, p):  # served, though with more bubble
        assert bubble(simulate(build("zbv", p, m))) < bubble(simulate(build("1f1b", p, m)))


def most_deferred_w(row):
    """The most input gradients whose W has not run yet, over a rank's list."""
    waiting, most = set(), 0
    for a in row:
        if a.kind == "I":
            waiting.add((a.stage, a.microbatch))
        elif a.kind == "W":
            waiting.discard((a.stage, a.microbatch))
        most = max(most, len(waiting))
    return most


@pytest.mark.parametrize("p", RANKS)
def test_zbv_bounds_its_deferred_weight_gradients_for_time(p):
    for m in (2 * p, 4 * p):
        unbounded = build("zbv", p, m)
        assert get_schedule("zbv", p, m, max_deferred_w=None).ranks == unbounded.ranks
        times, deferred = [], []
        for cap in (2 * p, p, 2, 0):
            schedule = get_schedule("zbv", p, m, max_deferred_w=cap)
            validate(schedule)
            # At most `cap` carries wait for their W, one more from an I to the W it lets run.
            assert max(most_deferred_w(row) for row in schedule.ranks) <= cap + 1
            times.append(simulate(schedule).makespan)
            deferred.append(max(most_deferred_w(row) for row in schedule.ranks))
        most = max(most_deferred_w(row) for row in unbounded.ranks)
        assert most > 2 * p - 2  # the unbounded cool-down defers many
        assert deferred == sorted(deferred, reverse=True) and deferred[-1] == 1
        # Fewer carries cost bubble: never less time than unbounded, and the
        # slowest (cap 0, the last) still has less bubble than 1F1B.
        assert simulate(unbounded).makespan <= min(times)
        assert times == sorted(times)
        assert bubble(simulate(schedule)) < bubble(simulate(build("1f1b", p, m)))
    with pytest.raises(ValueError, match="max_deferred_w must be None or an int >= 0"):
        get_schedule("zbv", p, 2 * p, max_deferred_w=-1)


@pytest.mark.parametrize("p", RANKS)
def test_dualpipev_overlaps_and_reaches_the_bound(p):
    for m in (2 * p, 2 * p + 1, 3 * p):
        schedule = build("dualpipev", p, m)
        assert any(isinstance(step, Overlap) for row in schedule.ranks for step in row)
        sim = simulate(schedule)
        assert sim.makespan == 6 * m + p - 1
        assert max(sim.peak_activations) <= 2 * p + 1


# PyTorch's DualPipeV for 4 ranks and 10 microbatches, as data
# (pytorch/pytorch, test/distributed/pipelining/artifacts/dualpipev_4rank_10mb.csv,
# BSD-3-Clause); jpipe's dualpipev must write the same lists.
PYTORCH_DUALPIPEV_4RANK_10MB = """\
0F0,0F1,0F2,0F3,0F4,0F5,0F6,7F0,7I0,7W0,7F1,7I1,7W1,7F2,7I2,7W2,7F3,(0F7;7B3)OVERLAP_F_B,(7F4;0B0)OVERLAP_F_B,(0F8;7B4)OVERLAP_F_B,(7F5;0B1)OVERLAP_F_B,(0F9;7B5)OVERLAP_F_B,(7F6;0B2)OVERLAP_F_B,7B6,(7F7;0B3)OVERLAP_F_B,7B7,(7F8;0B4)OVERLAP_F_B,7B8,(7F9;0B5)OVERLAP_F_B,7B9,0I6,0W6,0I7,0W7,0I8,0W8,0I9,0W9
1F0,1F1,1F2,1F3,1F4,6F0,1F5,6F1,6I0,6W0,6F2,6I1,6W1,6F3,(1F6;6B2)OVERLAP_F_B,(6F4;1B0)OVERLAP_F_B,(1F7;6B3)OVERLAP_F_B,(6F5;1B1)OVERLAP_F_B,(1F8;6B4)OVERLAP_F_B,(6F6;1B2)OVERLAP_F_B,(1F9;6B5)OVERLAP_F_B,(6F7;1B3)OVERLAP_F_B,6B6,(6F8;1B4)OVERLAP_F_B,6B7,(6F9;1B5)OVERLAP_F_B,6B8,1B6,6I9,1I7,6W9,1I8,1W7,1I9,1W8,1W9
2F0,2F1,2F2,5F0,2F3,5F1,2F4,5F2,5I0,5W0,5F3,(2F5;5B1)OVERLAP_F_B,(5F4;2B0)OVERLAP_F_B,(2F6;5B2)OVERLAP_F_B,(5F5;2B1)OVERLAP_F_B,(2F7;5B3)OVERLAP_F_B,(5F6;2B2)OVERLAP_F_B,(2F8;5B4)OVERLAP_F_B,(5F7;2B3)OVERLAP_F_B,(2F9;5B5)OVERLAP_F_B,(5F8;2B4)OVERLAP_F_B,5B6,(5F9;2B5)OVERLAP_F_B,5B7,2B6,5B8,2I7,5I9,2I8,2W7,2I9,5W9,2W8,2W9
3F0,4F0,3F1,4F1,3F2,4F2,3F3,4F3,3F4,4B0,(4F4;3B0)OVERLAP_F_B,(3F5;4B1)OVERLAP_F_B,(4F5;3B1)OVERLAP_F_B,(3F6;4B2)OVERLAP_F_B,(4F6;3B2)OVERLAP_F_B,(3F7;4B3)OVERLAP_F_B,(4F7;3B3)OVERLAP_F_B,(3F8;4B4)OVERLAP_F_B,(4F8;3B4)OVERLAP_F_B,(3F9;4B5)OVERLAP_F_B,(4F9;3B5)OVERLAP_F_B,4B6,3B6,4B7,3B7,4I8,3I8,4I9,3I9,4W8,3W8,4W9,3W9
"""


def test_dualpipev_matches_pytorch():
    assert build("dualpipev", 4, 10) == Schedule.from_csv_text(PYTORCH_DUALPIPEV_4RANK_10MB)


@pytest.mark.parametrize("p", RANKS)
def test_interleaved_beats_1f1b(p):
    for m in (p, p + 1, 2 * p + 3, 4 * p, 8 * p):
        for v in (2, 4):
            sim = simulate(build("interleaved_1f1b", p, m, v))
            assert bubble(sim) < bubble(simulate(build("1f1b", p, m)))
            if m % p == 0:
                # Megatron-LM's figure: the bubble shrinks by about v.
                assert bubble(sim) == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
            # Warm-up (v-1)G + 2(p-1) forwards plus one, G the first round's size.
            first_round = -(-m // (m // p))
            warmup_peak = (v - 1) * first_round + 2 * p - 1
            assert sim.peak_activations[0] == min(warmup_peak, v * m)


def test_interleaved_with_one_chunk_is_eager_1f1b():
    for p, m in ((4, 3), (4, 10), (8, 16)):
        assert build("interleaved_1f1b", p, m, 1).ranks == build("eager_1f1b", p, m).ranks


def test_interleaved_serves_fewer_microbatches_than_ranks():
    for m in (3, 5, 7):
        sim = simulate(build("interleaved_1f1b", 8, m, 2))
        assert bubble(sim) < bubble(simulate(build("1f1b", 8, m)))
    # One microbatch cannot be interleaved with anything: 1F1B's bubble.
    one = simulate(build("interleaved_1f1b", 8, 1, 2))
    assert bubble(one) == pytest.approx(bubble(simulate(build("1f1b", 8, 1))))


@pytest.mark.parametrize("p", RANKS)
def test_eager_1f1b_trades_memory_for_latency_hiding(p):
    m = 4 * p
    eager, plain = build("eager_1f1b", p, m), build("1f1b", p, m)
    assert simulate(eager).makespan == simulate(plain).makespan
    assert simulate(eager).peak_activations[0] == 2 * p - 1
    latency = Costs(comm=0.5)
    assert simulate(eager, latency).makespan < simulate(plain, latency).makespan


@pytest.mark.parametrize("p", RANKS)
def test_looped_bfs(p):
    for m in (1, p + 1, 2 * p):
        assert simulate(build("looped_bfs", p, m, 3)).peak_activations == (3 * m,) * p
        assert build("looped_bfs", p, m, 1).ranks == build("gpipe", p, m).ranks


def test_limits_raise_value_errors_naming_them():
    with pytest.raises(ValueError, match=r"M >= 2R = 8"):
        get_schedule("dualpipev", 4, 7)
    for name in V_SHAPED:
        with pytest.raises(ValueError, match="exactly 2 stages per rank"):
            get_schedule(name, 4, 8, num_chunks=3)
        # The command line's default of one chunk means the V's two.
        assert get_schedule(name, 4, 8, num_chunks=1) == get_schedule(name, 4, 8, num_chunks=2)
    for name in ONE_STAGE:
        with pytest.raises(ValueError, match="chunks"):
            get_schedule(name, 4, 8, num_chunks=2)
    for name in LOOPED:
        with pytest.raises(ValueError, match="at least one chunk"):
            get_schedule(name, 4, 8, num_chunks=0)


def test_1f1b_at_scale_validates_and_simulates_within_a_second():
    schedule = get_schedule("1f1b", 64, 1024)
    # The best of three runs, so that other work on a shared machine does not
    # decide the result; the limit itself is the issue's.
    times = []
    for _ in range(3):
        start = time.perf_counter()
        sim = simulate(schedule)  # validates first
        times.append(time.perf_counter() - start)
        if times[-1] < 1.0:
            break
    assert sim.makespan == (1024 + 64 - 1) * 3
    assert min(times) < 1.0, (
        f"simulate took {', '.join(f'{t:.2f}' for t in times)} s for 64 ranks x 1024 microbatches"
    )


def test_unknown_options_are_refused_by_name():
    # As a new user would write it: the API's names are num_ranks and num_microbatches.
    with pytest.raises(ValueError, match=r"takes no option 'ranks', 'microbatches'.*num_ranks="):
        jpipe.get_schedule("1f1b", ranks=4, microbatches=6)
    with pytest.raises(ValueError, match=r"takes no option 'warmpu'; its options: warmup"):
        jpipe.get_schedule("tests_warmup_option", 2, 4, warmpu=1)
    assert jpipe.get_schedule("tests_warmup_option", 2, 4, warmup=1).num_ranks == 2
    with pytest.raises(ValueError, match="takes no option"):
        testing.check_schedule("1f1b", ranks=4, microbatches=6)


@jpipe.register_schedule("tests_warmup_option")
def _with_an_option(num_ranks, num_microbatches, warmup=0):
    return jpipe.get_schedule("1f1b", num_ranks, num_microbatches)


# -- Chimera: stages replicated on two (or more) ranks ----------------------------------


@pytest.mark.parametrize("p", (2, 4, 8))
@pytest.mark.parametrize("m", (1, 2, 3, 4, 8, 13, 32))
def test_chimera_meets_the_papers_bubble_with_two_pipelines(p, m):
    """Two pipelines (down: stage s on rank s; up: on rank p-1-s), each stage on two
    ranks once each pipeline has a microbatch; with F = B (the paper's unit slots) the
    bubble is the paper's (p - 2)/(2m + p - 2) where m is even and at least p (the
    paper's N >= D, split evenly), and the peak at m = p is within the paper's
    [p/2 + 1, p] microbatches."""
    schedule = get_schedule("chimera", p, m)
    validate(schedule, num_stages=p, num_microbatches=m)
    both = tuple(tuple(sorted({s, p - 1 - s})) for s in range(p))
    assert schedule.stage_ranks == (both if m >= 2 else tuple((s,) for s in range(p)))
    for _, _, a in schedule.all_actions():
        assert a.kind in ("F", "B")
    sim = simulate(schedule, Costs(F=1, I=1, W=0))
    if m % 2 == 0 and m >= p:
        assert sim.bubble_fraction == pytest.approx((p - 2) / (2 * m + p - 2), abs=1e-12)
    if m == p:
        assert min(sim.peak_activations) == p // 2 + 1 and max(sim.peak_activations) == p
    # at B = 2F, still below 1F1B's (p - 1)/(m + p - 1) from m = p on (a rank has
    # two stages' parameters instead)
    if m >= p > 2:
        assert simulate(schedule).bubble_fraction < (p - 1) / (m + p - 1)


@pytest.mark.parametrize("p,pipelines", [(4, 4), (8, 4), (8, 8), (12, 4), (12, 6)])
def test_chimera_with_more_pipelines_holds_that_many_replicas_of_each_stage(p, pipelines):
    schedule = get_schedule("chimera", p, 2 * p, pipelines=pipelines)
    validate(schedule)
    assert all(len(ranks) == pipelines for ranks in schedule.stage_ranks)
    assert all(len(schedule.stages_of(r)) == pipelines for r in range(p))


def test_chimera_with_four_pipelines_has_less_bubble_than_with_two():
    schedule = get_schedule("chimera", 8, 16, pipelines=4)
    two = simulate(get_schedule("chimera", 8, 16), Costs(F=1, I=1, W=0))
    assert simulate(schedule, Costs(F=1, I=1, W=0)).bubble_fraction < two.bubble_fraction


@pytest.mark.parametrize(
    "p,options,words",
    [
        (3, {}, "divides the number of ranks"),
        (4, {"pipelines": 3}, "an even number of pipelines"),
        (4, {"pipelines": 8}, "divides the number of ranks"),
        (6, {"pipelines": 4}, "divides the number of ranks"),
        (4, {"num_chunks": 2}, "one stage of each pipeline per rank"),
    ],
)
def test_chimera_refuses_what_it_cannot_place(p, options, words):
    with pytest.raises(ValueError, match=words):
        get_schedule("chimera", p, 8, **options)


def test_the_docs_literature_tables_are_what_the_simulator_gives_now():
    """docs/schedules.md's blocks from `python -m bench.literature --write-docs` holds the
    table the code gives today (pure Python: no figure there can go stale)."""
    import os

    from bench import literature

    page = os.path.join(os.path.dirname(__file__), "..", "docs", "schedules.md")
    with open(page) as f:
        text = f.read()

    def block(name):
        return text.split(f"<!-- bench:{name} -->\n")[1].split("\n\n`python")[0]

    assert block("literature") == literature.table(literature.chimera_rows())
    assert block("literature-dualpipe") == literature.dualpipe_table(literature.dualpipe_rows())
    assert block("literature-seq1f1b") == literature.seq1f1b_table(literature.seq1f1b_rows())


@pytest.mark.parametrize("p", (2, 4, 8))
@pytest.mark.parametrize("extra", (0, 2, 2 * 8))
def test_dualpipe_feeds_both_ends_and_holds_two_copies(p, extra):
    """Half the microbatches enter at rank 0, half at rank p-1; stages s and p-1-s are
    each on ranks s and p-1-s; every rank peaks at p + 1 live microbatches (DeepSeek-V3's
    PP + 1) and idles less than ZB-H1's (p - 1)(F + I - 2W) (default costs)."""
    m = 2 * p + extra
    schedule = get_schedule("dualpipe", p, m)
    validate(schedule, num_stages=p, num_microbatches=m)
    assert schedule.stage_ranks == tuple(tuple(sorted({s, p - 1 - s})) for s in range(p))
    info = jpipe.schedule.validate.analyze(schedule)
    entry = [info.key_rank[0 * m + mb] for mb in range(m)]
    assert entry == [0] * (m // 2) + [p - 1] * (m // 2)
    # each overlapped cell pairs a forward of one direction with a backward of the other
    for row in schedule.ranks:
        for step in row:
            if isinstance(step, Overlap):
                assert (step.forward.microbatch < m // 2) != (step.backward.microbatch < m // 2)
    sim = simulate(schedule)
    assert sim.peak_activations == (p + 1,) * p
    zb = simulate(get_schedule("zb_h1", p, m))
    assert max(sim.makespan - b for b in sim.busy) < max(zb.makespan - b for b in zb.busy)


@pytest.mark.parametrize("p,m,words", [(3, 8, "even number of ranks"), (4, 6, "at least 2R")])
def test_dualpipe_refuses_what_it_cannot_place(p, m, words):
    with pytest.raises(ValueError, match=words):
        get_schedule("dualpipe", p, m)
