"""Decoding that reads each prompt's keys once per group, not once per sample.

Owns: `SharedPrefixDecoder` (sampler.Decoder's methods: its decode cache keeps the P prompts'
prefill as it is instead of copying it into the G rows of each prompt) and `SharedPrefixCache`
(that cache, and the one-token attention over it: its `attend`, which model.Attention calls as
it calls every cache's).

Does not know about: rewards, losses, files, or more than one process.

Why: a GRPO round samples G completions of each prompt, so the eager decoder's cache holds every
prompt G times and each decode step reads all of it: with 128-token prompts, 8 samples and 64 new
tokens, ~75% of what attention reads is a copy. Here a step's attention reads the prompt's keys
and values once for its G rows (one batched matmul per prompt), then each row's own generated
keys; both parts' scores go through one softmax, so the result is attention over the row's whole
sequence, the plain decoder's (tests/test_sampler.py holds the two equal, compaction included).

Choices:
- Rows stay in prompt order (compaction keeps the order); a group has at most G live rows, so the
  prompt part is laid out [P, G] with dead slots zero, without reading a row count on the host.
- The mask the model passes in says what each row sees, prompt slots first: Gemma 3's sliding
  windows need nothing more. A Qwen3.5 linear-attention layer keeps a state per row, not keys: its
  entries are copied to the rows as sampler.Decoder copies everything. G = 1 decodes as
  sampler.Decoder does.
"""

import torch

from nanogrpo.sampler import Decoder


class SharedPrefixCache:
    """The P prompts' keys/values per layer [P,Hkv,L,D] (the prefill's, read only), each row's
    prompt `src` [n] and its slot among its prompt's rows `pos` [n], and the rows' own
    keys/values [n,Hkv,C,D]. `select(rows)` keeps (or drops) rows, as KVCache's does."""

    static = False  # written at an int slot (model.KVCache.static)

    def __init__(self, prefill, src, G, C, L):
        self.prompt_k = [k[:, :, :L] for k in prefill.k]  # (the prefill's first L slots)
        self.prompt_v = [v[:, :, :L] for v in prefill.v]
        self.P, self.L, self.G, self.src = len(src) // G, L, G, src
        self.pos = torch.arange(len(src), device=src.device) % G  # (rows start prompt-major)
        self.k, self.v = [], []
        for k, v, linear in zip(prefill.k, prefill.v, prefill.linear):
            if linear:  # a recurrent layer's state: each row its own copy
                self.k.append(k.index_select(0, src))
                self.v.append(v.index_select(0, src))
            else:  # the rows' own slots
                self.k.append(k.new_zeros(len(src), k.shape[1], C, k.shape[3]))
                self.v.append(v.new_zeros(len(src), v.shape[1], C, v.shape[3]))
        self.max_len = L + C
        self.linear = prefill.linear

    def select(self, rows):
        new = object.__new__(SharedPrefixCache)
        new.__dict__.update(self.__dict__)
        new.src, new.pos = self.src[rows], self.pos[rows]
        new.k = [k.index_select(0, rows) for k in self.k]
        new.v = [v.index_select(0, rows) for v in self.v]
        return new

    def attend(self, q, k, v, mask, scale, layer, slot):
        """One decode step's attention (model.KVCache.attend's). q [n,H,1,D]; k, v [n,Hkv,1,D]
        (written at the row's own slot - L); mask [n,1,1,slot+1] additive or bool (the prompt's
        padding, then the row's tokens); scale None: 1/sqrt(D). -> [n,1,H*D]."""
        n, H, _, D = q.shape
        t = slot - self.L  # this token's own slot
        self.k[layer][:, :, t] = k[:, :, 0]
        self.v[layer][:, :, t] = v[:, :, 0]
        own_k, own_v = self.k[layer][:, :, : t + 1], self.v[layer][:, :, : t + 1]
        Hkv = own_k.shape[1]
        q = q.reshape(n, Hkv, H // Hkv, D)  # each kv head's query heads
        if mask.dtype == torch.bool:
            mask = torch.where(mask, 0.0, -torch.inf).to(q.dtype)
        mask = mask[:, 0]  # [n,1,S]
        scale = scale if scale is not None else D**-0.5
        # the prompt part: a group's rows as one matmul against their prompt's keys
        grouped = q.new_zeros(self.P, self.G, Hkv, H // Hkv, D)
        grouped[self.src, self.pos] = q
        grouped = grouped.transpose(1, 2).reshape(self.P, Hkv, -1, D)  # [P,Hkv,G*H/Hkv,D]
        prompt_scores = grouped @ self.prompt_k[layer].transpose(-1, -2)  # [P,Hkv,G*r,L]
        prompt_scores = prompt_scores.view(self.P, Hkv, self.G, -1, self.L)
        prompt_scores = prompt_scores[self.src, :, self.pos]  # [n,Hkv,r,L]
        own_scores = q @ own_k.transpose(-1, -2)  # [n,Hkv,r,t+1]
        scores = torch.cat([prompt_scores, own_scores], dim=-1) * scale + mask[:, None]
        wide = torch.promote_types(q.dtype, torch.float32)
        probs = torch.softmax(scores.to(wide), dim=-1).to(q.dtype)  # [n,Hkv,r,L+t+1]
        spread = q.new_zeros(self.P, self.G, Hkv, H // Hkv, self.L)
        spread[self.src, self.pos] = probs[..., : self.L]
        spread = spread.transpose(1, 2).reshape(self.P, Hkv, -1, self.L)
        from_prompt = (spread @ self.prompt_v[layer]).view(self.P, Hkv, self.G, -1, D)
        y = from_prompt[self.src, :, self.pos] + probs[..., self.L :] @ own_v  # [n,Hkv,r,D]
        return y.reshape(n, 1, H * D)


class SharedPrefixDecoder(Decoder):
    """sampler.Decoder whose decode cache is a SharedPrefixCache; finished rows are compacted
    away as there."""

    def decode_cache(self, prefill, src, L, C):
        G = len(src) // prefill.k[0].shape[0]
        if G == 1:  # nothing shared: the plain decoder's cache
            return super().decode_cache(prefill, src, L, C)
        return SharedPrefixCache(prefill, src, G, C, L), L + C
