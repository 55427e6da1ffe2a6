"""The search's winner compiles within its budget: a small GPT's stage profile made from
shapes as bench/stage_profile.py makes GPT-2 small's, the search under each layout, the
winner compiled as bench/search_budgets.py compiles GPT-2 small's."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

import jpipe

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `bench` lives beside `jpipe`, not in the installed package

from bench import memory, search_budgets, stage_profile  # noqa: E402

pytestmark = pytest.mark.slow  # every test compiles and runs pipelines

# 8 blocks (so that a V's 8 stages each hold one), wide enough that residuals, not
# bookkeeping, fill a device.
SMALL = dataclasses.replace(
    memory.GPT2_SMALL, vocab_size=512, seq_len=128, num_layers=8, d_model=128,
    num_heads=4, d_ff=512,
)  # fmt: skip


@pytest.fixture(scope="module")
def profile():
    splits = [stage_profile.split_figures(S, SMALL, log=lambda line: None) for S in (4, 8)]
    d = {
        "format": "jpipe-stages/1",
        "model": "a small GPT",
        "microbatch_size": memory.MICROBATCH,
        "rates": stage_profile.RATES,
        "splits": splits,
    }
    return jpipe.load_stage_profile(json.loads(json.dumps(d)))


@pytest.mark.parametrize("layout", ["spmd", "mpmd"])
def test_the_winner_compiles_within_a_budget_1f1b_does_not_fit(profile, layout):
    every = jpipe.search_schedule(profile, 4, 8, 1e15, layout=layout, local=False)
    ref = next(c for c in every.candidates if c.spec == "1f1b")
    budget = 0.97 * ref.memory.most  # with the 10% margin, 1F1B is well over
    result = jpipe.search_schedule(profile, 4, 8, budget, layout=layout)
    w = result.winner
    assert w is not None, result.reasons()
    assert ref.memory.most > result.usable >= w.memory.most
    lowering = result.lowering
    compiled = search_budgets.compiled_bytes(w.schedule, lowering, 8, config=SMALL)
    assert max(compiled["device"]) <= budget, (w.label, compiled)
