"""Validation of what a caller hands the packer, and the grouping of lengths by cost.

Every length must be an int64 integer ``>= 1`` whose cost fits the capacity;
anything else is an error naming the index and the value (never a wrapped
negative number, never a silent cast). :func:`_size_histogram` turns lengths
into their distinct costs without an array over the capacity.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from .._base import positive_int, round_up

_INT64_MIN, _INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)

#: The largest capacity (in tokens) the packers accept: sizes, their ranks and
#: per-row counts then fit int32, and every sum over a row fits int64. Nothing is
#: allocated per token of capacity, so the largest costs what the smallest does.
MAX_CAPACITY = 2**31 - 1

#: Up to this many units per row (or a quarter of the item count, if larger)
#: items are grouped by size with arrays indexed by units (a counting sort);
#: above it, by a radix sort (packing) or ``np.unique`` (bounds). Same result.
_DENSE_UNITS = 1 << 16


def _dense_route(cap_units: int, n: int) -> bool:
    """Arrays over ``0..U`` cost at most 64 bytes per unit: use them while that is
    at most 4 MiB or 16 bytes per item."""
    return cap_units <= max(_DENSE_UNITS, n // 4)


def _item(arr: np.ndarray, i: int) -> Any:
    v = arr[i]
    return v.item() if isinstance(v, np.generic) else v


def _first_bad(name: str, arr: np.ndarray, source: Any) -> Exception | None:
    """The error for the first element of ``arr`` that is not an int64 integer, or None.

    Reads the caller's own element where numpy converted it (a Python int
    beyond int64 in a list becomes a float or an object), so the message
    shows the value as given.
    """
    items = source if isinstance(source, (list, tuple)) and len(source) == arr.shape[0] else None
    for i in range(arr.shape[0]):
        v = items[i] if items is not None else _item(arr, i)
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
            return TypeError(
                f"{name} must be integers, got dtype {arr.dtype}: {name}[{i}] = {v!r} is not an integer; "
                f"cast whole numbers with .astype(np.int64) and drop or fix the rest"
            )
        if not _INT64_MIN <= int(v) <= _INT64_MAX:
            return _beyond_int64(name, i, int(v))
    return None


def _beyond_int64(name: str, i: int, v: int) -> ValueError:
    return ValueError(
        f"{name}[{i}] = {v} does not fit in int64 (at most {_INT64_MAX}): no row holds it; drop or fix it"
    )


def _as_lengths(lengths: ArrayLike, name: str = "lengths") -> np.ndarray:
    """Any 1-D integer sequence (list, numpy, torch) as a contiguous int64 array.

    Floats, strings, bools and other objects are a ``TypeError`` naming the
    first bad element; integers beyond int64 (a Python int, or a uint64 above
    ``2**63 - 1``) a ``ValueError`` naming it, never a wrapped negative number.
    """
    if hasattr(lengths, "detach") and hasattr(lengths, "cpu"):  # a torch tensor, without importing torch
        lengths = lengths.detach().cpu().numpy()
    try:
        arr = np.asarray(lengths)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{name} must be a 1-D sequence of integers: {err}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.shape[0] == 0:
        return np.zeros(0, np.int64)
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8:
        big = np.flatnonzero(arr > np.uint64(_INT64_MAX))
        if big.size:
            raise _beyond_int64(name, int(big[0]), int(arr[big[0]]))
    if arr.dtype.kind in "iu":
        return np.ascontiguousarray(arr, dtype=np.int64)
    bad = _first_bad(name, arr, lengths)
    if bad is not None:
        raise bad
    return np.array(arr.tolist(), dtype=np.int64)  # objects that are all int64 integers


def _non_negative_int(name: str, value: object) -> int:
    """``value`` as a Python ``int >= 0`` (numpy integers too; bools, floats and strings refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def _capacity(capacity: object) -> int:
    capacity = positive_int("capacity", capacity)
    if capacity > MAX_CAPACITY:
        raise ValueError(
            f"capacity must be at most 2**31 - 1 = {MAX_CAPACITY} tokens, got {capacity}: no row holds more"
        )
    return capacity


def _too_long(i: int, length: int, capacity: int, cost_multiple: int) -> ValueError:
    if length < 1:
        where = f"lengths[{i}]" if i >= 0 else "a length"
        return ValueError(
            f"{where} = {length}: every sequence needs at least 1 token; drop empty sequences before packing"
        )
    cost = round_up(length, cost_multiple)
    where = f"lengths[{i}] = {length}" if i >= 0 else f"length {length}"
    if cost_multiple == 1:
        what = f"{where} is longer than the capacity {capacity}"
    else:
        what = (
            f"{where} costs {cost} tokens once rounded up to a multiple of "
            f"cost_multiple={cost_multiple}, more than the capacity {capacity}"
        )
    return ValueError(
        f"{what}: truncate or drop over-long sequences when tokenizing, or raise the capacity to at least {cost}"
    )


def _check_fits(values: np.ndarray, capacity: int, cost_multiple: int, *, indexed: bool = True) -> None:
    """Raise :func:`_too_long` for the first length below 1 or costing more than ``capacity``."""
    if values.shape[0] == 0:
        return
    limit = capacity // cost_multiple * cost_multiple  # the longest length whose cost fits
    if values.min() < 1 or values.max() > limit:
        i = int(np.flatnonzero((values < 1) | (values > limit))[0])
        raise _too_long(i if indexed else -1, int(values[i]), capacity, cost_multiple)


def _units(values: np.ndarray, cost_multiple: int) -> np.ndarray:
    """``ceil(values / cost_multiple)`` (values >= 1)."""
    return values if cost_multiple == 1 else (values + (cost_multiple - 1)) // cost_multiple


def _size_histogram(
    values: np.ndarray, counts: np.ndarray | None, capacity: int, cost_multiple: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(sizes, counts)``: the distinct unit sizes ascending and how many items have each, validated.

    A ``bincount`` when units are few (see :func:`_dense_route`), else a sort:
    never an array over the capacity.
    """
    if counts is not None:
        used = counts > 0
        values, counts = values[used], counts[used]
    _check_fits(values, capacity, cost_multiple, indexed=counts is None)
    if values.shape[0] == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    units = _units(values, cost_multiple)
    if counts is None and _dense_route(capacity // cost_multiple, values.shape[0]):
        hist = np.bincount(units)
        sizes = np.flatnonzero(hist).astype(np.int64)
        return sizes, hist[sizes].astype(np.int64)
    if counts is None:
        sizes, per = np.unique(units, return_counts=True)
        return sizes.astype(np.int64), per.astype(np.int64)
    sizes, inverse = np.unique(units, return_inverse=True)
    per = np.zeros(sizes.shape[0], np.int64)
    np.add.at(per, inverse, counts)  # lengths of one cost class pool their counts
    return sizes.astype(np.int64), per


def _as_counts(counts: ArrayLike, values: np.ndarray) -> np.ndarray:
    arr = _as_lengths(counts, "counts")
    if arr.shape != values.shape:
        raise ValueError(f"counts has shape {arr.shape} but the lengths have shape {values.shape}")
    if arr.shape[0] and arr.min() < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"counts must be >= 0, got counts[{i}] = {int(arr[i])}")
    return arr
