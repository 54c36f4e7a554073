"""nanogrpo: GRPO post-training in plain PyTorch. README.md shows the commands and the module map;
train.py is the algorithm, top to bottom."""
