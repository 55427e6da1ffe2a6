"""The examples' data source: small labelled images, made on the fly.

A data source is a function of `jpipe.train.sources.DataArgs` that returns
an iterable of batches starting at ``args.start_step``, each batch a dict of
arrays holding this process's ``args.rows`` rows (see jpipe/train/sources.py).
Name it in a config as ``config.data.source = "path/to/images.py:images"``.

The task: an image is ``config.data.image_size`` pixels square, one channel,
Gaussian noise of ``config.data.noise`` with one bright square of a quarter
of the image in one of its four quadrants; the label is the quadrant
(4 classes; chance is ln 4 = 1.386 nats). A batch is a pure function of
``(seed, split, step)``, so a resumed run sees the batches an unbroken one
saw, and each process cuts its own rows out of the global batch.
"""

import itertools

import numpy as np

NUM_CLASSES = 4
_SPLITS = {"train": 0, "eval": 1}


def make_batch(seed: int, split: str, step: int, batch_size: int, size: int = 8, noise=0.5):
    """The global batch of `step`: ``{"images": float32[N, size, size, 1], "labels": int32[N]}``."""
    rng = np.random.default_rng([seed, _SPLITS[split], step])
    labels = rng.integers(0, NUM_CLASSES, batch_size)
    images = rng.normal(0.0, noise, (batch_size, size, size, 1)).astype(np.float32)
    half = size // 2
    for n, label in enumerate(labels):
        row, col = divmod(int(label), 2)
        images[n, row * half : (row + 1) * half, col * half : (col + 1) * half] += 1.0
    return {"images": images, "labels": labels.astype(np.int32)}


def images(args):
    """The data source: this process's rows of every batch from ``args.start_step`` on."""
    size = int(args.config.get("image_size", 8))
    noise = float(args.config.get("noise", 0.5))
    first = args.process_index * args.rows
    for step in itertools.count(args.start_step):
        batch = make_batch(args.seed, args.split, step, args.batch_size, size, noise)
        yield {name: rows[first : first + args.rows] for name, rows in batch.items()}
