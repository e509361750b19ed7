"""The family check's comparison of two servers' stored states: over the rows of the ids both samples share."""

import families
import torch


def sample(ids, hidden=4, scale=1.0):
    g = torch.Generator().manual_seed(len(ids))
    final = torch.randn(len(ids), hidden, generator=g)
    return final * scale, torch.cat([final] * 3, dim=-1) * scale, ids


def test_continuations_that_part_are_compared_on_the_rows_before_they_part():
    a = sample([5, 6, 7, 8])
    b = list(sample([5, 6, 7, 8]))
    b[0] = torch.cat([a[0][:2], -a[0][2:]])  # the continuation parts at its third token
    b[2] = [5, 6, 9, 9]
    got = families.compare({"s0": a}, {"s0": tuple(b)})
    assert got["rows_compared"] == 2 and got["final"]["rows"] == 2 and got["final"]["min_cos"] > 0.999


def test_a_reference_without_ids_is_compared_on_every_row():
    a = sample([5, 6, 7])
    got = families.compare({"s0": a}, {"s0": (a[0] * 2, a[1] * 2)})
    assert got["final"]["rows"] == 3 and got["final"]["max_abs_diff"] > 0
