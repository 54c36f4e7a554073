"""Custom rollouts: TRL's `rollout_func(prompts, trainer) -> dict`, in place of the sampler.

Owns: `resolve_rollout_func`, `RolloutTrainer` (what a rollout_func
receives as `trainer`), `generate_rollout_completions` (TRL's helper of
trl.experimental.openenv, on nanogrpo's sampler), and `custom_rollout`, which
calls the function and lays out what it returns, checked, as a
rollout.Rollout.

Does not know about: advantages or the loss (train.py scores and trains on
the Rollout as on any other), environments (environment_factory is the other
way to train with them: a run uses one or the other), or files.

Of extras/reward_funcs.py it uses `import_function` and `TRAINER_ARGUMENTS` (names a
returned field may not take).

Choices (TRL 1.16's contract, as its code has it):
- `prompts` holds this process's prompts, one entry per completion it
  trains: each prompt repeated as many times as the process holds completions
  of it (num_generations when it holds whole groups), TRL's RepeatSampler
  layout. (TRL's docstring says "without duplication"; its code passes them
  repeated and counts one completion per entry.) For each entry the function
  returns `prompt_ids`, `completion_ids` (lists of token ids) and `logprobs`
  (the sampler's log-prob of each completion token; None: none), and may
  return `env_mask` (1 on the tokens the model generated, 0 on tokens an
  environment wrote). A wrong count or length is an error naming the field.
- Every other returned field reaches the reward functions as a keyword
  argument (over a dataset column of the same name): a list gives each
  completion its entry, any other value is every completion's (TRL's).
- The loss trains on the returned completion tokens whose env_mask is 1 (none
  of a truncated completion with mask_truncated_completions), and completion
  lengths count those tokens only (TRL's completions/*_length with env_mask).
  A completion is truncated when its last id is neither a stop id nor the pad
  id (TRL's test).
- The call runs as rollout.py's sampling does: eval mode, no gradient, FSDP2
  parameters gathered once, the run's autocast. `trainer.generate` draws from
  the round's generator (seeded per round), so resume stays exact for a
  function whose result depends on nothing else.
- TRL's trainer lends a rollout_func vLLM (`generate_rollout_completions`,
  `trainer.vllm_generation`); here the honest equivalent is the run's own
  sampler with the run's sampling settings (`trainer.generate`).
- A dataset column a reward function requires is not checked at load time: a
  rollout_func's fields may provide it.
"""

import copy
import numbers
from dataclasses import replace

import torch

from nanogrpo import distributed as dist
from nanogrpo.extras.reward_funcs import TRAINER_ARGUMENTS, import_function
from nanogrpo.model import eval_mode
from nanogrpo.rollout import Rollout, join_prompt_completion, trained_mask
from nanogrpo.sampler import generate

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")
# generate_rollout_completions' overrides: vLLM's names -> sampler.Sampling's
OVERRIDES = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def resolve_rollout_func(spec):
    """A config's rollout_func -> the function (None stays None): a function is itself,
    "module:function" or "path/to/file.py:function" is imported."""
    if spec is None or callable(spec):
        return spec
    return import_function(spec, kind="rollout_func")


class RolloutTrainer:
    """What a rollout_func receives as `trainer`: the attributes of TRL's GRPOTrainer a rollout
    function reads, and `generate`.

    model: the policy (in eval mode, its parameters gathered, while the function runs).
    processing_class, tokenizer: the run's nanogrpo.tokenizer.Tokenizer (encode, decode,
        apply_chat_template, whose tokenize=True gives ids as transformers', encode_prompt,
        eos_token_ids, pad_token_id).
    args: the TrainConfig; num_generations, num_generations_eval, max_completion_length,
        temperature: its values, as TRL's trainer holds them.
    state: the run's TrainerState (global_step, max_steps, ...), as reward functions get it.
    """

    def __init__(self, t, generator):
        self._trainer = t
        self.model = t.model
        self.processing_class = t.tok
        self.tokenizer = t.tok
        self.args = t.cfg
        self.num_generations = t.cfg.num_generations
        self.num_generations_eval = t.cfg.num_generations_eval or t.cfg.num_generations
        self.max_completion_length = t.cfg.max_completion_length
        self.temperature = t.cfg.temperature
        self.generator = generator

    @property
    def state(self):
        return self._trainer.state  # setup's trainer_state_of(t) (the sampler process: its round's)

    def generate(self, prompt_ids: list[list[int]], **overrides) -> list[dict]:
        """One completion of each prompt (a list of token ids), sampled as the run samples
        (the trainer's `sampling`, with `overrides` of sampler.Sampling's fields, e.g.
        max_new_tokens) from this round's random stream.
        -> [{"completion_ids": its ids up to and including its stop id, "logprobs": the
        sampler's log-prob of each}], one per prompt."""
        tok = self.processing_class
        settings = replace(self._trainer.sampling, **overrides)
        out = generate(self.model, prompt_ids, settings, generator=self.generator)
        ids, _ = tok.decode_completions(out.completion_ids, out.completion_mask)
        logps = out.logprobs.tolist()  # [P][C]
        return [{"completion_ids": x, "logprobs": lp[: len(x)]} for x, lp in zip(ids, logps)]


def generate_rollout_completions(trainer, prompts: list, *, generation_overrides=None) -> list:
    """TRL's helper (trl.experimental.openenv), on the run's sampler: one completion of each
    prompt (a string, encoded as is, or a message list, rendered with the chat template as the
    trainer renders prompts). generation_overrides: vLLM's names max_tokens, temperature, top_k,
    top_p, min_p, repetition_penalty. -> [{"prompt_ids", "completion_ids", "logprobs", "text"}]
    """
    if not prompts:
        return []
    cfg = trainer.args
    tok = trainer.processing_class
    unknown = sorted(set(generation_overrides or {}) - set(OVERRIDES))
    if unknown:
        raise ValueError(
            f"generation_overrides: {unknown} are not read here; use {sorted(OVERRIDES)}"
        )
    overrides = {OVERRIDES[k]: v for k, v in (generation_overrides or {}).items()}
    encode = cfg.prompt_encoding()
    prompt_ids = [tok.encode_prompt(p, **encode) for p in prompts]
    out = trainer.generate(prompt_ids, **overrides)
    return [
        {**o, "prompt_ids": p, "text": tok.decode(o["completion_ids"])}
        for p, o in zip(prompt_ids, out)
    ]


# -----------------------------------------------------------------------------
# Calling the function, and checking what it returns


def custom_rollout(t, rows: list[dict], copies: int, generator) -> Rollout:
    """`copies` completions of each row from the run's rollout_func (t: trainer.py's Trainer, whose
    rollout_func, model, tok, cfg, autocast and info are read) -> a Rollout."""
    prompts = [row["prompt"] for row in rows for _ in range(copies)]
    trainer = RolloutTrainer(t, generator)
    with torch.no_grad(), dist.gathered(t.model), eval_mode(t.model), t.autocast:
        output = t.rollout_func(copy.deepcopy(prompts), trainer)
    return rollout_of(
        output,
        rows,
        copies,
        prompts,
        tok=t.tok,
        mask_truncated_completions=t.cfg.mask_truncated_completions,
        context=t.model.config.max_position_embeddings,
        device=t.info.device,
    )


# what each field holds per completion, for the error naming an entry that is not a list
ENTRY = {
    "prompt_ids": "its prompt's token ids",
    "completion_ids": "its completion's token ids",
    "logprobs": (
        "one log-prob per token of its completion_ids (or return 'logprobs': None when "
        "the function has none)"
    ),
    "env_mask": "one 0 or 1 per token of its completion_ids",
}


def as_lists(output: dict, name: str, n: int) -> list[list]:
    """output[name] as n lists (a tensor row or tuple becomes a list). ValueError naming the
    field when it is not n entries, or naming the entry that is not a list."""
    values = output[name]
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{len(values)} entries" if isinstance(values, (list, tuple)) else repr(values)[:60]
        raise ValueError(
            f"rollout_func returned {got} as {name!r}; expected a list of {n}: "
            "one per entry of prompts (each entry is one completion)"
        )
    lists = []
    for i, x in enumerate(values):
        if hasattr(x, "tolist"):  # a tensor or array row
            x = x.tolist()
        if not isinstance(x, (list, tuple)):
            # apply_chat_template(tokenize=True) gives a dict, as transformers' does
            hint = ": take its 'input_ids'" if isinstance(x, dict) and "input_ids" in x else ""
            raise ValueError(
                f"rollout_func returned {x!r:.40} as {name}[{i}]: expected a list, "
                f"{ENTRY[name]}{hint}"
            )
        lists.append(list(x))
    return lists


def is_number(x) -> bool:
    """A float or int (a bool is not a log-prob)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def checked_output(output, n: int, vocab_size: int, context: int) -> tuple:
    """What a rollout_func returned for n completions, checked.
    -> (prompt_ids, completion_ids, logprobs or None, env_mask, extra fields {name: [n]})."""
    if not isinstance(output, dict):
        raise ValueError(
            f"rollout_func returned {type(output).__name__}: expected a dict with "
            f"{list(REQUIRED)} (and optionally env_mask and fields for rewards)"
        )
    missing = sorted(set(REQUIRED) - output.keys())
    if missing:  # TRL's message
        raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
    prompt_ids = as_lists(output, "prompt_ids", n)
    completion_ids = as_lists(output, "completion_ids", n)
    logprobs = None if output["logprobs"] is None else as_lists(output, "logprobs", n)
    env_mask = [[1] * len(x) for x in completion_ids]
    if output.get("env_mask") is not None:
        env_mask = as_lists(output, "env_mask", n)
    for i in range(n):
        p, c = prompt_ids[i], completion_ids[i]
        if not p or not all(isinstance(x, int) and 0 <= x < vocab_size for x in p + c):
            raise ValueError(
                f"rollout_func: prompt_ids[{i}] must be a non-empty list, and it and "
                f"completion_ids[{i}] token ids in [0, {vocab_size})"
            )
        if len(p) + len(c) > context:
            raise ValueError(
                f"rollout_func: completion {i} is {len(p)} prompt + {len(c)} "
                f"completion tokens, more than the model's {context} positions"
            )
        for name, values in (("logprobs", logprobs), ("env_mask", env_mask)):
            if values is not None and len(values[i]) != len(c):
                raise ValueError(
                    f"rollout_func: {name}[{i}] has {len(values[i])} entries, "
                    f"completion_ids[{i}] {len(c)}: one per completion token"
                )
        bad = [j for j, x in enumerate(logprobs[i] if logprobs else []) if not is_number(x)]
        if bad:
            j = bad[0]
            raise ValueError(
                f"rollout_func: logprobs[{i}][{j}] is {logprobs[i][j]!r:.40}: each entry is "
                "the log-prob of one completion token, a number"
            )
        if any(m not in (0, 1) for m in env_mask[i]):
            raise ValueError(f"rollout_func: env_mask[{i}] must hold 0 and 1 only")
    extra = {}
    for name, values in output.items():
        if name in REQUIRED or name == "env_mask":
            continue
        if name in TRAINER_ARGUMENTS:
            raise ValueError(
                f"rollout_func returned {name!r}, a name the trainer passes to "
                "reward functions itself: rename the field"
            )
        extra[name] = values if isinstance(values, list) else [values] * n
        if len(extra[name]) != n:
            raise ValueError(
                f"rollout_func returned {len(values)} values as {name!r}; a list "
                f"field holds one per completion ({n}); any other value is shared"
            )
    return prompt_ids, completion_ids, logprobs, env_mask, extra


def rollout_of(
    output, rows, copies, prompts, *, tok, mask_truncated_completions, context, device
) -> Rollout:
    """A rollout_func's output -> the Rollout of its n = rows x copies completions, one prompt per
    completion (prompt_ids holds n entries); mask_truncated_completions: TRL's."""
    n = len(prompts)
    prompt_ids, completion_ids, logprobs, env_mask, extra = checked_output(
        output, n, tok.vocab_size, context
    )
    C = max(1, max(map(len, completion_ids)))
    pad = tok.pad_token_id

    def padded(rows_, fill, dtype):  # n lists -> [n, C]
        return torch.tensor([x + [fill] * (C - len(x)) for x in rows_], dtype=dtype, device=device)

    ids = padded(completion_ids, pad, torch.long)  # [n,C]
    model_mask = padded(env_mask, 0, torch.bool)  # [n,C]: the model's tokens
    stops = set(tok.eos_token_ids) | {pad}
    truncated = torch.tensor(
        [bool(x) and x[-1] not in stops for x in completion_ids], device=device
    )
    mask = trained_mask(model_mask, truncated, mask_truncated_completions)
    input_ids, attention_mask = join_prompt_completion(prompt_ids, ids, pad, 1)
    texts = tok.batch_decode(completion_ids)
    completions = (
        texts
        if isinstance(prompts[0], str)
        else [[{"role": "assistant", "content": text}] for text in texts]
    )
    return Rollout(
        rows=rows,
        num_generations=copies,
        prompt_ids=prompt_ids,
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_mask=mask,
        completion_lengths=model_mask.sum(1),
        truncated=truncated,
        prompts=prompts,
        completions=completions,
        completion_token_ids=completion_ids,
        sampling_logps=None if logprobs is None else padded(logprobs, 0.0, torch.float32),
        extra_fields=extra or None,
    )
