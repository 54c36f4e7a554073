"""Loading a prompt dataset by name: local files, files of Hub dataset repos, GSM8K, built-in tasks.

Owns: `load_dataset` (what the `dataset` and `eval_dataset` settings name), `read_rows` (local
.jsonl/.json/.parquet files), `read_text`, `download_hub_file` and `check_text_only` (rows with
images are refused: the models are text-only).

Does not know about: how the built-in tasks make their rows (extras/tasks.py), the row format
beyond calling data.check_rows on what it loads, tokenization, rewards, the order prompts are
drawn in (data.PromptSampler), or processes.

Choices:
- A dataset is a plain `list[dict]`; no `datasets` dependency. pyarrow is imported only to read
  a .parquet file.
- Hub files are named `hf://datasets/<owner>/<name>[@revision]/<path-in-repo>` (the spelling
  huggingface_hub's file system uses) and fetched with `hf_hub_download`, which caches them.
  `gsm8k` is openai/gsm8k's parquet files, fetched that way.
- A byte that is not UTF-8, or JSON that does not parse, is an error naming the file and the
  line, not a traceback.
- A vision dataset (TRL's `image`/`images` column, or messages with image content parts) is an
  error naming the row, not a run that drops its images without a word.
"""

import json
import os

from nanogrpo.data import check_rows
from nanogrpo.extras.tasks import PROCEDURAL, gsm8k_rows

IMAGE_COLUMNS = ("image", "images")  # TRL's names for a row's images
IMAGE_PARTS = ("image", "image_url")  # content-part types that carry an image (TRL's, OpenAI's)

GSM8K_FILES = {
    "train": "main/train-00000-of-00001.parquet",
    "test": "main/test-00000-of-00001.parquet",
}


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


def check_text_only(rows: list[dict], source: str) -> list[dict]:
    """No row holds an image: a non-empty `image`/`images` column (TRL's vision datasets), or a
    prompt message with an image content part. nanogrpo's models read text only, so such a
    dataset is an error naming the row, not a run that trains without its images. Returns rows
    unchanged."""
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            continue  # check_rows names it
        for column in IMAGE_COLUMNS:
            value = row.get(column)
            if value is not None and not (isinstance(value, (list, tuple, str)) and not value):
                raise ValueError(
                    f"dataset {source}, row {i}: column {column!r} holds images; nanogrpo trains "
                    "text-only models: drop the column (describe the images in the prompt text)"
                )
        prompt = row.get("prompt")
        for j, message in enumerate(prompt if isinstance(prompt, list) else []):
            content = message.get("content") if isinstance(message, dict) else None
            for part in content if isinstance(content, list) else []:
                if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                    raise ValueError(
                        f"dataset {source}, row {i}: message {j} has an {part['type']!r} content "
                        "part; nanogrpo trains text-only models: keep only text parts"
                    )
    return rows


def download_hub_file(spec: str, offline: bool = False) -> str:
    """'hf://datasets/<owner>/<name>[@revision]/<path-in-repo>' -> local path of the cached
    download; offline: from the cache only (huggingface_hub's LocalEntryNotFoundError if it is
    not there)."""
    parts = spec[len("hf://datasets/") :].split("/", 2)
    if not spec.startswith("hf://datasets/") or len(parts) < 3 or not parts[2]:
        raise ValueError(
            f"{spec!r}: expected hf://datasets/<owner>/<name>[@revision]/<path-in-repo>"
        )
    name, _, revision = parts[1].partition("@")
    from huggingface_hub import hf_hub_download

    return hf_hub_download(
        f"{parts[0]}/{name}",
        parts[2],
        repo_type="dataset",
        revision=revision or None,
        local_files_only=offline,
    )


def load_dataset(
    spec: str,
    split: str | None = None,
    *,
    num_rows: int | None = None,
    seed: int = 0,
    needs_prompt: bool = True,
    offline: bool = False,
) -> list[dict]:
    """Rows of a dataset, checked (see `check_rows`, which needs_prompt goes to, and
    `check_text_only`).

    spec: a procedural task name ("default", "countdown", "addition"), "gsm8k" (hub parquet files
    of openai/gsm8k; split "train" or "test"), a "hf://datasets/..." file, or a local file path.
    split: for procedural tasks and gsm8k ("train" when None); ignored for single files.
    num_rows: rows to generate for procedural tasks (default: PROCEDURAL's, 10000 for train and
    256, or 128 for addition, otherwise), or the first num_rows of any other dataset. seed:
    procedural tasks only. offline: a hub file from huggingface_hub's cache only (the dry run
    downloads nothing)."""
    split = split or "train"
    if spec in PROCEDURAL:
        make, n_train, n_eval = PROCEDURAL[spec]
        n = num_rows or (n_train if split == "train" else n_eval)
        return check_rows(make(n, seed, split), spec, needs_prompt)
    if spec == "gsm8k":
        if split not in GSM8K_FILES:
            raise ValueError(f"gsm8k has splits {sorted(GSM8K_FILES)}, got {split!r}")
        rows = gsm8k_rows(
            read_rows(
                download_hub_file(f"hf://datasets/openai/gsm8k/{GSM8K_FILES[split]}", offline)
            )
        )
    elif spec.startswith("hf://"):
        rows = read_rows(download_hub_file(spec, offline))
    elif os.path.isfile(spec):
        rows = read_rows(spec)
    else:
        raise ValueError(
            f"dataset {spec!r} is not a file; use a .jsonl/.json/.parquet path, "
            f"hf://datasets/<owner>/<name>/<file>, 'gsm8k', or one of {sorted(PROCEDURAL)}"
        )
    rows = rows[:num_rows] if num_rows else rows
    return check_rows(check_text_only(rows, spec), spec, needs_prompt)
