"""TRL's generation_kwargs, and the sampler's settings beyond the sampling fields.

Owns: `sampling_of` (a TrainConfig's sampler settings, as the
`sampler.Sampling` that generate takes), `generation_settings`
(generation_kwargs -> those settings' fields, with the keys TRL's backends
read that nanogrpo refuses and why), and what `generate` does with three
of them, handed in as Sampling's `processors` (`processors`):
`banned_tokens` (suppress_tokens, and the stop ids before min_new_tokens)
and `StopStrings` (stop_strings, vLLM's `stop`).

Does not know about: models, tokenization (stop strings are matched on
the text of the `decode` callable the caller passes), rewards, losses,
or other processes.

Choices:
- Suppressed tokens are -inf logits, set after the repetition penalty
  and before the draw, as transformers orders its processors.
- A stop string's last token stays in the completion, as transformers'
  stop_strings and vLLM's token ids keep it.
"""

from dataclasses import dataclass

import torch

from nanogrpo.sampler import Sampling, check_sampling, need

# -----------------------------------------------------------------------------
# What limits a row: suppressed tokens, stop strings


@dataclass
class Banned:
    """The tokens a decode step may not sample, as bool [V] masks (None =
    none): `always` (suppress_tokens), and while fewer than
    `min_new_tokens` tokens are out, `early` (suppress_tokens and the stop
    ids). All rows are at the same step: one mask serves the batch."""

    always: torch.Tensor | None
    early: torch.Tensor | None
    min_new_tokens: int

    def at(self, t):
        """The mask of step t (t tokens already sampled), or None."""
        return self.early if t < self.min_new_tokens else self.always


def id_mask(ids, V):
    """Ids [k] -> bool [V], True at each id in [0, V); the others go to a column cut off."""
    ids = torch.where((ids >= 0) & (ids < V), ids, V)
    return torch.zeros(V + 1, dtype=torch.bool, device=ids.device).index_fill_(0, ids, True)[:V]


def banned_tokens(suppress_tokens, stops, min_new_tokens, V, device):
    """-> Banned, or None when nothing is. Ids outside [0, V) are ignored,
    as transformers does."""
    ids = sorted({int(i) for i in suppress_tokens or ()})
    ids = torch.tensor(ids, dtype=torch.long, device=device)  # [k]
    if len(ids) == 0 and min_new_tokens == 0:
        return None
    always = id_mask(ids, V) if len(ids) else None  # [V]
    early = id_mask(torch.cat([ids, stops]), V)  # [V]
    for mask in (always, early if min_new_tokens else None):
        if mask is not None and bool(mask.all()):
            raise ValueError(
                "suppress_tokens (with the stop ids before min_new_tokens) leave no token to sample"
            )
    return Banned(always=always, early=early, min_new_tokens=min_new_tokens)


class StopStrings:
    """Ends a row once its generated text contains a stop string: the
    token that completed it is the row's last, and it stays in the
    completion (as transformers' stop_strings; vLLM's token ids too).

    `check` runs where the decode loop syncs anyway (every
    decoder.sync_every steps: every step with the eager decoder on CPU,
    every 8 otherwise), on the rows still open. It decodes the tail of a row:
    a match that ends in a new token lies within its last `window` tokens
    (a token carries at least one byte of the string; two more tokens of
    left context, as a tokenizer may drop the leading space of the first
    token it decodes). Only a row whose tail matches is decoded again, a
    step at a time, to find the token that completed the string. Only
    generated tokens are read: the prompt's text never completes a stop
    string (vLLM's rule; transformers' StopStringCriteria reads the prompt
    too)."""

    def __init__(self, strings, decode, N, C, device):
        self.strings = list(strings)
        self.decode = decode  # token ids (a list) -> text
        self.window = max(len(s.encode()) for s in self.strings) + 2
        # [N] each row's length where a stop string ended it, else C
        self.ends = torch.full((N,), C, dtype=torch.long, device=device)
        self.closed = set()  # rows whose end is known: never decoded again
        self.checked = 0  # steps already checked

    def found(self, ids):
        text = self.decode(ids)
        return any(s in text for s in self.strings)

    def check(self, out_ids, rows, t):
        """After step t: set `ends` of the rows a stop string ended in
        steps `checked`..t, and mark them stopped in `rows`."""
        lo = max(0, self.checked - self.window)
        index = rows.index.tolist()  # a host sync
        tails = out_ids[rows.index, lo : t + 1].tolist()  # [n][t+1-lo]
        hits = []  # (position in rows, output row, length)
        for k, (r, ids) in enumerate(zip(index, tails)):
            if r in self.closed or not self.found(ids):
                continue
            for end in range(self.checked, t + 1):  # the step that completed it
                if self.found(ids[max(0, end + 1 - self.window - lo) : end + 1 - lo]):
                    hits.append((k, r, end + 1))
                    break
        if hits:
            k, r, length = zip(*hits)
            rows.stopped[list(k)] = True
            self.ends[list(r)] = torch.tensor(length, device=self.ends.device)
        stopped = rows.stopped.tolist()
        self.closed.update(r for r, s in zip(index, stopped) if s)
        self.checked = t + 1


def check_limits(min_new_tokens, stop_strings, decode):
    """ValueError if min_new_tokens or the stop strings cannot run."""
    ok = isinstance(min_new_tokens, int) and min_new_tokens >= 0
    need(ok, "min_new_tokens", min_new_tokens, "must be an int >= 0 (0 means off)")
    ok = all(isinstance(s, str) and s for s in stop_strings or ())
    need(ok, "stop_strings", stop_strings, "must be non-empty strings")
    ok = not stop_strings or callable(decode)
    need(ok, "decode", decode, "stop_strings need decode: token ids -> text")


def processors(suppress_tokens=(), min_new_tokens=0, stop_strings=(), decode=None):
    """Sampling's `processors` for transformers' suppress_tokens (ids never sampled),
    min_new_tokens (no stop id among a row's first min_new_tokens tokens) and stop_strings (a row
    ends with the token that completes one in decode(its generated ids); decode: a list of ids ->
    text), or None when all are off. The first two change the distribution drawn from, and so the
    log-probs. ValueError if they cannot run."""
    stop_strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings or ())
    check_limits(min_new_tokens, stop_strings, decode)
    if not suppress_tokens and not min_new_tokens and not stop_strings:
        return None

    def make(N, C, stops, V, device):  # a call's own: StopStrings keeps state
        banned = banned_tokens(suppress_tokens, stops, min_new_tokens, V, device)
        strings = StopStrings(stop_strings, decode, N, C, device) if stop_strings else None
        return banned, strings

    return make


# -----------------------------------------------------------------------------
# TRL's generation_kwargs

# generation_kwargs keys -> a Sampling field or processors' argument:
# transformers' GenerationConfig names (TRL's transformers backend), and
# vLLM's `stop` for stop_strings (with either backend the token ids TRL
# trains on keep the stop string)
GENERATION_KWARGS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "suppress_tokens": "suppress_tokens",
    "min_new_tokens": "min_new_tokens",
    "stop_strings": "stop_strings",
    "stop": "stop_strings",
    "do_sample": None,  # True only (TRL's own value): nothing to set
    "num_beams": None,  # 1 only (transformers' default): nothing to set
}
SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
# a value of None is the setting off, as in transformers
OFF = dict(
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    repetition_penalty=1.0,
    suppress_tokens=[],
    min_new_tokens=0,
    stop_strings=[],
)
LENGTH = "set max_completion_length (it also bounds the tool rounds and is dr_grpo's constant)"
STOP_IDS = "rows stop at the tokenizer's eos ids; stop_strings ends them on text"
# keys of TRL's backends that generate cannot honour, and why
GENERATION_KWARGS_REFUSED = {
    "do_sample": "training samples: only True (TRL's value); greedy decoding is "
    "sample.py's --temperature 0",
    # TRL passes it on to transformers' generate, which with do_sample runs beam sampling
    # and keeps each row's best beam
    "num_beams": "TRL hands it to transformers' generate, which then runs beam sampling; "
    "nanogrpo's sampler draws each completion on its own: use 1 or leave it out",
    "num_return_sequences": "set num_generations",
    "n": "set num_generations",
    "max_new_tokens": LENGTH,
    "max_tokens": LENGTH,
    "max_length": LENGTH,
    "min_tokens": "vLLM's name: use min_new_tokens",
    "eos_token_id": STOP_IDS,
    "stop_token_ids": STOP_IDS,
}


def generation_settings(generation_kwargs) -> dict:
    """TRL's generation_kwargs -> Sampling's fields and processors' arguments, for the
    keys of GENERATION_KWARGS (None = off; stop and stop_strings: all of
    them; do_sample=True and num_beams=1, plain sampling, set nothing).
    ValueError naming a refused key and why, an unknown key and the keys
    read, or a bad value; temperature must be > 0: training samples."""
    out = {}
    for key, value in (generation_kwargs or {}).items():
        if key == "do_sample" and value in (True, None):
            continue
        if key == "num_beams" and (value is None or type(value) is int and value == 1):
            continue
        if key in GENERATION_KWARGS_REFUSED:
            why = GENERATION_KWARGS_REFUSED[key]
            raise ValueError(f"generation_kwargs[{key!r}]={value!r}: {why}")
        if key not in GENERATION_KWARGS:
            raise ValueError(
                f"generation_kwargs[{key!r}]: not a key nanogrpo's sampler "
                f"reads; it reads {sorted(GENERATION_KWARGS)}"
            )
        name = GENERATION_KWARGS[key]
        value = OFF[name] if value is None else value
        if name == "stop_strings":
            value = [value] if isinstance(value, str) else value
            value = out.get(name, []) + _ok_list(key, value, str)
        elif name == "suppress_tokens":
            value = _ok_list(key, value, int)
        _check_setting(key, name, value)
        out[name] = value
    return out


def _ok_list(key, value, kind):
    """value as a list of `kind` items, or ValueError."""
    items = list(value) if isinstance(value, (list, tuple)) else [None]
    ok = all(isinstance(v, kind) and not isinstance(v, bool) for v in items)
    need(ok, f"generation_kwargs[{key!r}]", value, f"must be a list of {kind.__name__}")
    return items


def _check_setting(key, name, value):
    """ValueError if generation_kwargs[key] (the setting `name`) is invalid."""
    where = f"generation_kwargs[{key!r}]"
    if name == "stop_strings":
        need(all(value), where, value, "stop strings must be non-empty")
    elif name == "suppress_tokens":
        need(min(value, default=0) >= 0, where, value, "token ids must be >= 0")
    elif name in ("top_k", "min_new_tokens"):
        ok = type(value) is int and value >= 0  # bool is no int here
        need(ok, where, value, "must be an int >= 0 (0 means off)")
    else:  # temperature, top_p, min_p, repetition_penalty: the fields' rules
        need(type(value) in (int, float), where, value, "must be a number")
        ok = name != "temperature" or value > 0
        need(ok, where, value, "training samples, so it must be > 0")
        sampling = {k: OFF[k] for k in SAMPLING}
        try:
            check_sampling(**{**sampling, name: value})
        except ValueError as e:
            raise ValueError(f"generation_kwargs: {e}") from None


def sampling_of(cfg, tok, kernels=None) -> Sampling:
    """The sampler settings of a TrainConfig, as a sampler.Sampling: the sampling fields, then
    generation_kwargs over them (TRL's order: its keys win; suppress_tokens, min_new_tokens and
    stop strings as `processors`), and the tokenizer's stop ids, pad id and vocabulary. Stop
    strings are matched on `tok.decode` of the generated ids. kernels (trainer.Kernels): the draw
    and the decoder; None = the course's sample_next_token and eager Decoder.
    """
    settings = dict(
        max_new_tokens=cfg.max_completion_length,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        min_p=cfg.min_p or 0.0,
        repetition_penalty=cfg.repetition_penalty,
        stop_ids=tok.eos_token_ids,
        pad_id=tok.pad_token_id,
        vocab_size=tok.vocab_size,
    )
    if kernels is not None:
        settings.update(sample_token=kernels.sample_token, decoder=kernels.decoder)
    settings.update(generation_settings(getattr(cfg, "generation_kwargs", None)))
    names = ("suppress_tokens", "min_new_tokens", "stop_strings")
    limits = {k: settings.pop(k) for k in names if k in settings}
    if limits.get("stop_strings"):
        limits["decode"] = tok.decode
    return Sampling(**settings, processors=processors(**limits))
