"""`jpipe.search_schedule` and ``python -m jpipe.search``: pure Python, no devices."""

import dataclasses
import json
import math

import pytest

import jpipe
from jpipe.lower.spmd.ticks import make_tick_plan
from jpipe.search import cli as search_cli
from jpipe.search.engine import (
    BUILTINS,
    Move,
    StageFigures,
    apply_moves,
    builtin_specs,
    device_bytes,
    local_search,
    lowering_runs,
    runs_schedule,
    spmd_buffers,
    stage_profile_from_json,
)

# One rank's share of a model per microbatch: a forward, its two backward halves,
# residuals of 1, carries of 0.5, a kept input of 0.05, 2 of parameters and 1 of
# working memory; transfers cost less than a forward.
UNIFORM = StageFigures(
    jpipe.Costs(F=1, I=1, W=1, evict=0.3, offload=0.5),
    jpipe.Sizes(activation=1, carry=0.5, input=0.05, params=2),
    working=1,
)


def test_figures_refuse_lists_of_the_wrong_length_and_scale_for_chunks():
    with pytest.raises(ValueError, match="need num_stages"):
        StageFigures(jpipe.Costs(F=[1, 2]))
    with pytest.raises(ValueError, match="give 3"):
        StageFigures(jpipe.Costs(F=[1, 2]), num_stages=3)
    zbv = jpipe.get_schedule("zbv", 4, 8)
    half = UNIFORM.for_schedule(zbv)  # 8 stages on 4 ranks: each half a rank's share
    assert half.costs.F == 0.5 and half.sizes.activation == 0.5 and half.working == 0.5
    assert half.costs.comm == UNIFORM.costs.comm
    listed = StageFigures(jpipe.Costs(F=[1, 1, 1, 2]), num_stages=4)
    assert listed.for_schedule(jpipe.get_schedule("1f1b", 4, 8)) is listed
    with pytest.raises(ValueError, match="for 4 stages and zbv has 8"):
        listed.for_schedule(zbv)


@pytest.mark.parametrize("kind", jpipe.MEMORY_KINDS)
def test_what_each_lowering_declares_it_runs_is_what_its_pass_takes(kind):
    """`LoweringKind.memory_actions` against the lowerings' own passes: the SPMD
    lowering's first pass (`make_tick_plan`) takes a schedule with the kind exactly when
    the SPMD kind declares it; the per-rank lowering runs every kind (its op list,
    tests/test_mpmd.py and the memory-action tests run each) and declares every one."""
    assert lowering_runs("mpmd", kind)
    seen = False
    for name, options in (("1f1b_recompute", {"k": 1}), ("1f1b_bpipe", {}),
                          ("zb_h1_offload", {})):  # fmt: skip
        schedule = jpipe.get_schedule(name, 4, 8, **options)
        if kind not in {a.kind for _, _, a in schedule.all_actions()}:
            continue
        seen = True
        try:
            make_tick_plan(schedule)
            accepted = True
        except NotImplementedError:
            accepted = False
        assert lowering_runs("spmd", kind) == accepted
        assert runs_schedule("spmd", schedule) == accepted
    assert seen, f"no built-in here has {kind}: add one that does"
    with pytest.raises(ValueError, match="is not a memory action"):
        lowering_runs("spmd", "F")


@pytest.mark.slow
def test_no_spmd_candidate_has_an_action_the_spmd_lowering_refuses():
    result = jpipe.search_schedule(UNIFORM, 4, 8, 6.0, layout="spmd")
    for c in result.candidates:
        make_tick_plan(c.schedule)  # raises for a memory action the SPMD lowering does not run
    refused = [line for line in result.skipped if "does not run its memory actions" in line]
    assert bool(refused) == (not result.memory_moves)


@pytest.mark.parametrize(
    "name,options",
    [("1f1b", {}), ("zb_h1", {}), ("vhalf", {}), ("1f1b_recompute", {"k": 2}),
     ("1f1b_bpipe", {}), ("zb_h1_offload", {})],
)  # fmt: skip
def test_device_bytes_are_params_values_and_working(name, options):
    schedule = jpipe.get_schedule(name, 4, 8, **options)
    fig = dataclasses.replace(UNIFORM, grad_output=0.5).for_schedule(schedule)
    S = schedule.num_stages
    sim = jpipe.simulate(schedule, fig.costs, fig.sizes)
    per_rank = device_bytes(sim, fig, "mpmd")
    spmd = device_bytes(sim, fig, "spmd")
    own = [sum(fig.sizes.table(S)["params"][s] for s in schedule.stages_of(r)) for r in range(4)]
    grads = [sum(fig.grad_output_table(S)[s] for s in schedule.stages_of(r)) for r in range(4)]
    for r in range(4):
        stages = schedule.stages_of(r)
        # the per-rank lowering holds every rank's weights and optimizer state, its own grads
        assert per_rank.params[r] == pytest.approx(
            max(o - g for o, g in zip(own, grads)) + grads[r]
        )
        simulated = sim.peak_bytes[r] - own[r]
        if schedule.has_memory_actions:  # copies take their buffer when issued: never fewer
            assert per_rank.values[r] >= simulated - 1e-9
        else:
            assert per_rank.values[r] == pytest.approx(simulated)
        assert per_rank.working[r] == max(fig.working_table(S)[s] for s in stages)
        assert per_rank.device[r] == pytest.approx(
            per_rank.params[r] + per_rank.values[r] + per_rank.working[r]
        )
    # one program: the largest of each term on every device, the buffers as it sizes them
    buffers = spmd_buffers(schedule, fig)
    held = sum(buffers)
    expected = max(own) + max(grads) + held + max(per_rank.working)
    assert spmd.device == pytest.approx((expected,) * 4)
    if not schedule.has_memory_actions:  # the residual buffer: at least the most live at once
        residuals = dataclasses.replace(fig, sizes=dataclasses.replace(fig.sizes, carry=0))
        peak = max(device_bytes(jpipe.simulate(schedule, fig.costs), residuals, "mpmd").values)
        assert buffers[0] >= peak - 1e-9


def test_builtin_specs_cover_every_builtin_with_its_options():
    specs = builtin_specs(4, 8)
    assert {s.split(":")[0] for s, _ in specs} == {name for name, _, _ in BUILTINS}
    assert ("1f1b_recompute:k=3", 1) in specs and ("1f1b_recompute:k=4", 1) not in specs
    assert ("interleaved_1f1b", 3) in specs
    assert set(jpipe.registered_schedules()) >= {name for name, _, _ in BUILTINS}


@pytest.mark.parametrize("seed", range(20))
def test_applied_moves_validate_and_keep_the_compute(seed):
    import random

    rng = random.Random(seed)
    name = rng.choice(["1f1b", "zb_h1", "interleaved_1f1b", "vhalf", "gpipe"])
    base = jpipe.get_schedule(name, 4, 8)
    moves = {}
    for _ in range(rng.randint(1, 12)):
        s, m = rng.randrange(base.num_stages), rng.randrange(8)
        kind = rng.choice(["recompute", "evict", "offload"])
        partner = rng.choice([r for r in range(4) if r != base.stage_to_rank[s]])
        mv = Move(kind, s, m, lead=rng.randint(0, 1), partner=partner if kind == "evict" else -1,
                  after_input_grad=base.splits_backward and rng.random() < 0.5)  # fmt: skip
        try:
            apply_moves(base, [mv])
        except ValueError:
            continue  # no room for it on this pair
        moves[(s, m)] = mv
    schedule = apply_moves(base, sorted(moves.values()))
    jpipe.validate(schedule)
    assert schedule.without_memory_actions() == base
    # built without the schedule's checks, with the base's sizes and placement: the same as
    # a schedule made the ordinary way, which works them out from its actions
    fresh = jpipe.Schedule.of([list(row) for row in schedule.ranks], name=schedule.name)
    assert schedule == fresh and hash(schedule) == hash(fresh)
    for attribute in ("num_stages", "num_microbatches", "stage_to_rank", "has_memory_actions"):
        assert getattr(schedule, attribute) == getattr(fresh, attribute), attribute
    assert sum(a.is_memory for _, _, a in schedule.all_actions()) >= len(moves)


def _fitting(result):
    return [c for c in result.candidates if c.fits]


@pytest.mark.parametrize(
    "layout,budget",
    # where only the local search fits, where a built-in does, where everything does
    # (where nothing fits: test_no_local_search_where_the_weights_alone_do_not_fit and
    # test_the_local_search_gives_up_when_nothing_can_fit)
    # (the budgets where the search walks take seconds each are in the slow tier)
    [pytest.param("spmd", 5.0, marks=pytest.mark.slow),
     pytest.param("spmd", 7.0, marks=pytest.mark.slow), ("spmd", 100.0),
     pytest.param("mpmd", 4.5, marks=pytest.mark.slow),
     pytest.param("mpmd", 6.0, marks=pytest.mark.slow), ("mpmd", 100.0)],
)  # fmt: skip
def test_the_winner_is_the_fastest_that_fits(layout, budget):
    result = jpipe.search_schedule(UNIFORM, 4, 16, budget, layout=layout)
    fitting = _fitting(result)
    if not fitting:
        assert result.winner is None and result.best_builtin is None
        return
    w = result.winner
    assert result.usable == pytest.approx(0.9 * budget)  # the default margin keeps 10% free
    assert w.fits and w.memory.most <= result.usable
    assert all(w.time <= c.time for c in fitting)
    builtins = [c for c in fitting if c.builtin]
    assert (result.best_builtin is None) == (not builtins)  # the local search may fit alone
    if builtins:
        assert result.best_builtin.builtin and result.best_builtin.fits
        assert all(result.best_builtin.time <= c.time for c in builtins)
    jpipe.validate(w.schedule)
    assert runs_schedule(layout, w.schedule)
    if budget == 100.0:  # everything fits: the fastest of all
        assert w.time == min(c.time for c in result.candidates)
    text = "\n".join(result.reasons())
    assert w.label in text


def test_the_local_search_fits_1f1b_where_it_did_not():
    """Per rank, with only 1F1B to start from: memory actions make it fit, at some cost."""
    plain = jpipe.search_schedule(UNIFORM, 4, 16, 100.0, layout="mpmd", schedules=["1f1b"])
    base = plain.winner
    budget = base.memory.most - 1.5  # one and a half microbatches less on rank 0
    result = jpipe.search_schedule(UNIFORM, 4, 16, budget, layout="mpmd",
                                   schedules=["1f1b"], margin=0)  # fmt: skip
    w = result.winner
    assert w is not None and not w.builtin and w.moves
    assert w.memory.most <= budget < base.memory.most
    assert w.time >= base.time  # memory actions never shorten the step
    assert w.schedule.without_memory_actions() == base.schedule
    # and the simulator, run afresh, agrees with the bytes the search reports
    fig = UNIFORM.for_schedule(w.schedule)
    again = device_bytes(jpipe.simulate(w.schedule, fig.costs), fig, "mpmd")
    assert again.device == pytest.approx(w.memory.device)


@pytest.mark.parametrize("budget_drop", [1.0, 2.0])
def test_the_local_search_is_no_slower_than_the_builtin_recompute(budget_drop):
    """Greedy memory actions on 1F1B against 1f1b_recompute, the hand-made variant."""
    base = jpipe.search_schedule(UNIFORM, 4, 16, 100.0, layout="mpmd",
                                 schedules=["1f1b"]).winner  # fmt: skip
    budget = base.memory.most - budget_drop
    made = jpipe.search_schedule(
        UNIFORM, 4, 16, budget, layout="mpmd", margin=0,
        schedules=[f"1f1b_recompute:k={k}" for k in range(1, 4)],
    ).winner  # fmt: skip
    found = jpipe.search_schedule(UNIFORM, 4, 16, budget, layout="mpmd", margin=0,
                                  schedules=["1f1b"]).winner  # fmt: skip
    assert made is not None and found is not None
    assert found.time <= made.time


def test_the_walk_evaluates_each_schedule_once(monkeypatch):
    """A set of moves met again is not built and simulated again; it still counts as one
    simulation more, so that the bound on simulations and the count reported hold as they
    did when each was simulated anew."""
    from jpipe.search import engine as _schedule_search

    seen = []
    evaluate = _schedule_search._Evaluator.__call__

    def counting(self, schedule):
        seen.append(schedule.ranks)
        return evaluate(self, schedule)

    monkeypatch.setattr(_schedule_search._Evaluator, "__call__", counting)
    base = jpipe.get_schedule("1f1b", 4, 16)
    fig = UNIFORM.for_schedule(base)
    plain = device_bytes(jpipe.simulate(base, fig.costs), fig, "mpmd")
    found = local_search(base, fig, plain.most - 2.0, "mpmd")
    assert found.schedule is not None and found.memory.most <= plain.most - 2.0
    assert len(set(seen)) == len(seen)  # each once
    assert found.simulated > len(seen)  # the walk met some again, each counted
    assert isinstance(found.simulation, jpipe.Simulation)
    assert found.simulation == jpipe.simulate(found.schedule, fig.costs)


def test_the_local_search_gives_up_when_nothing_can_fit():
    base = jpipe.get_schedule("1f1b", 4, 8)
    fig = UNIFORM.for_schedule(base)
    # params and working memory alone exceed the budget: no memory action helps
    found = local_search(base, fig, 2.5, "mpmd")
    assert found.schedule is None and found.simulated >= 1


def test_several_microbatch_counts_scale_the_figures_with_the_batch():
    result = jpipe.search_schedule(UNIFORM, 4, [8, 16], 100.0, batch=64, schedules=["1f1b"])
    by_m = {c.microbatches: c for c in result.candidates}
    # M = 16 halves the microbatch: half the time and bytes per microbatch, same params
    assert by_m[16].memory.values[0] == pytest.approx(by_m[8].memory.values[0] / 2)
    assert by_m[16].memory.params == by_m[8].memory.params
    assert by_m[16].time == pytest.approx((16 + 3) * 3 / 2)
    assert by_m[8].time == pytest.approx((8 + 3) * 3)
    with pytest.raises(ValueError, match="do not divide the batch"):
        jpipe.search_schedule(UNIFORM, 4, [8, 12], 100.0, batch=64)


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="memory layout"):
        jpipe.search_schedule(UNIFORM, 4, 8, 6.0, layout="both")
    with pytest.raises(ValueError, match="budget"):
        jpipe.search_schedule(UNIFORM, 4, 8, 0)
    result = jpipe.search_schedule(UNIFORM, 4, 8, 6.0, schedules=["nonesuch", "1f1b"])
    assert any(
        line.startswith("nonesuch") and "unknown schedule" in line for line in result.skipped
    )


# -- the shipped GPT-2 small profile --------------------------------------------------------


def test_the_shipped_profile_loads_with_a_split_per_stage_count():
    profile = jpipe.load_stage_profile("gpt2_small")
    assert profile.microbatch_size == 4 and set(profile.splits) >= {4, 8}
    four = profile.splits[4]
    assert four.num_stages == 4 and sum(profile.blocks[4]) == 12
    # the head's stage: its F has the logits matmul, its working memory is the largest
    assert four.costs.F[3] > 2 * four.costs.F[1]
    assert max(four.working) == four.working[3]
    with pytest.raises(ValueError, match="no split into 16 stages"):
        profile.for_schedule(jpipe.get_schedule("interleaved_1f1b", 4, 8, 4))
    faster = jpipe.load_stage_profile("gpt2_small", {"flops_per_second": 2 * 0.4 * 989e12})
    assert faster.splits[4].costs.F[1] == pytest.approx(four.costs.F[1] / 2)
    with pytest.raises(ValueError, match="unknown rates"):
        jpipe.load_stage_profile("gpt2_small", {"flop": 1.0})
    with pytest.raises(ValueError, match="none shipped"):
        jpipe.load_stage_profile("gpt7_large")


def test_a_stage_profile_with_a_bad_field_is_refused_by_name():
    with open(jpipe.load_stage_profile.__globals__["PROFILES_DIR"] + "/gpt2_small.json") as f:
        d = json.load(f)
    bad = dict(d, splits=[dict(d["splits"][0], carry=[1.0])])
    with pytest.raises(ValueError, match=r"splits\[stages=2\]\.carry has 1 values, expected 2"):
        stage_profile_from_json(bad)
    with pytest.raises(ValueError, match="not a jpipe stage profile"):
        stage_profile_from_json(dict(d, format="jpipe-profile/2"))


@pytest.mark.slow
def test_gpt2_small_on_a_budget_1f1b_does_not_fit():
    profile = jpipe.load_stage_profile("gpt2_small")
    for layout in ("spmd", "mpmd"):
        every = jpipe.search_schedule(profile, 4, 16, 1e15, layout=layout, local=False)
        ref = next(c for c in every.candidates if c.spec == "1f1b")
        least = min(c.memory.most for c in every.candidates)
        budget = 1.01 * least / (1 - every.margin)  # the leanest built-in just fits
        result = jpipe.search_schedule(profile, 4, 16, budget, layout=layout)
        w = result.winner
        assert w is not None, result.reasons()
        assert w.memory.most <= result.usable < ref.memory.most  # 1F1B does not fit
        fitting_builtins = [c for c in result.candidates if c.fits and c.builtin]
        assert fitting_builtins and all(w.time <= c.time for c in fitting_builtins)
        assert budget > 2**30  # a real budget, in GiB


@pytest.mark.slow
def test_a_walk_that_ends_slow_turns_its_transfers_into_cheaper_moves():
    # GPT-2 small, 4 ranks, M = 16, SPMD, 12 GiB: the walk on ZB-V without
    # deferred weight gradients took five offloads early (slow host copies on
    # these figures) and ended 8.4x slower, so V-Half won though the 11 GiB
    # winner (ZB-V with recomputes in its bubbles) fits 12 too. Trying each
    # move as the others once it fits turns those offloads into recomputes:
    # the winner beats every built-in that fits (its step is 0.06% above the
    # 11 GiB winner's: the two walks take different paths).
    profile = jpipe.load_stage_profile("gpt2_small")
    result = jpipe.search_schedule(profile, 4, 16, 12 * 2**30, layout="spmd")
    builtins = [c for c in result.candidates if c.builtin and c.fits]
    assert not result.winner.builtin
    assert result.winner.time < min(c.time for c in builtins)
    assert not any(m.startswith("offload") for m in result.winner.moves)


# -- the command line -----------------------------------------------------------------------


FLAGS = [
    "--cost", "F=1,I=1,W=1,evict=0.3,offload=0.5",
    "--bytes", "activation=1GiB,carry=0.5GiB,params=2GiB,input=50MiB,working=1GiB",
    "-r", "4", "-m", "16",
]  # fmt: skip


@pytest.mark.slow
def test_cli_prints_the_winner_and_saves_it(tmp_path, capsys):
    csv, png = tmp_path / "w.csv", tmp_path / "w.png"
    code = search_cli.main(FLAGS + ["--budget", "6GiB", "--layout", "mpmd",
                                    "--csv", str(csv), "--png", str(png)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "winner:" in out and "best built-in that fits" in out and "fullest device" in out
    assert png.stat().st_size > 0
    saved = jpipe.Schedule.from_csv(csv)
    jpipe.validate(saved)
    code = search_cli.main(FLAGS + ["--budget", "6GiB", "--layout", "mpmd", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["winner"]["fits"] and d["layout"] == "mpmd"
    assert d["lowering"] == "mpmd" and max(d["winner"]["device_bytes"]) <= 0.9 * 6 * 2**30
    assert jpipe.Schedule.from_csv_text(saved.to_csv()).ranks == saved.ranks


def test_no_local_search_where_the_weights_alone_do_not_fit():
    result = jpipe.search_schedule(UNIFORM, 4, 16, 1.0)  # params 2 of each device's 0.9
    assert result.winner is None
    searched = [c for c in result.candidates if not c.builtin]
    assert not searched and result.simulated == len(result.candidates)
    assert any("alone exceed the 0.9 bytes" in line for line in result.skipped)


def test_cli_exit_codes(capsys):
    assert search_cli.main(FLAGS + ["--budget", "1GiB"]) == 1
    assert "nothing fits" in capsys.readouterr().out
    assert search_cli.main(FLAGS + ["--budget", "lots"]) == 2
    assert "cannot read 'lots' as bytes" in capsys.readouterr().err
    assert search_cli.main(["-r", "4", "-m", "8", "--budget", "1GiB"]) == 2
    assert "either as --profile or as --cost and --bytes" in capsys.readouterr().err
    assert search_cli.main(FLAGS[:-2] + ["-m", "8,16", "--budget", "6GiB"]) == 2
    assert "--batch" in capsys.readouterr().err


def test_cli_names_the_per_rank_lowering_where_it_fits_or_is_faster(capsys):
    """GPT-2 small on 4 ranks, M = 8: at 7 GiB nothing fits the SPMD program (every
    device holds the largest rank's terms) and the per-rank lowering's best does; at
    8 GiB it fits a faster schedule than the SPMD layout's; at 10 GiB both layouts'
    best is the same and nothing is said. The line names what an mpmd search gives."""
    flags = ["--profile", "gpt2_small", "-r", "4", "-m", "8", "--no-local"]
    profile = jpipe.load_stage_profile("gpt2_small")
    for budget, code, what in ((7, 1, "fits where nothing fits"), (8, 0, "faster")):
        own = jpipe.search_schedule(profile, 4, 8, budget * 2**30, layout="mpmd", local=False)
        assert search_cli.main(flags + ["--budget", f"{budget}GiB"]) == code
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.startswith("under the per-rank"))
        assert what in line and own.winner.label in line and f"step {own.winner.time:.4g}" in line
        assert search_cli.main(flags + ["--budget", f"{budget}GiB", "--json"]) == code
        d = json.loads(capsys.readouterr().out)
        assert (
            d["per_rank"] == json.loads(json.dumps(own.winner.to_json())) and d["per_rank"]["fits"]
        )
        assert (d["winner"] is None) == (code == 1)
    assert search_cli.main(flags + ["--budget", "10GiB"]) == 0
    assert "per-rank" not in capsys.readouterr().out
    assert search_cli.main(flags + ["--budget", "8GiB", "--layout", "mpmd"]) == 0
    assert "under the per-rank" not in capsys.readouterr().out


def test_cli_reads_per_stage_lists_and_units():
    fig = search_cli.figures_from_flags("F=1/1/1/2,comm=0.1/0.1/0.1", "activation=1GiB/1/1/1")
    assert fig.num_stages == 4 and fig.costs.F == (1, 1, 1, 2)
    assert fig.sizes.activation[0] == 2**30
    assert search_cli.parse_bytes("1.5 GB") == 1.5e9
    assert math.isclose(search_cli.parse_bytes("512MiB"), 0.5 * 2**30)
    with pytest.raises(ValueError, match="lists of"):
        search_cli.figures_from_flags("F=1/2", "activation=1/2/3")


@pytest.mark.slow
def test_cli_on_the_shipped_profile(capsys):
    code = search_cli.main(["--profile", "gpt2_small", "-r", "4", "-m", "16",
                            "--budget", "12GiB", "--json"])  # fmt: skip
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and max(d["winner"]["device_bytes"]) <= 0.9 * 12 * 2**30
    assert d["layout"] == "spmd" and "GPT-2 small" in d["figures"]
    assert dataclasses.is_dataclass(jpipe.load_stage_profile("gpt2_small"))


def test_per_rank_local_search_counts_each_ranks_own_room():
    """Under "mpmd" a rank whose own bytes leave room is searched, though the
    busiest rank's bytes on every device (the SPMD room) would leave none."""
    figures = StageFigures(
        jpipe.Costs(F=1, I=1, W=1, evict=0.3, offload=0.5),
        jpipe.Sizes(activation=2, carry=0.5, input=0.05, params=[10, 1]),
        working=[1, 8],
        grad_output=[5, 0.5],
        num_stages=2,
    )
    found = jpipe.search_schedule(
        figures, 2, 4, budget=20, layout="mpmd", schedules=["gpipe"], margin=0
    )
    assert not found.candidates[0].fits  # plain GPipe holds too much: the walk must run
    assert not any("no local search" in line for line in found.skipped), found.skipped
    assert found.winner is not None and found.winner.fits
    assert found.winner.memory.most <= 20


@pytest.mark.parametrize("name", ["zb_h1", "1f1b", "zbv"])
def test_per_rank_bytes_add_each_pieces_own_working_memory(name):
    """With working memory per kind of piece, the per-rank model holds on each rank the
    most of (values held when a piece starts + that piece's own working memory) and its
    peak of values: a walk of each rank's list gives the same, and never more than
    the largest working memory on top of the peak (what it counts without them). The
    SPMD model sizes its working memory once, so it does not change."""
    S = 8 if name == "zbv" else 4
    schedule = jpipe.get_schedule(name, 4, 8)
    act, carry = 1.0, 3.0
    by_kind = [{"F": 2.0 + s, "I": 5.0 + s, "W": 1.0, "B": 6.0} for s in range(S)]
    base = StageFigures(
        jpipe.Costs(F=1, I=1, W=1, B=2),
        jpipe.Sizes(activation=act, carry=carry, params=[10.0] * S),
        working=[max(k.values()) for k in by_kind],
        num_stages=S,
    )
    figures = dataclasses.replace(base, working_by_kind=by_kind)
    sim = jpipe.simulate(schedule, figures.costs)
    with_kinds, without = device_bytes(sim, figures, "mpmd"), device_bytes(sim, base, "mpmd")
    for r in range(4):
        held = peak = busy = 0.0
        for a in schedule.ranks[r]:
            busy = max(busy, held + by_kind[a.stage][a.kind])
            held += {"F": act, "I": carry, "W": -act - carry, "B": -act}[a.kind]
            peak = max(peak, held)
        params = with_kinds.device[r] - max(peak, busy)
        assert params == pytest.approx(without.device[r] - peak - without.working[r])
        assert with_kinds.values[r] == pytest.approx(peak)
        assert with_kinds.device[r] <= without.device[r] + 1e-9
    if name == "zb_h1":  # a rank whose largest piece (an I) does not run at its peak
        assert with_kinds.most < without.most
    spmd = device_bytes(sim, figures, "spmd"), device_bytes(sim, base, "spmd")
    assert spmd[0].device == spmd[1].device


@pytest.mark.parametrize("layout", ["spmd", "mpmd"])
def test_replicated_built_ins_are_candidates_with_each_ranks_copies_counted(layout):
    # Chimera and DualPipe (each stage on two ranks, issue 39) run under both
    # lowerings: the search weighs them, each rank holding its copies' parameters.
    specs = ["1f1b", "chimera", "dualpipe"]
    found = jpipe.search_schedule(UNIFORM, 4, 8, 1e9, layout=layout, schedules=specs)
    assert {"chimera", "dualpipe"} <= {c.schedule.name for c in found.candidates}, found.skipped
    one = next(c for c in found.candidates if c.schedule.name == "1f1b" and c.builtin)
    for c in found.candidates:
        if c.schedule.replicated:  # two stages' parameters a rank, 1F1B's one
            assert max(c.memory.params) == 2 * max(one.memory.params), c.memory


def test_the_gradient_sum_of_the_copies_scales_with_the_parameters_not_the_microbatch():
    fig = StageFigures(jpipe.Costs(F=1, sync=3), jpipe.Sizes(params=2))
    assert fig.scaled(0.5).costs.sync == 1.5  # finer stages: fewer parameters each
    assert fig.scaled(0.5, params=False).costs.sync == 3  # smaller microbatches only
    assert fig.scaled(0.5, params=False).costs.F == 0.5
