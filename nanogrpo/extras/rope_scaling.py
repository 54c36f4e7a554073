"""RoPE scaling for contexts longer than a model was trained on: `linear` (positions divided by
`factor`) and Llama 3.1's `llama3` (high frequencies kept, low ones divided by `factor`, a smooth
blend between), as config.json's rope_scaling / rope_parameters name them.

Owns: `scale_inv_freq` (what model.rope_inv_freq applies when a config has rope_scaling) and
`check` (the rope types it knows).

Does not know about: files (checkpoint/hf_format.py reads the keys), sampling, losses, or more
than one process.
"""

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def check(scaling: dict | None):
    """ValueError unless `scaling` is None or of a rope type scale_inv_freq knows."""
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope_scaling.rope_type={rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )


def scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """inv_freq [D/2] under `scaling` ({"rope_type": ..., "factor": ..., ...})."""
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        return inv_freq
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, smoothed, scaled)
