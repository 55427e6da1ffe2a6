"""The byte corpus and its batches: deterministic, resumable, shardable."""

import numpy as np
import pytest

from jpipe.train import data

KW = dict(path="", max_bytes=1 << 20, eval_fraction=0.1, seq_len=32, batch_size=8, seed=0)


def _random_text(tmp_path, size, name="text.txt", seed=0):
    """A file of random bytes: every window of it occurs only once."""
    content = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    (tmp_path / name).write_bytes(content)
    return content


def _rows(batch):
    """Each row as the L + 1 bytes it was cut from."""
    tokens, targets = batch["tokens"], batch["targets"]
    np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])
    return [bytes(row.astype(np.uint8)) for row in np.concatenate([tokens, targets[:, -1:]], 1)]


def test_stdlib_corpus_is_python_and_deterministic():
    corpus = data.read_corpus("", max_bytes=1 << 20)
    assert corpus.dtype == np.uint8 and len(corpus) == 1 << 20
    assert b"def " in corpus.tobytes() and b"import " in corpus.tobytes()
    np.testing.assert_array_equal(corpus, data.read_corpus("", max_bytes=1 << 20))
    assert all(f.endswith(".py") and "site-packages" not in f for f in data.corpus_files(""))


def test_batches_are_int32_shifted_by_one_and_deterministic():
    train, _ = data.make_datasets(**KW)
    again, _ = data.make_datasets(**KW)
    other_seed, _ = data.make_datasets(**{**KW, "seed": 1})
    batch = train.batch_at(3)
    assert batch["tokens"].shape == batch["targets"].shape == (8, 32)
    assert batch["tokens"].dtype == batch["targets"].dtype == np.int32
    assert batch["tokens"].min() >= 0 and batch["tokens"].max() < data.VOCAB_SIZE
    _rows(batch)  # checks the shift
    for step in (0, 3, 1000):
        for key in ("tokens", "targets"):
            np.testing.assert_array_equal(train.batch_at(step)[key], again.batch_at(step)[key])
    assert not np.array_equal(batch["tokens"], other_seed.batch_at(3)["tokens"])
    assert not np.array_equal(batch["tokens"], train.batch_at(4)["tokens"])


def test_resume_at_any_step_matches_an_uninterrupted_run():
    small = {**KW, "max_bytes": 16 << 10}
    train, _ = data.make_datasets(**small)
    assert 400 * 8 > 6 * train.num_windows  # several epochs
    uninterrupted = [train.batch_at(step)["tokens"] for step in range(400)]
    for resume_at in (0, 1, 117, 399):
        fresh, _ = data.make_datasets(**small)
        np.testing.assert_array_equal(fresh.batch_at(resume_at)["tokens"], uninterrupted[resume_at])


def test_each_epoch_visits_every_window_once(tmp_path):
    content = _random_text(tmp_path, 8 * 20 + 12)
    batches = data.Batches(np.frombuffer(content, np.uint8), seq_len=8, batch_size=4, seed=5)
    assert batches.num_windows == 20
    for epoch in range(3):
        rows = [
            r for step in range(5 * epoch, 5 * epoch + 5) for r in _rows(batches.batch_at(step))
        ]
        starts = sorted(content.find(row) for row in rows)
        shift = starts[0]
        assert starts == [shift + 8 * i for i in range(20)], f"epoch {epoch}"


def test_train_and_eval_are_disjoint_parts_of_the_corpus(tmp_path):
    content = _random_text(tmp_path, 20_000)
    train, held_out = data.make_datasets(
        **{**KW, "path": str(tmp_path / "text.txt"), "max_bytes": 0}
    )
    cut = len(content) - 2000
    assert train.data.tobytes() == content[:cut] and held_out.data.tobytes() == content[cut:]
    for step in range(20):
        for row in _rows(train.batch_at(step)):
            assert 0 <= content.find(row) and content.find(row) + len(row) <= cut
        for row in _rows(held_out.batch_at(step)):
            assert content.find(row) >= cut


@pytest.mark.parametrize("process_count", [1, 2, 4, 8])
def test_processes_partition_the_global_batch(process_count):
    train, _ = data.make_datasets(**KW)
    for step in (0, 5, 300):
        whole = train.batch_at(step)
        parts = [train.batch_at(step, p, process_count) for p in range(process_count)]
        for key in ("tokens", "targets"):
            assert all(part[key].shape == (8 // process_count, 32) for part in parts)
            np.testing.assert_array_equal(np.concatenate([part[key] for part in parts]), whole[key])


def test_process_errors():
    train, _ = data.make_datasets(**KW)
    with pytest.raises(
        ValueError, match="batch_size=8 must be divisible by the number of processes"
    ):
        train.batch_at(0, 0, 3)
    with pytest.raises(ValueError, match="process_index=2"):
        train.batch_at(0, 2, 2)
    with pytest.raises(ValueError, match="step"):
        train.batch_at(-1)


def test_user_files_and_directories(tmp_path):
    first = _random_text(tmp_path, 3000, "a.txt", seed=1)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.txt").write_bytes(b"b" * 100)
    (tmp_path / "docs" / "c.md").write_bytes(b"c" * 100)
    (tmp_path / "docs" / ".hidden").write_bytes(b"h" * 100)
    path = f"{tmp_path / 'a.txt'}, {tmp_path / 'docs'}"
    corpus = data.read_corpus(path).tobytes()
    assert corpus.startswith(first) and len(corpus) == 3200
    assert sorted(corpus[3000:]) == sorted(b"b" * 100 + b"c" * 100)
    assert data.read_corpus(path, max_bytes=3050).tobytes() == corpus[:3050]
    train, held_out = data.make_datasets(
        path=path, max_bytes=0, eval_fraction=0.25, seq_len=16, batch_size=4, seed=0
    )
    assert len(held_out.data) == 800 and train.batch_at(9)["tokens"].shape == (4, 16)


def test_bad_input_says_what_to_change(tmp_path):
    (tmp_path / "small.txt").write_bytes(b"print('hello')\n" * 40)  # 600 bytes
    small = str(tmp_path / "small.txt")
    with pytest.raises(ValueError) as error:
        data.make_datasets(**{**KW, "path": small})
    message = str(error.value)
    for words in ("eval part", "60 bytes", "batch_size=8", "data.max_bytes", "seq_len=32"):
        assert words in message
    with pytest.raises(ValueError, match="train part of the corpus has 540 bytes"):
        data.make_datasets(**{**KW, "path": small, "batch_size": 32, "eval_fraction": 0.1})
    with pytest.raises(ValueError, match="is not a file or directory"):
        data.read_corpus(str(tmp_path / "missing.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        data.read_corpus(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="eval_fraction"):
        data.make_datasets(**{**KW, "eval_fraction": 1.0})
    with pytest.raises(ValueError, match="max_bytes"):
        data.read_corpus("", max_bytes=-1)
