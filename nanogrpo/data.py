"""Prompt datasets: a list of dict rows, their checks, and the order the trainer sees them in.

Owns: the row format and its checks (`is_conversational`, `check_rows`, `check_prompts`,
`check_same_dataset` on resume), `columns_of` (the extra columns reward functions receive) and
`PromptSampler` (shuffled, resumable batches of prompts).

Leaves out: where rows come from. `load_dataset` (local .jsonl/.json/.parquet files, files in a
Hub dataset repo, GSM8K) lives in extras/datasets.py; the built-in tasks `default`, `countdown`
and `addition` live in extras/tasks.py.

Does not know about: tokenization or chat templates (tokenizer/ renders conversational prompts;
check_prompts calls the tokenizer it is given and reads its unknown token), rewards
(rewards.py), or processes (train.py's round_prompts gives each rank its share of a batch).

Choices:
- A dataset is a plain `list[dict]`. Every row has `prompt`: a string (standard format) or a
  list of {"role", "content"} messages (conversational format), as in TRL. All other keys are
  dataset columns, passed to every reward function as keyword arguments. Where an environment
  writes the prompt (its reset(), extras/environments.py), a row may lack it or hold an empty one
  (`needs_prompt=False`), as TRL allows.
- Rows are checked before step 1 (`check_rows` as they are loaded, `check_prompts` against the
  tokenizer), so a bad row stops the run with its number, not mid-run.
"""

import torch

# -----------------------------------------------------------------------------
# rows and columns


def is_conversational(row: dict) -> bool:
    """True when the row's prompt is a list of chat messages."""
    return isinstance(row["prompt"], list)


def check_rows(rows: list[dict], source: str, needs_prompt: bool = True) -> list[dict]:
    """Every row is a dict with a non-empty `prompt`, all in the same format; with needs_prompt
    False (an environment's reset() writes the prompt) a row may lack it or hold an empty one.
    Returns rows unchanged."""
    if not rows:
        raise ValueError(f"dataset {source}: no rows")
    with_prompt = [row for row in rows if isinstance(row, dict) and "prompt" in row]
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or ("prompt" not in row and needs_prompt):
            found = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"dataset {source}, row {i}: no 'prompt' column (found {found})")
        if "prompt" not in row:
            continue
        prompt = row["prompt"]
        ok = isinstance(prompt, str) or (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
        )
        if not ok:
            raise ValueError(
                f"dataset {source}, row {i}: 'prompt' must be a string or a list of "
                f"{{'role', 'content'}} messages, got {prompt!r:.100}"
            )
        if needs_prompt and not (
            prompt.strip()
            if isinstance(prompt, str)
            else any(str(m["content"] or "").strip() for m in prompt)
        ):
            raise ValueError(f"dataset {source}, row {i}: the prompt is empty")
        if is_conversational(row) != is_conversational(with_prompt[0]):
            raise ValueError(
                f"dataset {source}, row {i}: mixes standard (string) and conversational "
                "(message list) prompts"
            )
    return rows


def check_prompts(
    rows: list[dict], source: str, tok, max_prompt_tokens: int, tools=None, **encode_kwargs
) -> int:
    """Encode every prompt once, at load time, exactly as the rollout will (with the tool schemas
    `tools` a tool-calling run puts in the chat template, or a function of the row giving its
    own, as environments route rows to their tools; and encode_kwargs: max_length,
    chat-template variables), so a bad row stops the run before step 1, named: a prompt longer
    than `max_prompt_tokens` (the model's context minus max_completion_length), or a character
    the tokenizer can only map to its unknown token (silently, e.g. the char-level one).
    -> how many prompts max_length cuts.
    """
    unk = tok.token_to_id(getattr(tok.tokenizer.model, "unk_token", None))
    max_length = encode_kwargs.pop("max_length", None)
    cut = 0
    for i, row in enumerate(rows):
        schemas = tools(row) if callable(tools) else tools
        ids = tok.encode_prompt(row["prompt"], tools=schemas, **encode_kwargs)
        if max_length is not None and len(ids) > max_length:
            cut += 1
            ids = ids[-max_length:]
        if len(ids) > max_prompt_tokens:
            raise ValueError(
                f"dataset {source}, row {i}: the prompt is {len(ids)} tokens, more than the "
                f"{max_prompt_tokens} the model's context leaves beside max_completion_length; "
                "shorten or drop that row, set max_prompt_length, or lower max_completion_length"
            )
        if unk is not None and unk in ids:
            text = (
                row["prompt"]
                if isinstance(row["prompt"], str)
                else "".join(str(m["content"]) for m in row["prompt"])
            )
            bad = sorted({c for c in text if tok.encode(c, add_special_tokens=False) == [unk]})
            if bad:
                raise ValueError(
                    f"dataset {source}, row {i}: the tokenizer has no token for {bad} (they would "
                    "be read as its unknown token); remove them or use a tokenizer that has them"
                )
    return cut


# columns TRL never passes to reward functions
NOT_PASSED = ("prompt", "completion", "completion_ids")


def columns_of(rows: list[dict]) -> dict[str, list]:
    """Every column but NOT_PASSED's, as {name: [value per row]} (None where a row lacks it)."""
    names = list(dict.fromkeys(k for row in rows for k in row if k not in NOT_PASSED))
    return {name: [row.get(name) for row in rows] for name in names}


def check_same_dataset(rows: list[dict], state: dict, source=None) -> None:
    """A resumed prompt order (a PromptSampler `state_dict()`) is over its dataset's rows: a
    dataset of another size is refused (on resume, before its rows are rendered)."""
    if state["num_rows"] != len(rows):
        named = "" if source is None else f"dataset={source!r}: "
        raise ValueError(
            f"{named}the dataset has {len(rows)} rows, the checkpoint's run had "
            f"{state['num_rows']}: resume with the same dataset, or start a new run "
            "in another --output_dir"
        )


# -----------------------------------------------------------------------------
# sampling order


class PromptSampler:
    """Endless batches of `batch_size` rows, reshuffled every epoch, resumable.

    Epoch e visits the rows in torch.randperm order from a generator seeded
    with seed + e (or in file order with shuffle=False, TRL's
    shuffle_dataset); the last len(rows) % batch_size rows of each epoch's
    order are skipped. `state_dict()` holds (epoch, position), so a restored
    sampler yields exactly what the original would have."""

    def __init__(self, rows: list[dict], batch_size: int, seed: int = 0, shuffle: bool = True):
        if not 0 < batch_size <= len(rows):
            raise ValueError(
                f"{batch_size} prompts per generation round must be in [1, {len(rows)} rows]: "
                "use a smaller batch or a larger dataset"
            )
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    def epoch_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.rows)))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.rows), generator=generator).tolist()

    def next_batch(self) -> list[dict]:
        """The next `batch_size` rows (a new, reshuffled epoch when this one runs out)."""
        if self.position + self.batch_size > len(self.rows):
            self.epoch += 1
            self.position = 0
        start = self.position
        indices = self.epoch_order()[start : start + self.batch_size]
        self.position += self.batch_size
        return [self.rows[i] for i in indices]

    def state_dict(self) -> dict:
        """Where the sampler is: {"epoch", "position", "seed", "num_rows"}."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_rows": len(self.rows),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a `state_dict()`; the dataset must have the same number of rows."""
        check_same_dataset(self.rows, state)
        self.epoch = state["epoch"]
        self.position = state["position"]
        self.seed = state["seed"]
