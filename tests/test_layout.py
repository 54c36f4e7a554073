"""The package's layout, checked: each module's "Does not know about:" line is true of its imports,
the course (the top-level modules and train.py) stays small and imports only itself and the
infrastructure (the options plug into its seams), no import cycle, nothing in the package calls
back train.py, no reference library is imported at run time, docstrings name files that exist and
hold no measured timings."""

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanogrpo"
SCRIPTS = [ROOT / "train.py", ROOT / "sample.py"]

# -----------------------------------------------------------------------------
# Reading modules: names, docstrings, imports


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package_module(name: str) -> bool:
    """Whether `name` (nanogrpo.a.b) is a module or package of the repository."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at module level or inside functions, and the dotted names it
    reaches through an imported module's attributes (`torch.optim.AdamW` after `import torch`).
    `from nanogrpo import distributed as dist` is nanogrpo.distributed, `from nanogrpo.extras import lora`
    nanogrpo.extras.lora, `from nanogrpo.grpo import LossConfig` nanogrpo.grpo."""
    tree = parse(path)
    package = (
        module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    )
    found = set()
    aliases = {}  # a name bound by `import x.y [as z]` -> the module it names
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if is_package_module(full) else base)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts = []
            while isinstance(node, ast.Attribute):
                parts.append(node.attr)
                node = node.value
            if isinstance(node, ast.Name) and node.id in aliases:
                found.add(".".join([aliases[node.id]] + parts[::-1]))
    return found


def uses(imported: set[str], target: str) -> bool:
    """Whether the imports reach `target`: a module of nanogrpo exactly (nanogrpo.run is the run's
    lifecycle, not every module of nanogrpo/run/), any other library with its submodules
    (torch.distributed includes torch.distributed.fsdp)."""
    if target.startswith("nanogrpo"):
        return target in imported
    return any(m == target or m.startswith(target + ".") for m in imported)


# -----------------------------------------------------------------------------
# "Does not know about:" and its vocabulary

TOKENIZER = ("nanogrpo.tokenizer",)
REWARDS = ("nanogrpo.rewards", "nanogrpo.extras.builtin_rewards", "nanogrpo.extras.reward_model")
GRPO = ("nanogrpo.grpo", "nanogrpo.extras.loss_terms")
LOGPROBS = ("nanogrpo.logprobs", "nanogrpo.fast.logprobs")
SAMPLER = ("nanogrpo.sampler", "nanogrpo.fast.sampling")
PROCESSES = ("nanogrpo.distributed", "torch.distributed")
FILES = ("nanogrpo.checkpoint", "nanogrpo.run.checkpoints", "safetensors")
MODEL = ("nanogrpo.model",)
TOOLS = ("nanogrpo.extras.tools", "nanogrpo.extras.tool_rounds")
SETTINGS = ("nanogrpo.run.config",)
REPORT = ("nanogrpo.run.report",)
RUN = ("nanogrpo.run",)
TRAINER = ("nanogrpo.trainer",)

# The words a "Does not know about:" paragraph may use, each mapped to what the module must then not
# import. A term matches as a whole word, case-insensitive; a path, a dotted name or `code`
# (extras/tools.py, data.check_rows, `tools`) points at where a thing lives: not a claim, no match.
VOCABULARY = {
    "tokenization": TOKENIZER,
    "tokenizer": TOKENIZER,
    "tokenizers": TOKENIZER + ("tokenizers",),
    "chat templates": TOKENIZER,
    "rewards": REWARDS,
    "reward functions": REWARDS,
    "reward models": REWARDS,
    "losses": GRPO,
    "the loss": GRPO,
    "advantages": GRPO,
    "GRPO": GRPO,
    "the GRPO math": GRPO,
    "log-probs": LOGPROBS,
    "sampling": SAMPLER,
    "the sampler": SAMPLER,
    "processes": PROCESSES,
    "more than one process": PROCESSES,
    "other processes": PROCESSES,
    "FSDP2": PROCESSES,
    "torch.distributed": PROCESSES,
    "files": FILES,
    "checkpoints": FILES,
    "the model": MODEL,
    "models": MODEL,
    "the network": MODEL,
    "optimizers": ("torch.optim",),
    "the optimizer": ("torch.optim",),
    "tools": TOOLS,
    "tool calls": TOOLS,
    "environments": ("nanogrpo.extras.environments",),
    "LoRA": ("nanogrpo.extras.lora",),
    "settings": SETTINGS,
    "TrainConfig": SETTINGS,
    "reports": REPORT,
    "metrics files": REPORT,
    "the run": RUN,
    "resume": RUN,
    "datasets": ("nanogrpo.extras.datasets", "datasets"),
    "the row checks": ("nanogrpo.data",),
    "the trainer": TRAINER,
    "training": TRAINER + RUN,
    "the hub": ("huggingface_hub",),
    "transformers": ("transformers",),
    "torch": ("torch",),
}
MARKER = "Does not know about:"


def term_pattern(term: str) -> re.Pattern:
    """`term` as a whole word (words joined by any whitespace), not inside a path or dotted name."""
    words = r"\s+".join(re.escape(w) for w in term.split())
    return re.compile(rf"(?<![\w./-]){words}(?![\w/-]|\.\w)", re.IGNORECASE)


PATTERNS = {term: term_pattern(term) for term in VOCABULARY}


def does_not_know(path: Path) -> str | None:
    """The module docstring's paragraph that starts with a line `Does not know about:`, up to the
    next blank line, on one line; None if there is none."""
    doc = ast.get_docstring(parse(path)) or ""
    for paragraph in re.split(r"\n\s*\n", doc):
        start = re.search(rf"^{re.escape(MARKER)}", paragraph, re.MULTILINE)
        if start:
            return " ".join(paragraph[start.start() :].split())
    return None


def terms_in(text: str) -> list[str]:
    text = re.sub(r"`[^`]*`", " ", text)
    return [term for term, pattern in PATTERNS.items() if pattern.search(text)]


def test_does_not_know_about_matches_the_imports():
    problems = []
    for path in package_files():
        name = module_name(path)
        claim = does_not_know(path)
        if claim is None:
            problems.append(f"{name}: its docstring has no line starting {MARKER!r}")
            continue
        terms = terms_in(claim)
        if not terms:
            problems.append(f"{name}: its {MARKER!r} line uses no term of VOCABULARY: {claim!r}")
        imported = imported_modules(path)
        for term in terms:
            for target in VOCABULARY[term]:
                if uses(imported, target) and target != name:
                    problems.append(f"{name}: does not know about {term!r}, but imports {target}")
    assert not problems, "\n".join(problems)


def test_the_vocabulary_finds_terms_as_words_only():
    assert terms_in("Does not know about: tokenization, or other processes.") == [
        "tokenization",
        "processes",
        "other processes",
    ]
    assert terms_in("see extras/datasets.py, data.check_rows and `tools`; subsampling") == []
    assert uses({"torch.distributed.fsdp"}, "torch.distributed")
    assert not uses({"nanogrpo.run.config"}, "nanogrpo.run")
    here = imported_modules(PACKAGE / "trainer.py")
    assert {
        "nanogrpo.distributed",
        "nanogrpo.extras.lora",
        "nanogrpo.run.config",
        "torch.optim.AdamW",
    } <= here


# -----------------------------------------------------------------------------
# The course: nanogrpo/*.py and train.py

MAX_COURSE_FILES = 12
MAX_COURSE_LINES = 3164


def course_files() -> list[Path]:
    return sorted(PACKAGE.glob("*.py")) + [ROOT / "train.py"]


def test_the_course_is_at_most_twelve_files_and_its_budget():
    files = course_files()
    lines = {f.relative_to(ROOT).as_posix(): len(f.read_text().splitlines()) for f in files}
    rule = (
        "the course is what a student reads through one GRPO round: a feature added to it moves "
        "something out of it (into nanogrpo/extras/, nanogrpo/fast/ or nanogrpo/run/)"
    )
    assert len(files) <= MAX_COURSE_FILES, f"{len(files)} course files {sorted(lines)}; {rule}"
    total = sum(lines.values())
    assert total <= MAX_COURSE_LINES, f"{total} course lines > {MAX_COURSE_LINES} {lines}; {rule}"


# What a student reads: the eight algorithm modules import each other and the infrastructure only;
# the options plug into their seams from trainer.py's setup and train.py (which may import extras/
# and fast/)
ALGORITHM = ("data", "model", "sampler", "rollout", "rewards", "grpo", "logprobs", "schedules")
INFRASTRUCTURE = ("nanogrpo.checkpoint", "nanogrpo.tokenizer", "nanogrpo.distributed")


def nanogrpo_imports(path: Path) -> set[str]:
    """The nanogrpo modules `path` imports (anywhere in it), each named by its file's module."""
    out = set()
    for name in imported_modules(path):
        parts = name.split(".")
        for k in range(len(parts), 1, -1):  # the longest prefix that is a module of the package
            if parts[0] == "nanogrpo" and is_package_module(".".join(parts[:k])):
                out.add(".".join(parts[:k]))
                break
    return out - {module_name(path)}


def test_the_algorithm_modules_import_only_the_course_and_the_infrastructure():
    course = {f"nanogrpo.{m}" for m in ALGORITHM} | {"nanogrpo.trainer"}
    problems = []
    for m in ALGORITHM:
        for dep in sorted(nanogrpo_imports(PACKAGE / f"{m}.py")):
            if dep not in course and not dep.startswith(INFRASTRUCTURE) and dep != "nanogrpo":
                problems.append(f"nanogrpo/{m}.py imports {dep}: give the course a seam for it")
    assert sorted(p.stem for p in PACKAGE.glob("*.py")) == sorted(
        ALGORITHM + ("__init__", "trainer")
    )
    assert not problems, "\n".join(problems)


def test_no_import_cycle_and_nothing_calls_back_train_py():
    """No module of nanogrpo reaches itself through its imports (a package importing its own
    submodules aside), and the run machinery is called by train.py, never the other way."""
    graph = {module_name(p): nanogrpo_imports(p) for p in package_files()}

    def reaches(start, goal, seen):
        for dep in graph.get(start, ()):
            if dep == goal:
                return True
            if dep not in seen:
                seen.add(dep)
                if reaches(dep, goal, seen):
                    return True
        return False

    own = lambda m, d: d.startswith(m + ".") or m.startswith(d + ".")  # noqa: E731
    cycles = [
        f"{m} -> {d} -> ... -> {m}"
        for m, deps in graph.items()
        for d in sorted(deps)
        if not own(m, d) and reaches(d, m, {d})
    ]
    assert not cycles, "\n".join(cycles)
    train_py = (ROOT / "train.py").read_text()
    assert "sys.modules[__name__]" not in train_py
    for path in package_files():
        assert "train" not in imported_modules(path), f"{path} imports train.py"


def test_course_modules_say_what_they_leave_out():
    problems = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "__init__.py":
            continue
        doc = ast.get_docstring(parse(path)) or ""
        paragraphs = [p for p in re.split(r"\n\s*\n", doc) if re.match(r"(Left|Leaves) out", p)]
        if not paragraphs:
            problems.append(f"{path.name}: no 'Left out' or 'Leaves out' paragraph")
            continue
        named = [p for p in named_paths(" ".join(paragraphs)) if resolve(p) is not None]
        if not named:
            problems.append(f"{path.name}: its 'Left out' paragraph names no path under nanogrpo/")
    assert not problems, "\n".join(problems)


# -----------------------------------------------------------------------------
# Imports of the libraries nanogrpo reimplements

REFERENCE_LIBRARIES = {"transformers", "trl", "vllm", "peft", "accelerate", "gguf", "datasets"}


def test_no_runtime_imports_of_the_reference_libraries():
    found = []
    for path in package_files():
        tree = parse(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            found += [
                f"{module_name(path)} imports {n}"
                for n in names
                if n.split(".")[0] in REFERENCE_LIBRARIES
            ]
    assert not found, "\n".join(found)


# -----------------------------------------------------------------------------
# What docstrings and comments say: files that exist, no measured timings


def docstrings_and_comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring (module, class, function) and comment of a file."""
    source = path.read_text()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                out.append((node.body[0].lineno, doc))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def documented_files() -> list[Path]:
    return package_files() + SCRIPTS


# A path to a .py file, or a folder of the package named with its nanogrpo/ prefix.
PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py|nanogrpo/(?:[\w-]+/)*)(?![\w])")
# Paths that are examples or lie outside the package and its two scripts.
NOT_OURS = ("tests/", "bench/", "docs/", "configs/", "examples/", "trl/", "path/", "runs/")
PLACEHOLDERS = {"file.py", "name.py", "tiny.py", "small.py"}


def named_paths(text: str) -> list[str]:
    return PATH.findall(text)


def resolve(path: str) -> Path | None:
    """A docstring's path: from the repository root with its nanogrpo/ prefix, else from the
    package (extras/tools.py, rollout.py), or one of the two scripts."""
    for base in (ROOT, PACKAGE):
        if (base / path).exists():
            return base / path
    return None


def test_docstrings_name_files_that_exist():
    """Paths into the package are written from the package (extras/tools.py, rollout.py) or from
    the repository (nanogrpo/extras/tools.py), and each names a file that exists."""
    missing = []
    for path in documented_files():
        for line, text in docstrings_and_comments(path):
            for named in named_paths(text):
                if named.startswith(NOT_OURS) or named in PLACEHOLDERS:
                    continue
                if resolve(named) is None:
                    missing.append(f"{path.relative_to(ROOT)}:{line}: {named}")
    assert not missing, "named but not found (a file moved?):\n" + "\n".join(missing)


# A measured figure: a number followed by a unit of time (9.8 ms, 30 s, 2 minutes), of throughput
# (37 tok/s, 1.2 GB/s), or a speed-up (1.6x faster, 0.34x the time, 20% slower). An arrow between
# two timed numbers (9.8 -> 5.3 ms) contains one.
NUMBER = r"\d+(?:[.,]\d+)*"
TIMING = re.compile(
    rf"{NUMBER}\s*(?:ms|µs|us|s|sec|secs|seconds?|min|minutes?|hours?)\b"
    rf"|{NUMBER}\s*(?:tok(?:ens)?/s|it/s|[GMK]B/s|[GT]FLOP/?s)"
    rf"|{NUMBER}\s*(?:x|%)\s+(?:faster|slower|the\s+time|as\s+fast|speed-?up|less|more|fewer)\b",
    re.IGNORECASE,
)
# (file, text): figures that are not measurements
NOT_TIMINGS = {
    ("nanogrpo/distributed/__init__.py", "10 s"): "an example of collective_failure's message",
    ("nanogrpo/run/report.py", "1.2 min"): "an example of the status line's text",
}


def test_docstrings_hold_no_timings():
    found = []
    for path in documented_files():
        where = path.relative_to(ROOT).as_posix()
        for line, text in docstrings_and_comments(path):
            for match in TIMING.finditer(text):
                if (where, match.group()) not in NOT_TIMINGS:
                    found.append(f"{where}:{line}: {match.group()!r}")
    assert not found, (
        "measured figures belong in docs/results.md; say what a trick saves instead:\n"
        + "\n".join(found)
    )


# -----------------------------------------------------------------------------
# The infrastructure knows no option: options register with it (extras/lora.py's adapter format
# with the loader), the infrastructure never imports them

# The course module the infrastructure may import: the loader builds model.py's Transformer (as
# nanochat's checkpoint_manager builds gpt.py's GPT)
THE_NETWORK = "nanogrpo.model"


def test_the_infrastructure_imports_no_option_and_no_course_module():
    above = ("nanogrpo.extras", "nanogrpo.fast", "nanogrpo.run")
    course = {module_name(p) for p in course_files()} - {"nanogrpo", THE_NETWORK}
    files = [p for p in package_files() if module_name(p).startswith(INFRASTRUCTURE)]
    offenders = []
    for path in files:
        imported = nanogrpo_imports(path) | ({"train"} & imported_modules(path))
        for dep in sorted(imported):
            if dep.startswith(above) or dep in course:
                offenders.append(f"{path.relative_to(ROOT)} imports {dep}")
    assert len(files) >= 4, files  # checkpoint/ (two files), tokenizer/, distributed/
    assert not offenders, (
        f"{len(offenders)} import(s) from the infrastructure up to an option or the course; let "
        "the option register with the infrastructure instead:\n" + "\n".join(offenders)
    )


# -----------------------------------------------------------------------------
# What a round runs: one steady-state cycle of `python train.py` (the embedded default), traced.
# With --plain=true it runs the course, the infrastructure and the config's reward file only, and
# the options that are off run nothing; the default (fast) round adds fast/'s kernels. The run's
# bookkeeping (run/) happens in train.py's loop around the cycle.

PLAIN_ROUND_FILES = 12
PLAIN_ROUND_LINES = 1500  # of the function bodies it runs, each counted once
FAST_ROUND_FILES = 16
ROUND_INFRASTRUCTURE = ("nanogrpo/tokenizer/", "nanogrpo/distributed/")


def function_spans(path: Path) -> dict[int, range]:
    """A function's lines, def (or its first decorator) to its end, keyed by the line a code
    object of it starts at (Python's co_firstlineno: the first decorator's, else the def's)."""
    spans = {}
    for node in ast.walk(parse(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            spans[node.lineno] = spans[first] = range(first, node.end_lineno + 1)
    return spans


def traced_round(tmp_path, plain: bool) -> dict[str, set[int]]:
    """Run the embedded default for 4 steps (a cycle is a round and its step) and trace its third
    cycle: -> {file of the repository: the lines of the functions it ran there}."""
    import sys

    import train
    from nanogrpo.run.configurator import load_config, read_config_file

    init = read_config_file("tiny")["init_model"]
    cfg = load_config(
        [
            "--config",
            "tiny.py",
            f"--model={tmp_path}/init",
            f"--init_model={init!r}",
            f"--output_dir={tmp_path}/out",
            "--eval_strategy=no",
            "--save_steps=0",
            "--max_steps=4",
            f"--plain={str(plain).lower()}",
        ]
    )
    started = set()  # (file, first line) of every code object called
    cycles = []
    cycle = train.train_cycle

    def traced(t):
        cycles.append(t.step)
        if len(cycles) != 3:
            return cycle(t)

        def profile(frame, event, arg):
            if event == "call":
                started.add((frame.f_code.co_filename, frame.f_code.co_firstlineno))

        sys.setprofile(profile)
        try:
            return cycle(t)
        finally:
            sys.setprofile(None)

    train.train_cycle = traced
    try:
        train.train(cfg)
    finally:
        train.train_cycle = cycle
    assert len(cycles) == 4, cycles
    lines = {}
    for filename, first in started:
        path = Path(filename)
        if not path.is_absolute() or ROOT not in path.resolve().parents:
            continue
        rel = path.resolve().relative_to(ROOT).as_posix()
        if not rel.startswith(("nanogrpo/", "train.py")):  # torch in a venv inside the checkout
            continue
        span = function_spans(path).get(first)
        lines.setdefault(rel, set()).update(span or ())
    return lines


def round_summary(lines: dict[str, set[int]]) -> str:
    return "\n".join(f"  {len(v):5d} {k}" for k, v in sorted(lines.items()))


def test_a_plain_round_runs_the_course_and_the_infrastructure_only(tmp_path):
    import inspect

    from nanogrpo.extras.builtin_rewards import default_task_reward

    reward_file = Path(inspect.getsourcefile(default_task_reward)).relative_to(ROOT).as_posix()
    course = {p.relative_to(ROOT).as_posix() for p in course_files()}
    lines = traced_round(tmp_path, plain=True)
    summary = round_summary(lines)
    outside = [
        f
        for f in lines
        if f not in course and f != reward_file and not f.startswith(ROUND_INFRASTRUCTURE)
    ]
    assert not outside, f"a plain round runs {outside} (an option off runs nothing):\n{summary}"
    assert len(lines) <= PLAIN_ROUND_FILES, summary
    total = sum(len(v) for v in lines.values())
    assert total <= PLAIN_ROUND_LINES, f"{total} lines of functions run:\n{summary}"


def test_the_default_round_adds_only_the_fast_kernels(tmp_path):
    lines = traced_round(tmp_path, plain=False)
    assert any(f.startswith("nanogrpo/fast/") for f in lines), round_summary(lines)
    outside = [f for f in lines if f.startswith(("nanogrpo/extras/", "nanogrpo/run/"))]
    outside = [f for f in outside if not f.endswith("builtin_rewards.py")]
    assert not outside, round_summary(lines)
    assert len(lines) <= FAST_ROUND_FILES, round_summary(lines)
