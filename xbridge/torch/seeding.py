"""The program's seed, given to every random generator a program can reach, so that one command run twice gives one
run. torch seeds its default generator from the operating system at start (torch 2.9: ``torch.initial_seed()``
differs from process to process), so nothing is left to it:

- building the model (:func:`seeded`): torch's CPU generator, numpy's global generator and Python's ``random``,
  each seeded from the program's seed inside and put back after (a builder that draws from numpy or ``random``
  builds the same weights in every run and in every process);
- the training stream (:func:`training_seed`): the draws of ``--rng native`` (dropout and friends) on the torch
  stacks start from torch's generator seeded with it when the train step is built, and jax's (torchax's key) from
  it too; a stream of its own, not the builder's; numpy's and Python's global generators seeded from it before
  step 0 (:func:`seed_host`), so that a program drawing from them (a data source's augmentation, a forward xbridge
  check says "differs" for: docs/programs.md) gives one run twice on one stack.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch


def training_seed(seed: int) -> int:
    """The seed of the training forward's native random stream: the program's, moved off the builder's stream."""
    return (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % (1 << 63)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """torch's CPU generator, numpy's global generator and ``random`` seeded with ``seed`` inside; the three states
    as they were after."""
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            np.random.seed(seed % (1 << 32))
            random.seed(seed)
            yield
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)


def seed_host(seed: int) -> None:
    """numpy's global generator and Python's ``random`` seeded from the training stream's seed (before step 0)."""
    stream = training_seed(seed)
    np.random.seed(stream % (1 << 32))
    random.seed(stream)
