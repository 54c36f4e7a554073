"""The model families whose layers differ from model.py's Llama-style block, one file each:
Gemma 3 (`models/gemma3.py`: its norms, scaled embedding, sliding-window layers) and Qwen3.5
(`models/qwen3_5.py`: gated attention around Gated DeltaNet layers,
`models/gated_deltanet.py`). Importing this package registers them in `model.FAMILIES` by
config.json's model_type, where `model.family_parts` and `model.KVCache` find them; the
checkpoint loader (nanogrpo/checkpoint/) imports it.

Does not know about: files, tokenization, sampling, losses, or more than one process.
"""

from nanogrpo.model import FAMILIES
from nanogrpo.models import gemma3, qwen3_5

FAMILIES.update(gemma3_text=gemma3, qwen3_5_text=qwen3_5)
