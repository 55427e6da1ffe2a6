"""The schedule search on the trainer's own profile, its units, its tie rule, strict reading.

`tests/data/train_profile.json` is what ``train.py --config.profile=True``
wrote for a small GPT (8 blocks of width 32, 16-byte sequences, 4 stages of 2
blocks, microbatches of 2) on 4 fake CPU devices, with the command in
`TRAIN_COMMAND` (about 2.5 minutes on a loaded 2-core machine, which is why
it is committed rather than written here). Its times are CPU medians under
load, noisy; the tests below depend on its structure (stages, blocks, bytes),
not on which schedule its times favour. One test writes a profile through
the functions the trainer writes with (`jpipe.planner`), so that a change
to that format shows here even before the fixture is rewritten.
"""

import json
import math
import re
import warnings
from pathlib import Path

import pytest

import jpipe
import jpipe.planner
from jpipe.models import split_layers
from jpipe.search import cli as search_cli

FIXTURE = Path(__file__).parent / "data" / "train_profile.json"
TRAIN_COMMAND = (
    "python train.py --workdir=DIR --config.steps=1 --config.eval_every=0 "
    "--config.checkpoint_every=0 --config.batch_size=8 --config.num_microbatches=4 "
    "--config.mesh.pipe=4 --config.mesh.data=1 --config.data.max_bytes=65536 "
    "--config.model.seq_len=16 --config.model.num_layers=8 --config.model.num_heads=2 "
    "--config.model.d_model=32 --config.model.d_ff=64 --config.optimizer.warmup_steps=1 "
    "--config.profile=True"
)
V_SHAPES = {"zbv", "vhalf", "vmin", "dualpipev"}


def _raw():
    return json.loads(FIXTURE.read_text())


def _load(d=None, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fixture's noisy times warn; tested below
        return jpipe.load_stage_profile(_raw() if d is None else d, **kwargs)


def test_the_fixture_is_in_the_format_the_trainer_writes_today():
    fresh = jpipe.planner.profile_to_json(
        jpipe.planner.profile_from_stage_times(
            jpipe.Costs(F=(1.0,), I=(1.0,), W=(1.0,)), "cpu", microbatch_size=1,
            blocks_per_stage=(1,),
        )
    )  # fmt: skip
    d = _raw()
    assert d["format"] == fresh["format"] == "jpipe-profile/2"
    assert set(d) == set(fresh)  # no field the writer dropped or added since
    assert d["layer_blocks"] == [2, 2, 2, 2]  # measured stages, not layers
    assert _load().microbatch_size == 2


def test_the_measured_split_comes_back_and_other_splits_are_formed():
    d, profile = _raw(), _load()
    mbs = profile.microbatch_size
    times = d["devices"]["cpu"]["times"][0]
    assert mbs == times["microbatch_size"] == 2
    terms = d["memory_terms"]
    per_param = sum(terms[k] for k in ("weight_bytes", "gradient_bytes", "optimizer_bytes",
                                       "buffer_bytes"))  # fmt: skip
    four = profile.for_schedule(jpipe.get_schedule("1f1b", 4, 8))
    # the measured 4 stages: the first and last exactly, the middle ones at their mean (a
    # block is their sum over their blocks: the model's blocks are alike, the times noisy)
    for key, measured in (("F", "forward"), ("I", "input_grad"), ("W", "weight_grad")):
        got, want = getattr(four.costs, key), times[measured]
        assert (got[0], got[3]) == pytest.approx((want[0], want[3]), rel=1e-12)
        assert got[1] == got[2] == pytest.approx((want[1] + want[2]) / 2)
    assert four.sizes.activation == pytest.approx([mbs * a for a in d["activation_bytes"]["1"]])
    assert four.sizes.params == pytest.approx([per_param * p for p in d["params"]["1"]])
    assert four.working == pytest.approx(
        [terms["working_factor"] * mbs * a for a in d["activation_bytes"]["1"]]
    )
    # 8 stages of one block each (ZB-V's on 4 ranks): a middle stage is half a middle
    # measured stage, and the bytes of the model are the same whatever the split
    eight = profile.for_schedule(jpipe.get_schedule("zbv", 4, 8))
    assert eight.num_stages == 8
    for key in ("F", "I", "W"):
        assert getattr(eight.costs, key)[3] == pytest.approx(
            (getattr(four.costs, key)[1] + getattr(four.costs, key)[2]) / 4
        )
    assert sum(eight.sizes.params) == pytest.approx(sum(four.sizes.params))
    assert eight.sizes.activation[1:-1] == pytest.approx([four.sizes.activation[1] / 2] * 6)
    # an FC keeps the stage's input: the stage before's output (a block's output)
    assert eight.sizes.input[0] == 0 and eight.sizes.input[1] == mbs * d["output_bytes"][0]
    # the split is the trainer's own balanced split
    for S in (2, 3, 4, 5, 6, 8, 10):
        assert profile.split(S) == split_layers(8, S)
    with pytest.raises(ValueError, match="8 blocks cannot make 12 stages"):
        profile.for_schedule(jpipe.get_schedule("interleaved_1f1b", 4, 8, 3))


def test_v_schedules_compete_on_the_trainers_profile_in_python():
    profile = _load()
    result = jpipe.search_schedule(profile, 4, 8, 64 * 2**20, local=False)
    v = [c for c in result.candidates if c.chunks == 2]
    assert {c.spec.split(":")[0] for c in v} >= V_SHAPES | {"interleaved_1f1b"}
    assert all(c.fits for c in v)  # 64 MiB holds a model of 0.4 MiB a stage
    assert not any("zbv" in line or "vhalf" in line for line in result.skipped)
    # 2 ranks: V schedules on 4 stages, and the user's own V (a SPEC with its chunks)
    two = jpipe.search_schedule(profile, 2, 4, 64 * 2**20, local=False,
                                schedules=[("vhalf", 2), "1f1b", ("zbv", 2)])  # fmt: skip
    assert sorted(c.schedule.num_stages for c in two.candidates) == [2, 4, 4]


def test_v_schedules_compete_on_the_trainers_profile_on_the_command_line(capsys):
    code = search_cli.main(["--profile", str(FIXTURE), "-r", "4", "-m", "8",
                            "--budget", "4MiB", "--no-local", "--json"])  # fmt: skip
    captured = capsys.readouterr()
    d = json.loads(captured.out)
    assert code == 0 and d["winner"]["fits"]
    specs = {c["spec"].split(":")[0] for c in d["candidates"] if c["chunks"] == 2}
    assert specs >= V_SHAPES
    # the fixture's noisy CPU times put its first stage below two middle blocks: said
    assert d["warnings"] and all(w.startswith(str(FIXTURE)) for w in d["warnings"])
    assert "warning:" not in captured.out and captured.err.count("warning:") == len(d["warnings"])


def test_sizes_print_in_units_that_suit_them(capsys):
    code = search_cli.main(["--profile", str(FIXTURE), "-r", "4", "-m", "8",
                            "--budget", "4MiB", "--no-local", "--width", "60"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "0.00 GiB" not in out and "GiB" not in out  # a model of KiB and MiB
    assert "budget 4.00 MiB per device" in out
    assert "of 4.00 MiB (3.60 MiB with the 10% margin)" in out
    assert "params 403.00 KiB" in out  # the fullest device's terms, each in its own unit
    assert "device (MiB)" in out and "     MiB  memory actions  fits" in out  # one per table
    # bytes on the --bytes flags: a handful of bytes prints as bytes
    code = search_cli.main(["--cost", "F=1,I=1,W=1", "--bytes", "activation=100,params=300",
                            "-r", "2", "-m", "4", "--budget", "2KiB", "--no-local"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "budget 2.00 KiB per device" in out and " B on the fullest" in out
    # the GPT-2 small profile keeps its GiB
    result = jpipe.search_schedule(jpipe.load_stage_profile("gpt2_small"), 4, 8, 20 * 2**30,
                                   local=False, schedules=["1f1b"])  # fmt: skip
    assert "of 20.00 GiB" in result.reasons()[0]


def test_a_tie_in_time_goes_to_the_schedule_with_fewer_memory_actions(capsys):
    """ZB-H1 and ZB-H1 with offloads (copies hidden behind compute) tie in time; the one
    without memory actions wins, though the offloads hold fewer bytes."""
    profile = _load()
    specs = ["zb_h1_offload:min_gap=3", "zb_h1_offload:min_gap=6", "zb_h1"]
    result = jpipe.search_schedule(profile, 4, 8, 64 * 2**20, schedules=specs, local=False)
    offload, gap6, plain = (next(c for c in result.candidates if c.spec == s) for s in specs)
    assert offload.time == plain.time == gap6.time  # the tie
    assert offload.memory_actions == 120 and plain.memory_actions == 0 < gap6.memory_actions
    assert offload.memory.most < plain.memory.most  # less memory would have chosen it
    assert result.winner is plain and result.best_builtin is plain
    assert list(result.candidates) == [plain, gap6, offload]
    # time still comes first: with the host link 1000x slower, offloads cost time
    slow = _load(rates={"host_bytes_per_s": 25e6})
    result = jpipe.search_schedule(slow, 4, 8, 64 * 2**20, schedules=specs, local=False)
    assert result.winner.spec == "zb_h1"
    assert [c.time for c in result.candidates] == sorted(c.time for c in result.candidates)
    # and the command line lists them so
    search_cli.main(["--profile", str(FIXTURE), "-r", "4", "-m", "8", "--budget", "64MiB",
                     "--no-local", "--schedules", ",".join(specs)])  # fmt: skip
    out = capsys.readouterr().out
    assert "winner: zb_h1, M=8" in out
    rows = [
        line.split()[0]
        for line in out.splitlines()
        if line.startswith("zb_h1") and ", M=8 " in line
    ]
    assert rows == ["zb_h1,", "zb_h1_offload:min_gap=6,", "zb_h1_offload:min_gap=3,"]


def test_a_two_stage_profile_forms_only_its_own_split():
    d = _raw()
    two = dict(d, layer_kinds=["block", "block"], layer_blocks=[4, 4],
               params={"1": d["params"]["1"][:2]},
               activation_bytes={"1": d["activation_bytes"]["1"][:2]},
               output_bytes=d["output_bytes"][:2])  # fmt: skip
    times = dict(d["devices"]["cpu"]["times"][0])
    for key in ("forward", "backward", "update", "input_grad", "weight_grad"):
        times[key] = times[key][:2]
    two["devices"] = {"cpu": {"memory_bytes": None, "times": [times]}}
    profile = _load(two)
    fig = profile.for_schedule(jpipe.get_schedule("1f1b", 2, 4))
    assert fig.costs.F == pytest.approx(times["forward"])
    result = jpipe.search_schedule(profile, 2, 4, 64 * 2**20, local=False)
    assert result.winner is not None and all(c.chunks == 1 for c in result.candidates)
    assert any("no middle one" in line and "--config.mesh.pipe=4" in line
               for line in result.skipped)  # fmt: skip


def test_the_trainers_writer_and_the_search_agree(tmp_path):
    """A profile made by the functions train.py calls (`profile_from_stage_times`,
    `save_profile`) reads back: 3 stages of 2, 3, 1 blocks, embedding and head cheap."""
    F, I, W = (0.3, 0.3, 0.15), (0.2, 0.3, 0.15), (0.4, 0.3, 0.25)
    prof = jpipe.planner.profile_from_stage_times(
        jpipe.Costs(F=F, I=I, W=W), "H100", microbatch_size=4,
        params=(3e6, 3e6, 2e6), activation_bytes=(8e6, 12e6, 6e6),
        output_bytes=(4096, 4096, 16), blocks_per_stage=(2, 3, 1), model="toy",
    )  # fmt: skip
    path = tmp_path / "profile.json"
    jpipe.planner.save_profile(prof, str(path))
    profile = jpipe.load_stage_profile(str(path))
    block_F, block_act = 0.1, 4e6  # the middle stage's, per block
    six = profile.for_schedule(jpipe.get_schedule("interleaved_1f1b", 3, 6, 2))
    assert six.costs.F == pytest.approx([0.2, 0.1, 0.1, 0.1, 0.1, 0.15])
    # the embedding keeps nothing of its own (8e6 is its stage's 2 blocks), the head 2e6
    assert six.sizes.activation == pytest.approx([block_act] * 5 + [block_act + 2e6])
    assert sum(six.costs.F) == pytest.approx(sum(F)) and six.costs.F[2] == pytest.approx(block_F)
    assert six.sizes.input == pytest.approx([0, 4096, 4096, 4096, 4096, 4096])
    # unmeasured links: the assumed rates, said in the source line
    assert "links assumed" in profile.source
    assert six.costs.evict[1] == pytest.approx(block_act / 200e9)


def test_a_per_layer_profile_picks_its_device(tmp_path):
    path = tmp_path / "opt.json"
    jpipe.planner.save_profile(jpipe.planner.load_sailor_profile("OPT-350"), str(path))
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(path))}: devices has .*A100-40.*say which \(--device\)"
    ):
        jpipe.load_stage_profile(str(path))
    profile = jpipe.load_stage_profile(str(path), device="A100-40")
    fig = profile.for_schedule(jpipe.get_schedule("zbv", 4, 8))
    assert fig.num_stages == 8 and all(f > 0 for f in fig.costs.F)
    assert search_cli.main(["--profile", str(path), "--device", "A100-40", "-r", "4", "-m", "8",
                            "--budget", "40GiB", "--no-local", "--json"]) in (0, 1)  # fmt: skip


# -- strict reading --------------------------------------------------------------------------


def _stages_profile():
    shipped = Path(jpipe.__file__).parent / "_data" / "profiles" / "gpt2_small.json"
    return json.loads(shipped.read_text())


def _write(tmp_path, d, name="p.json"):
    path = tmp_path / name
    path.write_text(json.dumps(d))
    return str(path)


def _trainer_bad(change):
    d = _raw()
    change(d)
    return d


def _stages_bad(change):
    d = _stages_profile()
    change(d)
    return d


def _times(d):
    return d["devices"]["cpu"]["times"][0]


@pytest.mark.parametrize(
    "make, field, why",
    [
        (lambda: _trainer_bad(lambda d: _times(d)["forward"].__setitem__(1, "0.001")),
         r"devices\.cpu\.times\[0\]\.forward\[1\]", "expected a number"),
        (lambda: _trainer_bad(lambda d: _times(d)["forward"].__setitem__(1, math.nan)),
         r"devices\.cpu\.times\[0\]\.forward\[1\]", "finite and non-negative"),
        (lambda: _trainer_bad(lambda d: _times(d)["input_grad"].__setitem__(0, -1e-3)),
         r"devices\.cpu\.times\[0\]\.input_grad\[0\]", "finite and non-negative"),
        (lambda: _trainer_bad(lambda d: _times(d)["forward"].__setitem__(2, 4200.0)),
         r"devices\.cpu\.times\[0\]\.forward\[2\]", "over an hour"),
        (lambda: _trainer_bad(lambda d: d["activation_bytes"].__setitem__("1", [1e-4] * 4)),
         r"activation_bytes\[1\]", "under one byte"),
        (lambda: _trainer_bad(lambda d: d["params"].__setitem__("1", [0.02] * 4)),
         r"params\[1\]\[0\]", "under one parameter"),
        (lambda: _trainer_bad(lambda d: d["params"].__setitem__("1", [True] * 4)),
         r"params\[1\]\[0\]", "expected a number"),
        (lambda: _trainer_bad(lambda d: d["memory_terms"].__setitem__("weight_bytes", 4e9)),
         "memory_terms", "bytes per parameter"),
        (lambda: _trainer_bad(lambda d: d.pop("output_bytes")),
         "output_bytes", "missing"),
        (lambda: _trainer_bad(lambda d: d.__setitem__("layer_blocks", [2, 2, "2", 2])),
         r"layer_blocks\[2\]", "whole number"),
        (lambda: _stages_bad(lambda d: d["rates"].__setitem__("flops_per_second", 395.6)),
         r"rates\.flops_per_second", "outside any device's range"),
        (lambda: _stages_bad(lambda d: d["rates"].__setitem__("host_bytes_per_s", 25.0)),
         r"rates\.host_bytes_per_s", "outside any device's range"),
        (lambda: _stages_bad(lambda d: d["splits"][1]["flops"]["F"].__setitem__(0, 0.216)),
         r"splits\[stages=4\]\.flops\.F\[0\]", "under one FLOP"),
        (lambda: _stages_bad(lambda d: d["splits"][1].__setitem__("activation", [0.4] * 4)),
         r"splits\[stages=4\]\.activation\[0\]", "under one byte.*GiB"),
        (lambda: _stages_bad(lambda d: d["splits"][1].__setitem__("params", [0.9, 1, 1, 1])),
         r"splits\[stages=4\]\.params\[0\]", "under one byte"),
        (lambda: _stages_bad(lambda d: d["splits"][1]["flops"]["W"].__setitem__(2, "1e12")),
         r"splits\[stages=4\]\.flops\.W\[2\]", "expected a number"),
        (lambda: _stages_bad(lambda d: d["splits"][1]["flops"]["F"].__setitem__(1, math.inf)),
         r"splits\[stages=4\]\.flops\.F\[1\]", "finite"),
        (lambda: _stages_bad(lambda d: d.__setitem__("microbatch_size", 4.0)),
         "microbatch_size", "whole number"),
    ],
)  # fmt: skip
def test_a_bad_profile_is_refused_in_one_line_naming_the_file_and_the_field(
    tmp_path, capsys, make, field, why
):
    path = _write(tmp_path, make())
    with pytest.raises(ValueError, match=rf"^{re.escape(path)}: .*{field}.*{why}") as info:
        _load(path)
    assert "\n" not in str(info.value)
    assert search_cli.main(["--profile", path, "-r", "4", "-m", "8", "--budget", "9GiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and err.count("\n") == 1


def test_doubtful_numbers_are_read_with_a_warning_naming_the_file_and_the_field(tmp_path):
    d = _stages_profile()
    d["splits"][1]["carry"][2] += 0.5  # half a byte: in another unit?
    path = _write(tmp_path, d)
    with pytest.warns(
        UserWarning, match=rf"^{re.escape(path)}: splits\[stages=4\]\.carry\[2\].*whole"
    ):
        profile = jpipe.load_stage_profile(path)
    assert len(profile.warnings) == 1 and profile.warnings[0].startswith(path)
    # the fixture's first stage measured faster than two middle blocks: noise, said
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile = jpipe.load_stage_profile(str(FIXTURE))
    said = [str(w.message) for w in caught]
    assert said == list(profile.warnings) and len(said) == 2
    assert "stage 0 measured less F time than its 2 block(s)" in said[0]
    assert "stage 3 measured less I time" in said[1] and "the head's own is taken as 0" in said[1]


def test_other_formats_and_rates_are_refused_by_name(tmp_path):
    path = _write(tmp_path, {"format": "jpipe-profile/9"})
    with pytest.raises(ValueError, match="'jpipe-profile/9'; the search reads 'jpipe-stages/1'"):
        jpipe.load_stage_profile(path)
    with pytest.raises(ValueError, match="flops_per_second.*times are measured"):
        jpipe.load_stage_profile(str(FIXTURE), {"flops_per_second": 1e14})
    with pytest.raises(ValueError, match=r"--rate partner_bytes_per_s is 200 B/s"):
        jpipe.load_stage_profile(str(FIXTURE), {"partner_bytes_per_s": 200})
    with pytest.raises(ValueError, match="devices has no 'H100'"):
        jpipe.load_stage_profile(str(FIXTURE), device="H100")
