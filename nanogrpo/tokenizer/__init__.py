"""Text <-> token ids, and chat prompts rendered with the checkpoint's own template.

Owns: `Tokenizer`, a thin layer over the `tokenizers` library's tokenizer.json that adds what
transformers adds on top: the special tokens and `add_bos_token`/`add_eos_token` of
tokenizer_config.json, the chat template (tokenizer_config.json's `chat_template` or a
`chat_template.jinja` file) rendered with jinja2 exactly as transformers renders it, and the set of
ids that end a completion (the tokenizer's eos plus generation_config.json's `eos_token_id`).

Does not know about: models, sampling, or training. A hub id is downloaded by
checkpoint/__init__.py's resolve_path, as a model's is.
"""

import json
import os
from datetime import datetime

from tokenizers import Tokenizer as HFTokenizer

from nanogrpo.checkpoint import resolve_path


def _token_text(value):
    """A special token from tokenizer_config.json: a string or an AddedToken dict -> its text."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json_if_exists(path) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


# first found wins, as in transformers
REASONING_KEYS = (
    "reasoning_content",
    "thinking",
    "reasoning",
)


def _template_message(message: dict) -> dict:
    """A message as transformers hands it to a chat template: None values dropped, reasoning
    aliased."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_KEYS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def compile_chat_template(source: str):
    """Compile a chat template the way transformers does: sandboxed jinja2 with trim_blocks and
    lstrip_blocks, loop controls, and the helpers templates use (raise_exception, strftime_now, a
    `tojson` that keeps non-ASCII characters and takes indent/separators/sort_keys)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """A checkpoint's tokenizer: encode/decode, chat template, eos and pad ids."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        config: dict,
        chat_template: str | None = None,
        generation_config: dict | None = None,
    ):
        self.tokenizer = tokenizer
        self.config = config
        self.chat_template = chat_template
        self.special_tokens = {
            k: _token_text(config.get(k))
            for k in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        self.bos_token_id = self.token_to_id(self.special_tokens["bos_token"])
        self.eos_token_id = self.token_to_id(self.special_tokens["eos_token"])
        gen_eos = (generation_config or {}).get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        self.eos_token_ids: set[int] = {i for i in [self.eos_token_id, *gen_eos] if i is not None}
        pad = self.token_to_id(self.special_tokens["pad_token"])
        self.pad_token_id: int = pad if pad is not None else self.eos_token_id
        # ids >= this are padding rows
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._template = None

    def __getstate__(self):
        """Pickled (async_rollouts' sampler process) without the compiled chat template, which
        holds local functions: it is compiled again when first used."""
        return {**self.__dict__, "_template": None}

    @classmethod
    def from_pretrained(cls, path_or_hub_id) -> "Tokenizer":
        """Load tokenizer.json (+ tokenizer_config.json, chat_template.jinja,
        generation_config.json) from a local directory or a hub id; a PEFT adapter directory
        without them: its base model's.
        """
        path = resolve_path(path_or_hub_id)
        tok_path = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tok_path):
            base = _read_json_if_exists(os.path.join(path, "adapter_config.json")).get(
                "base_model_name_or_path"
            )
            if base:  # a PEFT adapter saved without a tokenizer: its base model's
                return cls.from_pretrained(base)
            raise FileNotFoundError(
                f"{tok_path} not found: nanogrpo needs a fast tokenizer (tokenizer.json)"
            )
        config = _read_json_if_exists(os.path.join(path, "tokenizer_config.json"))
        special_map = _read_json_if_exists(os.path.join(path, "special_tokens_map.json"))
        for key, value in special_map.items():
            config.setdefault(key, value)
        template = config.get("chat_template")
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path) as f:
                template = f.read()
        if isinstance(
            template, list
        ):  # named templates: [{"name": "default", "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}.get("default")
        generation_config = _read_json_if_exists(os.path.join(path, "generation_config.json"))
        return cls(HFTokenizer.from_file(tok_path), config, template, generation_config)

    def token_to_id(self, token: str | None) -> int | None:
        """The id of a token string (None when absent)."""
        return None if token is None else self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, the tokenizer's post-processor runs and
        tokenizer_config.json's add_bos_token/add_eos_token are honoured."""
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens:
            return ids
        bos = self.bos_token_id
        eos = self.eos_token_id
        if self.config.get("add_bos_token") and bos is not None and ids[:1] != [bos]:
            ids = [bos] + ids
        if self.config.get("add_eos_token") and eos is not None and ids[-1:] != [eos]:
            ids = ids + [eos]
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of token ids (a list or a 1-D tensor)."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, rows, skip_special_tokens: bool = True) -> list[str]:
        """decode() of each row."""
        return [self.decode(r, skip_special_tokens) for r in rows]

    def decode_completions(
        self, completion_ids, completion_mask
    ) -> tuple[list[list[int]], list[str]]:
        """Generated rows [N,C] (right-padded, mask [N,C]) -> (each row's ids up to its length, its
        text with special tokens skipped), in one device-to-host transfer for the whole batch."""
        N, C = completion_ids.shape
        both = completion_ids.new_empty((N, 1 + C))  # [N, 1+C]: each row's length, its ids
        both[:, 0] = completion_mask.sum(1)
        both[:, 1:] = completion_ids
        ids = [row[1 : 1 + row[0]] for row in both.tolist()]
        return ids, self.batch_decode(ids)

    def apply_chat_template(
        self,
        messages: list[dict] | list[list[dict]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        tokenize: bool = False,
        return_dict: bool = True,
        **kwargs,
    ):
        """Render a conversation (list of {"role", "content"} dicts) to the prompt text; a list of
        conversations renders each (-> a list).

        tokenize=True gives token ids as transformers (v5) gives them: the rendered text encoded
        without adding special tokens (the template writes them); with return_dict (True, as
        there) the dict {"input_ids": ids, "attention_mask": [1, ...]} (a BatchEncoding's keys),
        else the ids alone. One conversation gives one list of ids, a batch a list per
        conversation. Unlike transformers, tokenize defaults to False and
        add_generation_prompt to True: nanogrpo's callers read the text of a prompt. Other
        keyword arguments are template variables (TRL's chat_template_kwargs); transformers'
        padding, truncation and tensor arguments are refused by name.

        The messages are seen as transformers shows them to a template: keys whose value is None are
        dropped (an OpenAI-style `"content": None` beside `tool_calls` reads as absent), and a
        message's reasoning given as `reasoning_content`, `thinking` or `reasoning` is offered under
        the first two names (Qwen3's template reads `reasoning_content`, gpt-oss's `thinking`)."""
        # transformers' arguments that shape a tokenizer's output: refused by name, not passed
        # to the template as variables
        shaping = ("padding", "truncation", "max_length", "return_tensors", "tokenizer_kwargs")
        refused = sorted(set(kwargs) & {*shaping, "return_assistant_tokens_mask"})
        if refused:
            raise ValueError(
                f"apply_chat_template: {refused} are not supported here; tokenize=True returns "
                "lists of ids (make a tensor of them with torch.tensor)"
            )
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template (no chat_template in tokenizer_config.json "
                "and no chat_template.jinja): use plain-text prompts instead"
            )
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        batched = bool(messages) and isinstance(messages[0], (list, tuple))
        conversations = messages if batched else [messages]
        context = {k: v for k, v in self.special_tokens.items() if v is not None}
        context.update(kwargs)
        texts = [
            self._template.render(
                messages=[_template_message(m) for m in conversation],
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
            for conversation in conversations
        ]
        if not tokenize:
            return texts if batched else texts[0]
        ids = [self.encode(text, add_special_tokens=False) for text in texts]  # [B][T_b]
        if not return_dict:
            return ids if batched else ids[0]
        masks = [[1] * len(x) for x in ids]
        if not batched:
            return {"input_ids": ids[0], "attention_mask": masks[0]}
        return {"input_ids": ids, "attention_mask": masks}

    def encode_prompt(self, prompt, tools=None, max_length=None, **template_kwargs) -> list[int]:
        """Token ids of a prompt as TRL makes them: a string is encoded with its special tokens; a
        message list is rendered with the chat template (generation prompt added, `tools`: JSON
        schemas for its tools= argument, template_kwargs: TRL's chat_template_kwargs), then
        encoded without adding special tokens again. max_length keeps the last that-many ids
        (TRL's max_prompt_length cuts from the left)."""
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        else:
            text = self.apply_chat_template(
                prompt, add_generation_prompt=True, tools=tools, **template_kwargs
            )
            ids = self.encode(text, add_special_tokens=False)
        if max_length is not None:
            ids = ids[-max_length:]
        return ids

    def save_pretrained(self, out_dir):
        """Write tokenizer.json, tokenizer_config.json (and chat_template.jinja when the template
        came from one) into the existing directory `out_dir`, loadable by transformers."""
        self.tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(self.config, f, indent=2, ensure_ascii=False)
        if (
            self.chat_template is not None
            and self.config.get("chat_template") != self.chat_template
        ):
            with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
                f.write(self.chat_template)


def char_level_tokenizer(chars: str) -> Tokenizer:
    """A tokenizer with one token per character of `chars` plus <|endoftext|> (the eos, also the
    pad) and nothing else: no chat template, and no other special token a policy could learn to
    emit invisibly. Characters outside `chars` encode as <|endoftext|>.

    What the embedded default trains with: a from-scratch model learns far faster over a handful
    of characters than over 256 bytes, and the result is still a standard tokenizer.json."""
    from tokenizers import Regex, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<|endoftext|>"] + sorted(set(chars)))}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<|endoftext|>"])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": 4096,
    }
    return Tokenizer(tok, config, None, {"eos_token_id": vocab["<|endoftext|>"]})
