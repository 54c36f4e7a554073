"""nanogrpo: GRPO post-training in plain PyTorch. README.md shows the commands and the module map;
train.py is the algorithm, top to bottom, and the top-level modules are the course it reads.

Does not know about: torch, the model or processes: importing nanogrpo loads no submodule (TRL's
Python API, GRPOConfig and GRPOTrainer, loads nanogrpo/api/ when a script first names it).
"""


def __getattr__(name: str):
    if name not in ("GRPOConfig", "GRPOTrainer"):
        raise AttributeError(f"module 'nanogrpo' has no attribute {name!r}")
    from nanogrpo import api

    return getattr(api, name)
