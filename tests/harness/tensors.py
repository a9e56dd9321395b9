"""Tensors compared as the tests need: bitwise (nested state dicts), or within the roundings that two
orders of the same arithmetic may differ by."""

from __future__ import annotations

import torch

# fp32's eps, and how many of its roundings of the longest path two orders of the same sums may move a weight
# apart (test_sharded_optimizer.py's docstring says why).
EPS = 2.0**-24
ROUNDINGS = 32


def assert_within_rounding(actual: torch.Tensor, expected: torch.Tensor, path: torch.Tensor, steps: int) -> None:
    """|actual - expected| <= ROUNDINGS * eps * (the longest path) + steps * ulp(expected) where the
    weight moved, 0 where it did not, element by element."""
    ulp = torch.nextafter(expected.abs(), torch.tensor(float("inf"))) - expected.abs()
    allowed = torch.where(path > 0, ROUNDINGS * EPS * path.max() + steps * ulp, 0.0)
    excess = (actual - expected).abs() - allowed
    worst = int(excess.argmax())
    assert excess.max() <= 0, (f"weight {worst} differs by {float((actual - expected).abs()[worst]):.3g}, "
                               f"allowed {float(allowed[worst]):.3g}")


def assert_same_tensors(a: object, b: object, where: str = "") -> None:
    """Bitwise equality of two nested state dicts (dicts, lists, tensors, plain values)."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_tensors(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, where
