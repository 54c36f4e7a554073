"""The model families whose layers differ from model.py's Llama-style block, one file each:
Gemma 3 (`models/gemma3.py`: its norms, scaled embedding, sliding-window layers) and Qwen3.5
(`models/qwen3_5.py`: gated attention around Gated DeltaNet layers,
`models/gated_deltanet.py`). model.py finds a family's parts by its config's model_type
(`model.family_parts`).

Does not know about: files, tokenization, sampling, losses, or more than one process.
"""
