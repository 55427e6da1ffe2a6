"""Data sources: the BPE tokenizer, Grain's token windows, and functions of one's own.

Each is served by step, a pure function of it, so a resumed run reads what
an unbroken one did; with several processes each reads only its own rows.
"""

import importlib.util
import itertools
from pathlib import Path

import ml_collections
import numpy as np
import pytest

from jpipe import train as trainer
from jpipe.train import data, sources, tokens

ROOT = Path(__file__).resolve().parents[1]
TEXT = data.read_corpus("", 256 * 1024)  # the start of the standard library's source


@pytest.fixture(scope="module")
def tokenizer():
    return tokens.train_bpe(TEXT, 512)


def test_bpe_is_trained_here_deterministically_and_round_trips(tokenizer):
    assert tokenizer.get_vocab_size() == 512
    assert tokens.train_bpe(TEXT, 512).to_str() == tokenizer.to_str()  # every process alike
    ids = tokens.encode(tokenizer, TEXT[:4096])
    assert ids.dtype == np.int32 and ids.max() < 512
    assert len(ids) < 0.6 * 4096  # merges: fewer tokens than bytes (1.9 bytes a token here)
    assert tokenizer.decode(ids.tolist()) == bytes(TEXT[:4096]).decode("utf-8", errors="replace")
    with pytest.raises(ValueError, match="more than the 256 byte tokens"):
        tokens.train_bpe(TEXT, 256)


def test_grain_batches_are_a_function_of_the_step_split_by_process(tokenizer):
    ids = tokens.encode(tokenizer, TEXT)
    batches = tokens.GrainBatches(ids, seq_len=16, batch_size=8, seed=3, name="train")
    first = batches.batch_at(5)
    np.testing.assert_array_equal(first["tokens"], batches.batch_at(5)["tokens"])
    np.testing.assert_array_equal(first["tokens"][:, 1:], first["targets"][:, :-1])
    halves = [batches.batch_at(5, p, 2) for p in range(2)]  # each process its block of rows
    for key in first:
        np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), first[key])
    # Every window once per epoch, then the next epoch in another order.
    W = batches.num_windows
    rows = np.concatenate([batches.batch_at(s)["tokens"] for s in range(2 * W // 8 + 2)])
    starts = {tuple(r[:4]) for r in rows[:W]}
    assert len(starts) == len({tuple(ids[i * 16 : i * 16 + 4]) for i in range(W)})
    assert not np.array_equal(rows[:8], rows[W : W + 8])


@pytest.mark.slow
def test_trainer_learns_nothing_but_runs_on_bpe_tokens(tmp_path):
    spec = importlib.util.spec_from_file_location("default_config", ROOT / "configs" / "default.py")
    default = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(default)
    config = default.get_config()
    config.steps, config.eval_every, config.eval_batches, config.checkpoint_every = 2, 0, 1, 0
    config.batch_size, config.num_microbatches = 8, 2
    config.mesh.pipe, config.mesh.data = 2, 1
    config.data.tokenizer, config.data.max_bytes = "bpe", 256 * 1024
    config.model.vocab_size, config.model.seq_len, config.model.num_layers = 512, 16, 2
    config.model.d_model, config.model.d_ff, config.model.num_heads = 32, 64, 2
    result = trainer.train(config, tmp_path, progress=False)
    assert result.final_step == 2
    assert abs(result.eval_losses[0] - np.log(512)) < 0.3  # uniform over the BPE vocabulary


def _counting(args):
    """A source whose batch of step k is all k, for this process's rows."""
    for step in itertools.count(args.start_step):
        yield {"x": np.full((args.rows, 2), step + 1000 * args.process_index, np.int32)}


def test_an_iterable_source_restarts_at_the_step_asked_for():
    args = sources.DataArgs(ml_collections.FrozenConfigDict({}), "train", 4, seed=0)
    served = sources.SourceBatches(_counting, args, "counting")
    assert [int(served.batch_at(s)["x"][0, 0]) for s in (0, 1, 2)] == [0, 1, 2]
    assert int(served.batch_at(7)["x"][0, 0]) == 7  # a resumed run: the source restarts at 7
    assert int(served.batch_at(0)["x"][0, 0]) == 0  # an evaluation reads from 0 again
    assert served.batch_at(3, 1, 2)["x"].tolist() == [[1003, 1003], [1003, 1003]]


def test_bad_sources_are_refused_in_words():
    args = sources.DataArgs(ml_collections.FrozenConfigDict({}), "train", 4, seed=0)
    short = sources.SourceBatches(lambda a: iter([{"x": np.zeros((4, 1))}]), args, "short")
    short.batch_at(0)
    with pytest.raises(ValueError, match="ran out of batches at step 1"):
        short.batch_at(1)
    wrong = sources.SourceBatches(lambda a: iter([{"x": np.zeros((3, 1))}]), args, "wrong")
    with pytest.raises(ValueError, match=r"leading axis must be this process's 4 rows"):
        wrong.batch_at(0)
    with pytest.raises(ValueError, match="unknown data source 'nowhere'"):
        sources.get_source("nowhere")


def test_a_registered_source_is_found_by_name():
    name = "test_sources.counting"
    assert sources.register_source(name)(_counting) is _counting
    assert sources.get_source(name) is _counting
    with pytest.raises(ValueError, match="already registered"):
        sources.register_source(name)(lambda args: iter(()))
