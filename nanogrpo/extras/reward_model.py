"""Reward models: a *ForSequenceClassification checkpoint as a reward function.

Owns: loading a sequence classifier (our decoder with its 1-label
`score` head) as a reward function with TRL's signature (`reward_model`),
turning prompt + completion into the texts TRL scores, and pooling the
score where transformers pools it (`pooled_scores`).

Does not know about: other reward functions, advantages, or other
processes: under FSDP2 each rank holds a full replica of every reward
model and scores its own rows.

Choices: texts, tokenization, padding and pooling as TRL's
`_calculate_rewards` with transformers' *ForSequenceClassification.
"""

import os

import torch

from nanogrpo.checkpoint import load_model, read_json, resolve_path
from nanogrpo.checkpoint.hf_format import config_from_hf
from nanogrpo.tokenizer import Tokenizer


def reward_model(
    path: str, tokenizer: str | None = None, device="cpu", dtype=torch.float32, batch_size: int = 32
):
    """(name, fn): a sequence classifier (our decoder + a 1-label `score` head) on `device` in
    `dtype` as a reward function with TRL's signature, named by `path`'s last component. Texts
    as TRL's `_calculate_rewards` makes them: prompt + completion, or the reward tokenizer's
    chat template over prompt + completion messages (no generation prompt). Tokenizer: the
    model's own or `tokenizer`; with no pad token it pads with eos (TRL).
    """
    local = resolve_path(path)
    hf = (
        read_json(os.path.join(local, "config.json"))
        if os.path.exists(os.path.join(local, "config.json"))
        else {}
    )
    arch = (hf.get("architectures") or [None])[0]
    labels = (
        config_from_hf(hf).num_labels if str(arch).endswith("ForSequenceClassification") else None
    )
    if labels != 1:
        raise ValueError(
            f"reward model {path!r}: config.json names {arch} with num_labels={labels}; a reward "
            "model is a *ForSequenceClassification with 1 label (TRL loads it with num_labels=1)"
        )
    model, tok = (
        load_model(local, dtype=dtype, device=device).eval(),
        Tokenizer.from_pretrained(tokenizer or local),
    )
    if tok.pad_token_id is None:
        raise ValueError(
            f"reward model {path!r}: its tokenizer has neither a pad nor an eos token to pad with"
        )

    def fn(prompts, completions, **columns) -> list[float]:
        chat = bool(completions) and not isinstance(prompts[0], str)
        return score_texts(
            model,
            tok,
            [
                tok.apply_chat_template(p + c, add_generation_prompt=False) if chat else p + c
                for p, c in zip(prompts, completions)
            ],
            batch_size,
        )

    fn.__name__ = os.path.basename(str(path).rstrip("/"))
    return fn.__name__, fn


@torch.no_grad()
def score_texts(model, tok, texts: list[str], batch_size: int = 32) -> list[float]:
    """Label 0's score of each text: tokenized without special tokens, right-padded with
    tok.pad_token_id, pooled by pooled_scores (as transformers pools), in micro-batches of
    similar lengths."""
    rows = [e.ids for e in tok.tokenizer.encode_batch(texts, add_special_tokens=False)]
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    scores, device = torch.zeros(len(rows)), model.embed_tokens.weight.device
    for start in range(0, len(rows), batch_size):
        chunk = [rows[i] for i in order[start : start + batch_size]]
        T = max(1, max(map(len, chunk)))
        # [b,T]
        ids = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in chunk], device=device)
        real = (
            torch.arange(T, device=device)
            < torch.tensor([len(r) for r in chunk], device=device)[:, None]
        )
        scores[order[start : start + batch_size]] = (
            pooled_scores(model, ids, real, tok.pad_token_id)[:, 0].cpu().float()
        )
    return scores.tolist()


def pooled_scores(model, input_ids, attention_mask, pad_id: int) -> torch.Tensor:
    """A classifier's label scores [B,num_labels] where *ForSequenceClassification pools them: at
    each row's rightmost token whose id is not pad_id (position 0 if every id is), so with pad =
    eos a trailing eos is skipped. Only that position goes through the `score` head."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    last = (positions * (input_ids != pad_id)).argmax(-1)  # [B]
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    return model(input_ids, attention_mask, head=lambda h, score: score(h[rows, last]))
