"""nanogrpo: GRPO post-training in plain PyTorch. README.md shows the commands and the module map;
train.py is the algorithm, top to bottom, and the top-level modules are the course it reads.

Does not know about: torch, the model or processes: importing nanogrpo loads no submodule.
"""
