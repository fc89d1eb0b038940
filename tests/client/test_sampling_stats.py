"""The statistics of weighted and mixed draws (issue 39), not only that they repeat.

``batchd.sampler.weighted_draw`` and ``mix_draw`` are what servers serve
(tests/client/test_sampling_served.py checks the served draws against docs/sampling.md's
formulas). Here: over 200,000 draws each sample's frequency follows its weight (chi-square, and
the same test fails when two weights are swapped); without replacement the draw follows
``torch.multinomial``'s; a mix's proportions are within 4 standard deviations and each source
is read pass after pass without repeats; bad arguments raise ValueError naming them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

import batchd
from batchd.sampler import mix_draw, weighted_draw

DRAWS = 200_000
P_MIN = 1e-3


def _weights() -> np.ndarray:
    w = np.random.default_rng(0).uniform(0.2, 5.0, 40)
    w[[3, 17]] = 0.0  # zero weights: never drawn
    w[5], w[30] = 0.5, 4.5  # two weights far apart (swapped below)
    return w


def test_with_replacement_each_samples_frequency_follows_its_weight():
    w = _weights()
    draw = weighted_draw(w, DRAWS, replacement=True, seed=7, epoch=0)
    assert draw.dtype == np.int64 and draw.shape == (DRAWS,)
    counts = np.bincount(draw, minlength=len(w))
    assert counts[w == 0].sum() == 0, "a sample of weight 0 was drawn"
    live = w > 0
    expected = DRAWS * w[live] / w.sum()
    assert stats.chisquare(counts[live], expected).pvalue > P_MIN
    # the same test sees two weights swapped: it would fail a sampler that mixed them up
    swapped = w.copy()
    swapped[[5, 30]] = swapped[[30, 5]]
    assert stats.chisquare(counts[live], DRAWS * swapped[live] / swapped.sum()).pvalue < 1e-12
    # ... and a sampler that ignored the weights altogether
    assert stats.chisquare(counts[live], np.full(live.sum(), DRAWS / live.sum())).pvalue < 1e-12


def test_a_draw_is_a_pure_function_of_seed_and_epoch():
    w = _weights()
    a = weighted_draw(w, 1000, replacement=True, seed=3, epoch=1)
    assert np.array_equal(a, weighted_draw(w.copy(), 1000, replacement=True, seed=3, epoch=1))
    assert not np.array_equal(a, weighted_draw(w, 1000, replacement=True, seed=3, epoch=2))
    assert not np.array_equal(a, weighted_draw(w, 1000, replacement=True, seed=4, epoch=1))
    b = weighted_draw(w, 30, replacement=False, seed=3, epoch=1)
    assert np.array_equal(b, weighted_draw(w, 30, replacement=False, seed=3, epoch=1))


def test_without_replacement_no_sample_twice_and_the_draw_follows_torch_multinomial():
    """Inclusion counts of 5 draws without replacement out of 12 weighted samples, over 20,000
    epochs, against torch.multinomial(replacement=False) (torch's WeightedRandomSampler) over as
    many: the same distribution (chi-square test of homogeneity); the first draw follows w/sum(w)."""
    w = np.array([0.1, 0.5, 1.0, 2.0, 4.0, 0.0, 1.0, 3.0, 0.3, 6.0, 2.5, 0.8])
    epochs, k = 20_000, 5
    ours, first = np.zeros(len(w), np.int64), np.zeros(len(w), np.int64)
    for e in range(epochs):
        d = weighted_draw(w, k, replacement=False, seed=11, epoch=e)
        assert len(set(d.tolist())) == k and w[d].min() > 0
        ours[d] += 1
        first[d[0]] += 1
    g = torch.Generator().manual_seed(0)
    theirs = np.bincount(torch.multinomial(torch.tensor(w).expand(epochs, -1), k, replacement=False,
                                           generator=g).flatten().numpy(), minlength=len(w))
    live = w > 0
    assert ours[~live].sum() == 0
    assert stats.chi2_contingency(np.stack([ours[live], theirs[live]])).pvalue > P_MIN
    assert stats.chisquare(first[live], epochs * w[live] / w.sum()).pvalue > P_MIN
    # the test can tell: weights swapped give other inclusion counts
    w2 = w.copy()
    w2[[0, 9]] = w2[[9, 0]]
    swapped = np.bincount(torch.multinomial(torch.tensor(w2).expand(epochs, -1), k, replacement=False,
                                            generator=g).flatten().numpy(), minlength=len(w))
    assert stats.chi2_contingency(np.stack([ours[live], swapped[live]])).pvalue < 1e-12


def test_without_replacement_all_nonzero_samples_once():
    w = _weights()
    n = int((w > 0).sum())
    d = weighted_draw(w, n, replacement=False, seed=0, epoch=0)
    assert sorted(d.tolist()) == sorted(np.flatnonzero(w > 0).tolist())


def test_mix_proportions_within_four_standard_deviations_and_sources_read_in_passes():
    sizes, m = [1000, 50, 7, 300], [0.5, 0.3, 0.2, 0.0]
    source, index = mix_draw(sizes, m, DRAWS, seed=5, epoch=2)
    counts = np.bincount(source, minlength=len(sizes))
    p = np.array(m) / sum(m)
    sd = np.sqrt(DRAWS * p * (1 - p))
    assert counts[3] == 0, "a source of weight 0 was drawn"
    assert np.all(np.abs(counts - DRAWS * p) <= 4 * sd), (counts, DRAWS * p, sd)
    for k, n in enumerate(sizes):
        taken = index[source == k]
        assert ((0 <= taken) & (taken < n)).all()
        for start in range(0, len(taken), n):  # each pass over source k: no sample twice, all of it
            chunk = taken[start : start + n]
            assert len(np.unique(chunk)) == len(chunk), f"source {k}: a sample twice within one pass"
            if len(chunk) == n:
                assert np.array_equal(np.sort(chunk), np.arange(n))
    # proportions the test can tell apart: swapped weights are far outside 4 sd
    swapped = np.array([0.3, 0.5, 0.2, 0.0])
    assert np.any(np.abs(counts - DRAWS * swapped) > 4 * sd)


def test_mix_draw_is_pure_and_per_epoch():
    a = mix_draw([10, 20], [1, 1], 100, seed=1, epoch=0)
    b = mix_draw([10, 20], [1, 1], 100, seed=1, epoch=0)
    c = mix_draw([10, 20], [1, 1], 100, seed=1, epoch=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])


@pytest.mark.parametrize("make, match", [
    (lambda: batchd.WeightedRandomSampler([1.0, -2.0], 3), r"weights\[1\] is -2.0"),
    (lambda: batchd.WeightedRandomSampler([1.0, float("nan")], 3), r"weights\[1\] is nan"),
    (lambda: batchd.WeightedRandomSampler([1.0, float("inf")], 3), r"weights\[1\] is inf"),
    (lambda: batchd.WeightedRandomSampler([0.0, 0.0], 3), "all zero"),
    (lambda: batchd.WeightedRandomSampler([], 3), "empty"),
    (lambda: batchd.WeightedRandomSampler([[1.0, 2.0]], 3), "one-dimensional"),
    (lambda: batchd.WeightedRandomSampler([1.0, 2.0], 0), "num_samples must be a positive integer, got 0"),
    (lambda: batchd.WeightedRandomSampler([1.0, 2.0], 2.5), "num_samples must be a positive integer, got 2.5"),
    (lambda: batchd.WeightedRandomSampler([1.0, 0.0, 2.0], 3, replacement=False), "num_samples=3 without replacement"),
    (lambda: batchd.WeightedRandomSampler("mine", 3), "'mine'"),
    (lambda: batchd.Mix({}, num_samples=3), "non-empty mapping"),
    (lambda: batchd.Mix({"a": 0.0, "b": 0}, num_samples=3), "sum to zero"),
    (lambda: batchd.Mix({"a": -1.0}, num_samples=3), "source 'a' has weight -1.0"),
    (lambda: batchd.Mix({"a": float("nan")}, num_samples=3), "source 'a' has weight nan"),
    (lambda: batchd.Mix({"": 1.0}, num_samples=3), "dataset name"),
    (lambda: batchd.Mix({"a": 1.0}, num_samples=0), "num_samples must be a positive integer, got 0"),
])
def test_bad_arguments_raise_value_errors_naming_them(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_the_sampler_takes_torchs_arguments():
    w = torch.tensor([1.0, 0.0, 3.0])
    s = batchd.WeightedRandomSampler(w, num_samples=5)
    t = torch.utils.data.WeightedRandomSampler(w, num_samples=5)
    assert (len(s), s.replacement) == (len(t), t.replacement) and s.weights.dtype == np.float64
    assert s.nonzero == 2 and len(s.digest) == 64
