"""What a fresh `pip install -e .` brings must be enough to run train.py and sample.py."""

import ast
import configparser
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Distribution names for the modules the project imports (or that its imports need at run time).
DIST_OF_MODULE = {
    "torch": "torch",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "huggingface_hub": "huggingface-hub",
    "numpy": "numpy",
    "jinja2": "jinja2",
}
# safetensors.torch.load_file/save_file import numpy; safetensors does not declare it.
NEEDED_BY_DEPENDENCIES = {"numpy"}


def install_requires():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].split("\n")
    return {re.split(r"[<>=!~ ;\[]", line.strip())[0].lower() for line in lines if line.strip()}


def third_party_imports():
    files = list((ROOT / "nanogrpo").rglob("*.py")) + [ROOT / "train.py", ROOT / "sample.py"]
    found = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and not (ROOT / top).is_dir():
                    found.add(top)
    return found


def test_every_runtime_import_is_declared():
    declared = install_requires()
    modules = third_party_imports() | NEEDED_BY_DEPENDENCIES
    # Imported inside a function, only when the setting that needs them is used.
    # yaml: only for a .yaml config (PyYAML comes with huggingface-hub).
    optional = {"matplotlib", "wandb", "tensorboard", "trackio", "pyarrow", "peft", "yaml"}
    missing = [m for m in sorted(modules - optional) if DIST_OF_MODULE.get(m, m) not in declared]
    assert not missing, f"imported at run time but not in setup.cfg install_requires: {missing}"


def test_install_requires_is_the_readme_list():
    declared = install_requires()
    assert declared == {"torch", "safetensors", "tokenizers", "huggingface-hub", "numpy", "jinja2"}


def unclosed_fences(text: str) -> list[str]:
    """Where a Markdown file's ``` fences do not pair as they render: a fence that should close a
    block but has text after it (it closes nothing, and the block runs on), or a block never
    closed."""
    problems = []
    opened = None  # the line number of the open block's fence
    for n, line in enumerate(text.splitlines(), 1):
        if not line.startswith("```"):
            continue
        if opened is None:
            opened = n
        elif line.rstrip() == "```":
            opened = None
        else:
            problems.append(f"line {n}: text after a fence inside the block of line {opened}")
    if opened is not None:
        problems.append(f"line {opened}: a block never closed")
    return problems


def test_readme_fences_pair_and_it_stays_short():
    readme = (ROOT / "README.md").read_text()
    assert unclosed_fences(readme) == []
    assert len(readme.splitlines()) <= 300, "README.md: move detail to docs/*.md, with a link"
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert unclosed_fences(doc.read_text()) == [], doc.name
    assert unclosed_fences("```bash\npython train.py\n``` Then\ntext\n```\n") == [
        "line 3: text after a fence inside the block of line 1"
    ]
