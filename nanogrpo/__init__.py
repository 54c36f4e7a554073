"""nanogrpo: GRPO post-training in plain PyTorch (see README.md and DESIGN in the docs)."""
