"""Counter-based random numbers for sampling: pure functions of (key, step).

Owns: `row_keys` (one random stream per (prompt, sample)) and `uniforms`
(the stream's number at one decode step).

Why not torch's generator: row (prompt i, sample j) has the key
hash(seed_i, j); at step t it draws u = hash(key, t). A row's samples then
depend only on its prompt, the model and (seed_i, j): not on its batch
mates, on which rows have already stopped, or on the device, so batched
generation equals each prompt alone (up to float rounding of the logits),
and a CPU run and a GPU run draw the same numbers.
"""

import torch


_M32 = 0xFFFFFFFF


def _mix(x):
    """A bijective 32-bit integer hash, on python ints or int64 tensors holding 32-bit values."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def row_keys(seeds, num_samples):
    """seeds [P] int64 -> keys [P*G] int64: one random stream per (prompt, sample)."""
    sample = torch.arange(num_samples, device=seeds.device).repeat(len(seeds))  # [P*G]
    seed = seeds.repeat_interleave(num_samples) & _M32  # [P*G]
    return _mix((_mix(seed ^ 0x9E3779B9) + sample) & _M32)


def uniforms(keys, step):
    """keys [n] int64, step int -> [n] float64 in [0,1) (52 random bits),
    the same on every device."""
    h = _mix(keys ^ _mix(step ^ 0x3C6EF372))
    hi = _mix(h ^ 0x68E31DA4) >> 6  # 26 bits
    lo = _mix(h ^ 0x1B56C4E9) >> 6  # 26 more
    return (hi * 2**26 + lo).double() / 2**52
