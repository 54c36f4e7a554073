"""Built-in prompt tasks: rows made by code, and GSM8K's rows made into prompts.

Owns: the procedural tasks `default` (`make_default_task`), `countdown` and `addition`, the
`PROCEDURAL` table that names them for `load_dataset` (extras/datasets.py), and `gsm8k_rows`, which
turns GSM8K's raw rows into chat prompts with an `answer` column.

Does not know about: files or the Hub (extras/datasets.py reads them), the row checks (data.py),
tokenizers, the rewards that score these rows (extras/builtin_rewards.py), torch, or processes.

Choices:
- Procedural tasks are a pure function of (name, split, num_rows, seed). For `default` and
  `countdown` split "train" uses `seed`, any other split `seed + 1`, so train and test rows may
  overlap; `addition` splits the problems themselves, so its test split is truly held out.
- Every row carries the columns its built-in reward reads: `target` (default_task), `nums` and
  `target` (countdown), `answer` (accuracy, for addition and GSM8K).

The default task ("default"): copy a 4-letter string over the alphabet a-h, prompt "bhad=" ->
target "bhad". It is meant to be learned from scratch, by RL alone, by a ~100k-parameter
transformer in 200-400 steps on a CPU. It works because (1) the reward
(builtin_rewards.default_task_score) is dense: a random policy already earns partial credit for
using the right letters and stopping at the right length, so groups have reward variance from
step 0; (2) the fixed length makes every output position read the prompt at one constant
relative offset, a single attention pattern that RoPE models pick up easily; (3) the vocabulary
is tiny: a char-level tokenizer over `DEFAULT_TASK_CHARS` plus a few specials. (How reliably,
over seeds: docs/results.md.)
"""

import random

DEFAULT_TASK_ALPHABET = "abcdefgh"
# every character in the default task's prompts and targets
DEFAULT_TASK_CHARS = DEFAULT_TASK_ALPHABET + "="
# what the accuracy + format rewards check
GSM8K_SYSTEM_PROMPT = (
    "Solve the math problem. Think step by step inside <think> </think> tags, then give "
    "the final answer as a number in \\boxed{} inside <answer> </answer> tags, for example "
    "<think> ... </think>\n<answer>\\boxed{42}</answer>"
)

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
# GSM8K


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
