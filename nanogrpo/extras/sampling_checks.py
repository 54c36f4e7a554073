"""The checks of sampler.generate's arguments: one early ValueError naming the argument, its value
and the rule (the sampling settings' rule is also TrainConfig's and generation_kwargs').

Owns: `need` (the error's form), `check_sampling`, `check_limits`, `check_prompts`.

Does not know about: tokenization, rewards, losses, files, or other processes (of the model it
reads config.vocab_size and max_position_embeddings).
"""


def need(ok, name, value, rule):
    if not ok:
        raise ValueError(f"{name}={value!r}: {rule}")


def check_sampling(temperature, top_k, top_p, min_p, repetition_penalty):
    """The one rule for the sampling settings (generate, TrainConfig and
    generation_kwargs' checks call it); ValueError if off."""
    need(temperature >= 0, "temperature", temperature, "must be >= 0 (0 means greedy)")
    need(top_k >= 0, "top_k", top_k, "must be >= 0 (0 means off)")
    need(0 < top_p <= 1, "top_p", top_p, "must be in (0, 1] (1 means off)")
    need(0 <= min_p <= 1, "min_p", min_p, "must be in [0, 1] (0 means off)")
    penalty = repetition_penalty
    need(penalty > 0, "repetition_penalty", penalty, "must be > 0 (1 means off)")


def check_limits(min_new_tokens, stop_strings, decode):
    """ValueError if generate's min_new_tokens or stop strings cannot run."""
    ok = isinstance(min_new_tokens, int) and min_new_tokens >= 0
    need(ok, "min_new_tokens", min_new_tokens, "must be an int >= 0 (0 means off)")
    ok = all(isinstance(s, str) and s for s in stop_strings or ())
    need(ok, "stop_strings", stop_strings, "must be non-empty strings")
    ok = not stop_strings or callable(decode)
    need(ok, "decode", decode, "stop_strings need decode: token ids -> text")


def check_prompts(model, prompt_ids, num_samples, max_new_tokens, vocab_size, seeds):
    """ValueError naming the first argument of generate that cannot run."""
    need(num_samples >= 1, "num_samples", num_samples, "must be >= 1")
    need(max_new_tokens >= 1, "max_new_tokens", max_new_tokens, "must be >= 1")
    V = model.config.vocab_size
    need(vocab_size > 0, "vocab_size", vocab_size, "must be >= 1")
    need(len(prompt_ids) > 0, "prompt_ids", prompt_ids, "needs at least one prompt")
    for i, p in enumerate(prompt_ids):
        need(len(p) > 0, "prompt_ids", f"[..., {i}: []]", f"prompt {i} is empty")
        ids = f"[..., {i}: [{min(p)}..{max(p)}]]"
        ok = min(p) >= 0 and max(p) < V
        need(ok, "prompt_ids", ids, f"prompt {i} has ids outside [0, {V})")
    longest = max(map(len, prompt_ids))
    limit = model.config.max_position_embeddings
    too_long = (
        f"the longest prompt ({longest}) + max_new_tokens exceeds max_position_embeddings={limit}"
    )
    need(longest + max_new_tokens <= limit, "max_new_tokens", max_new_tokens, too_long)
    ok = seeds is None or len(seeds) == len(prompt_ids)
    need(ok, "seeds", seeds, "needs one seed per prompt")
