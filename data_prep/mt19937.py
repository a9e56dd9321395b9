"""CPython's `random.Random` draws, compiled: the same Mersenne Twister words, the same methods.

The reference create_pretraining_data.py takes every decision from one `random.Random(12345)`.
Reproducing its output means reproducing the exact sequence of 32-bit words that generator
yields and the exact way CPython turns words into values:
- `random()`: two words a, b -> ((a >> 5) * 2**26 + (b >> 6)) / 2**53;
- `getrandbits(k)`, k <= 32: one word, its top k bits;
- `_randbelow(n)`: getrandbits(n.bit_length()) until the value is < n (also for n = 1,
  which still spends at least one word);
- `randint(a, b)`: a + _randbelow(b - a + 1);
- `shuffle(x)`: for i from len(x) - 1 down to 1, swap x[i] with x[_randbelow(i + 1)].

The state travels as two arrays: `words` [1248] uint32, the 624-word state of CPython's
`getstate()` followed by those words tempered (the next outputs, computed together after
each twist, which lets the compiler vectorise the tempering), and `position` [1] int64,
the read position. Seeding stays CPython's own (`random.Random(seed).getstate()`), and the
state can be handed back to a `random.Random` with `setstate`. The functions here are numba
`njit` code, meant to be called from other compiled functions.
"""

from __future__ import annotations

import random

import numba
import numpy as np

N, M = 624, 397
_MATRIX_A = np.uint32(0x9908B0DF)
_UPPER, _LOWER = np.uint32(0x80000000), np.uint32(0x7FFFFFFF)


def twister_from(rng: random.Random) -> tuple[np.ndarray, np.ndarray]:
    """(words [1248] uint32, position [1] int64) of a `random.Random`'s current state."""
    version, internal, _ = rng.getstate()
    if version != 3 or len(internal) != N + 1:
        raise ValueError(f"unexpected random.Random state (version {version}); CPython's MT19937 is expected")
    words = np.zeros(2 * N, dtype=np.uint32)
    words[:N] = internal[:N]
    _temper_all(words)
    return words, np.array([internal[N]], dtype=np.int64)


def to_random(words: np.ndarray, position: np.ndarray) -> random.Random:
    """A `random.Random` that continues exactly where the compiled draws stopped."""
    rng = random.Random()
    rng.setstate((3, tuple(int(w) for w in words[:N]) + (int(position[0]),), None))
    return rng


@numba.njit(cache=True, nogil=True)
def _twist_one(words: np.ndarray, i: int, j: int, k: int) -> None:
    y = (words[i] & _UPPER) | (words[j] & _LOWER)
    value = words[k] ^ (y >> np.uint32(1))
    if y & np.uint32(1):
        value ^= _MATRIX_A
    words[i] = value


@numba.njit(cache=True, nogil=True)
def _twist(words: np.ndarray) -> None:
    # In place, in index order, as CPython's genrand_uint32: entries past i + M read updated values.
    for i in range(N - M):
        _twist_one(words, i, i + 1, i + M)
    for i in range(N - M, N - 1):
        _twist_one(words, i, i + 1, i + M - N)
    _twist_one(words, N - 1, 0, M - 1)


@numba.njit(cache=True, nogil=True)
def _temper_all(words: np.ndarray) -> None:
    for i in range(N):
        y = words[i]
        y ^= y >> np.uint32(11)
        y ^= (y << np.uint32(7)) & np.uint32(0x9D2C5680)
        y ^= (y << np.uint32(15)) & np.uint32(0xEFC60000)
        y ^= y >> np.uint32(18)
        words[N + i] = y


@numba.njit(cache=True, nogil=True, inline="always")
def next_word(words: np.ndarray, position: np.ndarray) -> np.uint32:
    """The next tempered 32-bit output (CPython's genrand_uint32)."""
    if position[0] >= N:
        _twist(words)
        _temper_all(words)
        position[0] = 0
    position[0] += 1
    return words[N + position[0] - 1]


@numba.njit(cache=True, nogil=True, inline="always")
def random_float(words: np.ndarray, position: np.ndarray) -> float:
    """`random.random()`: 53 bits from two words."""
    a = np.int64(next_word(words, position) >> np.uint32(5))
    b = np.int64(next_word(words, position) >> np.uint32(6))
    return (a * 67108864.0 + b) * (1.0 / 9007199254740992.0)


@numba.njit(cache=True, nogil=True)
def _bit_length(n: int) -> int:
    k = 0
    while n:
        n >>= 1
        k += 1
    return k


@numba.njit(cache=True, nogil=True, inline="always")
def randbelow(words: np.ndarray, position: np.ndarray, n: int) -> int:
    """`random._randbelow(n)` for 1 <= n < 2**32: rejection sampling on getrandbits."""
    shift = np.uint32(32 - _bit_length(n))
    r = np.int64(next_word(words, position) >> shift)
    while r >= n:
        r = np.int64(next_word(words, position) >> shift)
    return int(r)


@numba.njit(cache=True, nogil=True, inline="always")
def randint(words: np.ndarray, position: np.ndarray, low: int, high: int) -> int:
    """`random.randint(low, high)`, both ends included."""
    return low + randbelow(words, position, high - low + 1)


@numba.njit(cache=True, nogil=True)
def shuffle(words: np.ndarray, position: np.ndarray, values: np.ndarray) -> None:
    """`random.shuffle(values)`, in place.

    Most of the reference's draws are these shuffles, so the words are read here directly,
    with the position in a local variable (a call to next_word per draw costs ~9x more).
    """
    bits = _bit_length(values.shape[0])
    at = position[0]
    for i in range(values.shape[0] - 1, 0, -1):
        if (i + 1) >> (bits - 1) == 0:  # _randbelow(i + 1) draws (i + 1).bit_length() bits
            bits -= 1
        shift = np.uint32(32 - bits)
        while True:
            if at >= N:
                _twist(words)
                _temper_all(words)
                at = 0
            j = np.int64(words[N + at] >> shift)
            at += 1
            if j <= i:
                break
        values[i], values[j] = values[j], values[i]
    position[0] = at
