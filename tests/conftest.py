"""Shared test helpers: fixture paths and tiny random models."""

import os
import sys

import pytest
import torch

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
FAMILIES = ["qwen2", "llama3", "llama_linear", "qwen3", "mistral"]


def fixture_path(name: str) -> str:
    """Absolute path of a directory under tests/fixtures."""
    return os.path.join(FIXTURES, name)


def tiny_config(**overrides):
    """A small random-model ModelConfig (Qwen2-shaped unless overridden)."""
    from nanogrpo.model import ModelConfig
    kwargs = dict(model_type="qwen2", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # train.py and sample.py live at the repo root
    sys.path.insert(0, ROOT)
