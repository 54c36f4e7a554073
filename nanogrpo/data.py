"""Prompt datasets: a list of dict rows, where to get them, and the order the trainer sees them in.

Owns: `load_dataset` (local .jsonl/.json/.parquet files, files in a Hub dataset repo, GSM8K, and
the procedural tasks `default`, `countdown` and `addition`), the row checks, `columns_of` (the
extra columns reward functions receive) and `PromptSampler` (shuffled, resumable batches of
prompts).

Does not know about: tokenization or chat templates (tokenizer.py renders conversational
prompts), rewards (rewards.py), or processes (the trainer gives each rank its slice of a batch).

Choices:
- A dataset is a plain `list[dict]`; no `datasets` dependency. Every row has `prompt`: a string
  (standard format) or a list of {"role", "content"} messages (conversational format), as in
  TRL. All other keys are dataset columns, passed to every reward function as keyword arguments.
  Where an environment writes the prompt (its reset(), environments.py), a row may lack it or
  hold an empty one (`needs_prompt=False`), as TRL allows.
- Hub files are named `hf://datasets/<owner>/<name>[@revision]/<path-in-repo>` (the spelling
  huggingface_hub's file system uses) and fetched with `hf_hub_download`, which caches them.
- Procedural tasks are a pure function of (name, split, num_rows, seed). For `default` and
  `countdown` split "train" uses `seed`, any other split `seed + 1`, so train and test rows may
  overlap; `addition` splits the problems themselves, so its test split is truly held out.

The default task ("default"): copy a 4-letter string over the alphabet a-h, prompt "bhad=" ->
target "bhad". It is meant to be learned from scratch, by RL alone, by a ~100k-parameter
transformer in 200-400 steps on a CPU. It works because (1) the reward
(rewards.default_task_score) is dense: a random policy already earns partial credit for using
the right letters and stopping at the right length, so groups have reward variance from step 0;
(2) the fixed length makes every output position read the prompt at one constant relative
offset, a single attention pattern that RoPE models pick up easily; (3) the vocabulary is tiny:
a char-level tokenizer over `DEFAULT_TASK_CHARS` plus a few specials. (How reliably, over seeds:
docs/results.md.)
"""

import json
import os
import random

import torch

DEFAULT_TASK_ALPHABET = "abcdefgh"
# every character in the default task's prompts and targets
DEFAULT_TASK_CHARS = DEFAULT_TASK_ALPHABET + "="
# what the accuracy + format rewards check
GSM8K_SYSTEM_PROMPT = (
    "Solve the math problem. Think step by step inside <think> </think> tags, then give "
    "the final answer as a number in \\boxed{} inside <answer> </answer> tags, for example "
    "<think> ... </think>\n<answer>\\boxed{42}</answer>"
)
GSM8K_FILES = {
    "train": "main/train-00000-of-00001.parquet",
    "test": "main/test-00000-of-00001.parquet",
}

# -----------------------------------------------------------------------------
# procedural tasks


def make_default_task(
    num_rows: int,
    seed: int,
    length: int = 4,
    alphabet: str = DEFAULT_TASK_ALPHABET,
    reverse: bool = False,
) -> list[dict]:
    """Rows {"prompt": "<s>=", "target": s (or s reversed)} with s random letters of `alphabet`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        s = "".join(rng.choice(alphabet) for _ in range(length))
        rows.append({"prompt": s + "=", "target": s[::-1] if reverse else s})
    return rows


def _random_expression(nums: list[int], rng: random.Random) -> tuple[str, int] | None:
    """Combine all of nums with random + - * / into one expression; None when a step is not a whole
    number."""
    pool = [(str(n), n) for n in nums]
    while len(pool) > 1:
        (a, va), (b, vb) = pool.pop(rng.randrange(len(pool))), pool.pop(rng.randrange(len(pool)))
        op = rng.choice("+-*/")
        if op == "/" and (vb == 0 or va % vb):
            return None
        value = {"+": va + vb, "-": va - vb, "*": va * vb, "/": va // vb if vb else 0}[op]
        pool.append((f"({a} {op} {b})", value))
    expression, value = pool[0]
    return (expression[1:-1] if expression.startswith("(") else expression), value


def countdown(num_rows: int, seed: int, conversational: bool = True) -> list[dict]:
    """Countdown rows: 3-4 numbers in 1..100 and a reachable positive `target` (at most 1000).

    Columns: prompt (a user message asking for <think> reasoning and an <answer> equation), nums,
    target, and `equation`, one solution."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < num_rows:
        nums = [rng.randint(1, 100) for _ in range(rng.choice((3, 4)))]
        built = _random_expression(list(nums), rng)
        if built is None or not 0 < built[1] <= 1000:
            continue
        text = (
            f"Using the numbers {nums}, write an equation that equals {built[1]}. Use each number "
            "exactly once and only + - * / and parentheses. Think it through inside <think> "
            "</think>, then give just the equation inside <answer> </answer>, for example "
            "<answer>(1 + 2) / 3</answer>."
        )
        prompt = [{"role": "user", "content": text}] if conversational else text
        rows.append({"prompt": prompt, "nums": nums, "target": built[1], "equation": built[0]})
    return rows


# short: replaces SmolLM2's default system prompt
ADDITION_SYSTEM_PROMPT = "Answer with just the number."


def addition(num_rows: int, seed: int, split: str = "train", max_operand: int = 25) -> list[dict]:
    """Two-number addition as chat rows: "What is 12 + 7?" -> answer "19", a, b in 1..max_operand.

    The held-out split is a different set of problems, not just a different seed: a fixed quarter of
    the unordered pairs {a, b} (chosen by a seeded hash of the pair, the same for every `seed`) is
    "test", the rest "train", so no test problem, nor its b + a twin, is ever trained on. Rows walk
    the split's problems in a `seed`-shuffled order (all distinct before any repeats). Columns:
    prompt ([system, user]), answer."""
    held_out = split != "train"
    problems = [
        (a, b)
        for a in range(1, max_operand + 1)
        for b in range(1, max_operand + 1)
        if (random.Random(f"{min(a, b)}+{max(a, b)}").random() < 0.25) == held_out
    ]
    rng = random.Random(seed)
    rows = []
    while len(rows) < num_rows:
        rng.shuffle(problems)
        rows += [
            {
                "prompt": [
                    {"role": "system", "content": ADDITION_SYSTEM_PROMPT},
                    {"role": "user", "content": f"What is {a} + {b}?"},
                ],
                "answer": str(a + b),
            }
            for a, b in problems[: num_rows - len(rows)]
        ]
    return rows


# name -> (make(num_rows, seed, split), default rows for train, default rows otherwise)
PROCEDURAL = {
    "default": (
        lambda n, seed, split: make_default_task(n, seed if split == "train" else seed + 1),
        10_000,
        256,
    ),
    "countdown": (
        lambda n, seed, split: countdown(n, seed if split == "train" else seed + 1),
        10_000,
        256,
    ),
    "addition": (addition, 10_000, 128),
}

# -----------------------------------------------------------------------------
# files


def read_rows(path: str) -> list[dict]:
    """Rows of a local .jsonl (one object per line), .json (a list of objects, or a dict of
    equal-length columns) or .parquet (needs pyarrow) file. Text must be UTF-8; a byte that is
    not, or JSON that does not parse, is an error naming the file and the line."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
        return pq.read_table(path).to_pylist()
    if path.endswith(".jsonl"):
        rows = []
        for line_no, line in enumerate(read_text(path).split("\n"), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{path}, line {line_no}: not valid JSON ({e.msg}, column {e.colno})"
                    ) from None
        return rows
    if path.endswith(".json"):
        try:
            data = json.loads(read_text(path))
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}, line {e.lineno}: not valid JSON ({e.msg}, column {e.colno})"
            ) from None
        if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
            n = {len(v) for v in data.values()}
            if len(n) != 1:
                raise ValueError(f"{path}: columns have different lengths {sorted(n)}")
            return [dict(zip(data, values)) for values in zip(*data.values())]
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a list of rows or a dict of columns")
        return data
    raise ValueError(f"{path}: unknown file type; use .jsonl, .json or .parquet")


def read_text(path: str) -> str:
    """A file's text, decoded as UTF-8; a byte that is not UTF-8 is an error naming the file and
    the line it is on."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_no = raw[: e.start].count(b"\n") + 1
        raise ValueError(
            f"{path}, line {line_no}: byte 0x{raw[e.start]:02x} is not UTF-8 ({e.reason}); "
            "save the file as UTF-8"
        ) from None


def download_hub_file(spec: str) -> str:
    """'hf://datasets/<owner>/<name>[@revision]/<path-in-repo>' -> local path of the cached
    download."""
    parts = spec[len("hf://datasets/") :].split("/", 2)
    if not spec.startswith("hf://datasets/") or len(parts) < 3 or not parts[2]:
        raise ValueError(
            f"{spec!r}: expected hf://datasets/<owner>/<name>[@revision]/<path-in-repo>"
        )
    name, _, revision = parts[1].partition("@")
    from huggingface_hub import hf_hub_download

    return hf_hub_download(
        f"{parts[0]}/{name}", parts[2], repo_type="dataset", revision=revision or None
    )


def gsm8k_rows(raw_rows: list[dict]) -> list[dict]:
    """GSM8K rows {question, answer: "...#### 72"} -> {prompt: [system, user], answer: "72"}."""
    return [
        {
            "prompt": [
                {"role": "system", "content": GSM8K_SYSTEM_PROMPT},
                {"role": "user", "content": row["question"]},
            ],
            "answer": row["answer"].rsplit("####", 1)[-1].strip().replace(",", ""),
        }
        for row in raw_rows
    ]


def load_dataset(
    spec: str,
    split: str | None = None,
    *,
    num_rows: int | None = None,
    seed: int = 0,
    needs_prompt: bool = True,
) -> list[dict]:
    """Rows of a dataset, checked (see `check_rows`, which needs_prompt goes to).

    spec: a procedural task name ("default", "countdown"), "gsm8k" (hub parquet files of
    openai/gsm8k; split "train" or "test"), a "hf://datasets/..." file, or a local file path.
    split: for procedural tasks and gsm8k ("train" when None); ignored for single files.
    num_rows: rows to generate for procedural tasks (default 10000 for train, 256 otherwise), or the
    first num_rows of any other dataset. seed: procedural tasks only."""
    split = split or "train"
    if spec in PROCEDURAL:
        make, n_train, n_eval = PROCEDURAL[spec]
        n = num_rows or (n_train if split == "train" else n_eval)
        return check_rows(make(n, seed, split), spec, needs_prompt)
    if spec == "gsm8k":
        if split not in GSM8K_FILES:
            raise ValueError(f"gsm8k has splits {sorted(GSM8K_FILES)}, got {split!r}")
        rows = gsm8k_rows(
            read_rows(download_hub_file(f"hf://datasets/openai/gsm8k/{GSM8K_FILES[split]}"))
        )
    elif spec.startswith("hf://"):
        rows = read_rows(download_hub_file(spec))
    elif os.path.isfile(spec):
        rows = read_rows(spec)
    else:
        raise ValueError(
            f"dataset {spec!r} is not a file; use a .jsonl/.json/.parquet path, "
            f"hf://datasets/<owner>/<name>/<file>, 'gsm8k', or one of {sorted(PROCEDURAL)}"
        )
    return check_rows(rows[:num_rows] if num_rows else rows, spec, needs_prompt)


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


def columns_of(rows: list[dict]) -> dict[str, list]:
    """Every column but `prompt`, as {name: [value per row]} (None where a row lacks the key)."""
    names = list(dict.fromkeys(k for row in rows for k in row if k != "prompt"))
    return {name: [row.get(name) for row in rows] for name in names}


# -----------------------------------------------------------------------------
# sampling order


class PromptSampler:
    """Endless batches of `batch_size` rows, reshuffled every epoch, resumable.

    Epoch e visits the rows in torch.randperm order from a generator seeded
    with seed + e (or in file order with shuffle=False, TRL's
    shuffle_dataset); the last len(rows) % batch_size rows of each epoch's
    order are skipped. `state_dict()` is (epoch, position), so a restored
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
        """The next `batch_size` rows (starting a new, reshuffled epoch
        when this one runs out)."""
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
        if state["num_rows"] != len(self.rows):
            raise ValueError(
                f"the dataset has {len(self.rows)} rows, the checkpoint's run had "
                f"{state['num_rows']}: resume with the same dataset, or start a new run "
                "in another --output_dir"
            )
        self.epoch = state["epoch"]
        self.position = state["position"]
        self.seed = state["seed"]
