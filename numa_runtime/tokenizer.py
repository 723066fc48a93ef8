"""Tokenizer (tokenizer.json + tokenizer_config.json + chat template) and incremental detokenizer.

Behaves like Hugging Face's fast tokenizer loaded from the same directory, without importing
transformers: the `tokenizers` library does the encoding and decoding, jinja2 (sandboxed) renders
the chat template with the helpers HF templates expect.
"""
import functools
import contextvars
import json
import logging
import os
import re
from datetime import datetime

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

log = logging.getLogger("numa_runtime")

__all__ = ["Tokenizer", "IncrementalDetokenizer", "ChatTemplateError"]

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                 "mask_token")
_HF_NO_LIMIT = int(1e30)  # NOTE: transformers' model_max_length where the config gives none
_NO_PADDING = (False, None, "do_not_pad")  # HF's padding values that pad nothing
_LLAMA_STYLE = {"LlamaTokenizer", "CodeLlamaTokenizer", "GemmaTokenizer"}
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # the first is what templates read


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character each byte is written as -> the byte."""
    kept = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(field: str, text: str) -> None:
    """ValueError if text holds a lone UTF-16 surrogate (JSON and Python strings allow them;
    text cannot: the tokenizer could not encode it)."""
    m = SURROGATE.search(text)
    if m:
        raise ValueError(f"{field} must be valid Unicode text, but it holds a lone surrogate "
                         f"(\\u{ord(m.group()):04x}) at character {m.start()}.")


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # NOTE: transformers' own tag


def _tag_final_text(messages: list[dict]) -> list[dict]:
    """A copy of messages whose last message's text (its content, or its last text part) ends
    with _CONTINUE_TAG; ValueError if it has no text to continue."""
    last = dict(messages[-1])
    content = last.get("content")
    if isinstance(content, (list, tuple)):
        parts = [dict(p) if isinstance(p, dict) else p for p in content]
        for p in reversed(parts):
            if isinstance(p, dict) and isinstance(p.get("text"), str):
                p["text"] += _CONTINUE_TAG
                break
        else:
            raise ValueError("continue_final_message: the final message has no text to continue.")
        last["content"] = parts
    elif content is None or isinstance(content, str):
        last["content"] = (content or "") + _CONTINUE_TAG
    return [*messages[:-1], last]


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template rejected the conversation."""


def _special_token(key: str) -> property:
    """A special token as the tokenizer config names it (HF's bos_token, unk_token, ...)."""
    return property(lambda self: self._special[key])


def _special_id(key: str) -> property:
    """That token's id (HF's unk_token_id, ...), None where the config names none."""
    return property(lambda self: self._token_id(self._special[key]))


class Tokenizer:
    """Encode/decode and chat formatting for one model directory.

    `encode(text)` equals HF `tokenizer.encode(text)`; `decode(ids)` equals HF
    `tokenizer.decode(ids, skip_special_tokens=...)` (special tokens kept unless skipped, as
    HF's default; no clean-up of tokenization spaces);
    `apply_chat_template` is HF's, defaults included; `render_chat(messages)` the text with a
    generation prompt (this runtime's chat).
    """

    def __init__(self, backend: _BackendTokenizer, config: dict, generation_config: dict,
                 chat_templates: dict):
        self._backend = backend
        self._special = {k: _token_content(config.get(k)) for k in _SPECIAL_KEYS}
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
        if isinstance(extra, dict):  # NOTE: transformers 5's named form ({"image_token": "<img>"})
            extra = list(extra.values())
        self._additional = [t for t in (_token_content(x) for x in (extra if isinstance(extra, list) else [])) if t]
        _apply_added_tokens_decoder(backend, config.get("added_tokens_decoder"))
        _mark_named_special(backend, [*self._special.values(), *self._additional])
        # NOTE: HF's: where padding goes and which end truncation cuts (the config's, settable)
        self.padding_side, self.truncation_side = (config.get(k) if config.get(k) in ("left", "right") else "right"
                                                   for k in ("padding_side", "truncation_side"))
        limit = config.get("model_max_length")
        self.model_max_length = int(limit) if isinstance(limit, (int, float)) and limit > 0 else _HF_NO_LIMIT
        # NOTE: tokenizer.json's post-processor decides the special tokens around the text (it
        # usually adds BOS itself), except for Llama-style classes, where HF (LlamaTokenizerFast)
        # rebuilds it from add_bos_token / add_eos_token: then those decide, and BOS is never
        # doubled. transformers 5 ignores the flags; they agree with tokenizer.json in real models.
        cls = (config.get("tokenizer_class") or "").removesuffix("Fast")
        self._bos_eos_from_config = cls in _LLAMA_STYLE
        self._add_bos = bool(config.get("add_bos_token", True))  # LlamaTokenizerFast defaults
        self._add_eos = bool(config.get("add_eos_token", False))
        self._chat_templates = chat_templates  # name -> jinja source; "default" if unnamed
        self.lowercase = False  # texts lowercased before encoding (an embedding model's do_lower_case)
        self._template_owner = "the model's chat template"  # what renders chats (errors name it)

        self.bos_token_id = self._token_id(self._special["bos_token"])
        if self.bos_token_id is None and isinstance(generation_config.get("bos_token_id"), int):
            self.bos_token_id = generation_config["bos_token_id"]
        eos = generation_config.get("eos_token_id")
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        self.eos_token_ids: set[int] = set(eos)
        eos_id = self._token_id(self._special["eos_token"])
        if eos_id is not None:
            self.eos_token_ids.add(eos_id)
        self.pad_token_id = self._token_id(self._special["pad_token"])

    @classmethod
    def from_dir(cls, model_dir: str) -> "Tokenizer":
        """Load tokenizer.json, tokenizer_config.json, generation_config.json, chat template."""
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{model_dir} has no tokenizer.json; numa_runtime needs a fast (tokenizers) "
                "tokenizer: save one with transformers' `tokenizer.save_pretrained(dir)`.")
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        generation_config = _read_json(os.path.join(model_dir, "generation_config.json"))
        try:
            backend = _BackendTokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
            from .config import UnsupportedModelError
            raise UnsupportedModelError(f"{path} is not a tokenizer.json the tokenizers library reads ({e}).") from None
        tok = cls(backend, config, generation_config, _load_chat_templates(model_dir, config))
        tok.name_or_path = model_dir
        return tok

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size, added tokens left out, as HF's `vocab_size` (`len(tokenizer)`
        counts them)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def use_chat_template(self, source: str) -> None:
        """Render chats with `source` (a Jinja template) instead of the model's (--chat-template)."""
        self._chat_templates = {"default": source}
        self._template_owner = "the --chat-template template"

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_templates)

    def encode(self, text: str, add_special_tokens: bool = True, padding=False, truncation=None,
               max_length: int | None = None, return_tensors: str | None = None, **kwargs):
        """Token ids of text. Other Python threads run meanwhile (the GIL is released). HF's
        padding, truncation/max_length (the special tokens kept, as HF keeps them) and
        return_tensors ("np", "pt": [1, n]) as HF's encode takes them."""
        _refuse_hf(kwargs, "encode", "add_special_tokens, padding, truncation, max_length and return_tensors")
        if padding not in _NO_PADDING:
            return self(text, add_special_tokens=add_special_tokens, padding=padding, truncation=truncation,
                        max_length=max_length, return_tensors=return_tensors, return_attention_mask=False)["input_ids"]
        ids = self._encode_one(text, add_special_tokens, truncation, max_length, padding)
        return ids if return_tensors is None else _tensors([ids], return_tensors)

    def prompt_ids(self, prompt, keep: int | None = None, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids (a text encoded; token ids as given), with `keep`
        (truncate_prompt_tokens) no more than its last `keep` (encode_last for a text)."""
        if isinstance(prompt, str):
            return (self.encode_last(prompt, keep, add_special_tokens) if keep else
                    self.encode(prompt, add_special_tokens=add_special_tokens))
        return prompt[-keep:] if keep else prompt

    def encode_last(self, text: str, keep: int, add_special_tokens: bool = True) -> list[int]:
        """The tokens of text within `keep`, as vLLM's truncate_prompt_tokens takes them: the text's
        first tokens cut, the special tokens the tokenizer adds around them kept (HF's truncation
        from the left; a BOS was cut with the text)."""
        return self._encode_one(text, add_special_tokens, True, keep, side="left")

    def _encode_one(self, text: str, add_special_tokens: bool, truncation=None, max_length: int | None = None,
                    padding=False, side: str | None = None) -> list[int]:
        if not (add_special_tokens and self._bos_eos_from_config):
            ids = self._encode(text, add_special_tokens)
        else:
            ids = self._encode(text, False)
            if self._add_bos and self.bos_token_id is not None:
                ids = [self.bos_token_id] + ids
            eos_id = self._token_id(self._special["eos_token"])
            if self._add_eos and eos_id is not None:
                ids = ids + [eos_id]
        # NOTE: as HF: max_length alone truncates unless it is padding's width
        if truncation is None and max_length is not None and padding in _NO_PADDING:
            truncation = True
        if truncation in (None, False, "do_not_truncate"):
            return ids
        limit = self.model_max_length if max_length is None else max_length
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"max_length must be a non-negative integer, got {max_length!r}.")
        if len(ids) <= limit:
            return ids
        # NOTE: the text's tokens are cut; the special tokens around them stay (HF's truncation)
        plain = self._encode(text, False) if add_special_tokens else ids
        at = next((i for i in range(len(ids) - len(plain) + 1) if ids[i:i + len(plain)] == plain), None)
        if at is None:  # NOTE: a post-processor that changes the text's tokens: cut the whole
            at, plain = 0, ids
        head, tail = ids[:at], ids[at + len(plain):]
        keep = max(0, limit - len(head) - len(tail))
        kept = plain[:keep] if (side or self.truncation_side) == "right" else plain[len(plain) - keep:]
        return (head + kept + tail)[:limit]

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters of text one token stands for: its longest entry
        (byte-level and byte-fallback spellings are at least as long as what they decode to)."""
        return max(1, max(map(len, self._backend.get_vocab(with_added_tokens=True)), default=1))

    def check_length(self, text: str, max_tokens: int) -> None:
        """ValueError when `text` surely has more than `max_tokens` tokens, known from its length
        alone (so an oversize prompt is refused without tokenizing it)."""
        limit = max_tokens * self.max_token_chars
        if len(text) > limit:
            raise ValueError(f"The prompt has {len(text)} characters, more than a context of {max_tokens} tokens "
                             f"can hold (at most {limit}); shorten it.")

    def encode_within(self, text: str, max_tokens: int, add_special_tokens: bool = True) -> list[int]:
        """encode(text), after check_length(text, max_tokens); the caller checks the token count."""
        self.check_length(text, max_tokens)
        return self.encode(text, add_special_tokens=add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # NOTE: encode_batch releases the GIL (encode holds it: a long prompt would freeze
        # every other thread, the HTTP server's included); one text gives the same ids.
        if self.lowercase:  # NOTE: sentence_bert_config.json's do_lower_case, as sentence-transformers and vLLM
            text = text.lower()
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def to_json(self) -> str:
        """The tokenizer.json this tokenizer was read from (for libraries that read it too)."""
        return self._backend.to_str()

    def decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        """The text of token ids (a list, an array, or one id as HF takes it). HF's
        clean_up_tokenization_spaces is taken when false (this never cleans up)."""
        if not kwargs and isinstance(token_ids, list) and (not token_ids or isinstance(token_ids[0], int)):
            return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)  # NOTE: the runtime's
        if kwargs.get("clean_up_tokenization_spaces"):
            raise ValueError("decode's clean_up_tokenization_spaces=True is not supported (the text is decoded as "
                             "generated, never cleaned up).")
        other = sorted(set(kwargs) - {"clean_up_tokenization_spaces"})
        if other:
            raise TypeError(f"decode() got unexpected keyword arguments {other}.")
        if isinstance(token_ids, (list, tuple)):
            nested = len(token_ids) > 0 and np.ndim(token_ids[0]) > 0
        else:
            nested = np.ndim(token_ids) > 1
        if nested:  # NOTE: transformers 5 decodes a batch of sequences so
            return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in token_ids]
        if np.ndim(token_ids) == 0:
            token_ids = [int(token_ids)]
        return self._backend.decode([int(t) for t in token_ids] if not isinstance(token_ids, list) else token_ids,
                                    skip_special_tokens=skip_special_tokens)

    def decoded_token(self, token_id: int) -> str:
        """One token decoded on its own, special tokens kept (vLLM's Logprob.decoded_token)."""
        return self.decode([int(token_id)], skip_special_tokens=False)

    def token_str(self, token_id: int) -> str:
        """The vocabulary's string of a token (HF convert_ids_to_tokens: "Ġcaf", "▁the", "<0x0A>")."""
        return self._backend.id_to_token(int(token_id)) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes token `token_id` stands for in a text, also where it holds only part
        of a character (a byte-level BPE piece, or a SentencePiece <0xNN> byte: decode() shows
        those as U+FFFD); a SentencePiece word piece with its leading space; an added or special
        token: its text. The bytes of a text's tokens join to the text."""
        added = self._added_text.get(token_id)
        if added is not None and self._pieces == "metaspace":  # NOTE: a lone decode strips its first space
            return added.replace("\u2581", " ").encode("utf-8")
        piece = self._backend.id_to_token(token_id)
        if piece is None or added is not None:
            return self.decode([token_id], skip_special_tokens=False).encode("utf-8")
        if self._pieces == "byte_level" and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        if self._pieces == "metaspace":
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    @functools.cached_property
    def _added_text(self) -> dict[int, str]:
        """The added tokens' text as the vocabulary holds it."""
        return {i: t.content for i, t in self._backend.get_added_tokens_decoder().items()}

    @functools.cached_property
    def skipped_ids(self) -> frozenset[int]:
        """The tokens decode(skip_special_tokens=True) leaves out of a text: the special added ones."""
        return frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    @functools.cached_property
    def _pieces(self) -> str:
        """How the vocabulary writes text: "byte_level" (GPT-2's byte alphabet), "metaspace"
        (SentencePiece's U+2581 for a space), or "" (decode each token)."""
        decoder = json.dumps(json.loads(self._backend.to_str()).get("decoder"))
        return "byte_level" if '"ByteLevel"' in decoder else "metaspace" if "\\u2581" in decoder else ""

    def apply_chat_template(self, conversation, tools: list[dict] | None = None, documents: list[dict] | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True, **kwargs):
        """Hugging Face's apply_chat_template, with its defaults (what scripts written against
        vLLM's LLM.get_tokenizer() call): the ids (tokenize=True; as input_ids of a dict unless
        return_dict=False, as transformers 5) of the conversation without a generation prompt
        unless asked; a list of conversations gives a list; `chat_template` a
        template's name or its Jinja source. render_chat is the same with this runtime's defaults
        (the text, and a generation prompt)."""
        if isinstance(conversation, (list, tuple)) and not conversation:
            raise ValueError("Cannot apply a chat template to an empty conversation.")
        if kwargs.pop("tokenizer_kwargs", None):
            raise ValueError("apply_chat_template's tokenizer_kwargs is not supported: the template's text is "
                             "encoded as it is, without special tokens added.")
        batch = isinstance(conversation, (list, tuple)) and all(isinstance(c, (list, tuple)) for c in conversation)
        add_generation_prompt = bool(add_generation_prompt)  # NOTE: HF's None is false (render_chat's None: true)
        return_dict = kwargs.setdefault("return_dict", True)  # NOTE: transformers 5's default
        out = [self.render_chat(c, add_generation_prompt=add_generation_prompt, tools=tools, documents=documents,
                                continue_final_message=continue_final_message, chat_template=chat_template,
                                tokenize=tokenize, **kwargs) for c in (conversation if batch else [conversation])]
        if not batch:
            return out[0]
        if tokenize and return_dict:
            return _Encoding(input_ids=[e["input_ids"] for e in out], attention_mask=[e["attention_mask"] for e in out])
        return out

    def render_chat(self, messages: list[dict], add_generation_prompt: bool | None = None,
                    tools: list[dict] | None = None, documents: list[dict] | None = None,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    tokenize: bool = False, **kwargs) -> str | list[int]:
        """Render the conversation to the prompt string. Extra kwargs reach the template
        (e.g. `enable_thinking=False`) and override the special tokens of the same name.

        As HF does: keys whose value is None are dropped from each message, and a message's
        reasoning (`reasoning_content`, `thinking` or `reasoning`) is given under the first two
        names too. As vLLM's chat: content None is "", and a tool call's `arguments` given as a
        JSON string (OpenAI's form) reach the template as the object. As llama.cpp: a
        "developer" message (newer OpenAI clients' system role) is a "system" one for a template
        that never names the developer role (such templates dropped it unseen). A message's
        content may be a string or a list of text parts ({"type": "text",
        "text": ...}): a template that loops over a message's content gets the parts, any other
        gets their texts joined by newlines (as vLLM picks its content format).
        `continue_final_message`: the prompt ends with the last message's text, for
        the model to go on with it (no generation prompt; what the template writes after that
        text is cut). `add_generation_prompt` defaults to true, but with continue_final_message.
        `chat_template`: the name of one of the model's templates ("tool_use"), or a Jinja source
        to render with instead of the model's. `tokenize=True`: the prompt's token ids.
        ChatTemplateError if the template raises, whatever it raises; ValueError for a request
        that cannot be rendered."""
        if chat_template is not None and not isinstance(chat_template, str):
            raise TypeError("chat_template must be the template's Jinja source (a string).")
        for name, items in (("tools", tools), ("documents", documents)):
            # NOTE: as HF's apply_chat_template (vLLM's), which refuses a tool that is no dict; a
            # Python function (HF makes its schema) is not converted here
            if items is None or (isinstance(items, (list, tuple)) and all(isinstance(t, dict) for t in items)):
                continue
            got = type(items).__name__ if not isinstance(items, (list, tuple)) else (
                "a list holding a " + next(type(t).__name__ for t in items if not isinstance(t, dict)))
            raise TypeError(f"{name} must be a list of dicts (a tool: its JSON schema, {{'type': 'function', "
                            f"'function': {{...}}}}), got {got}.")
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message cannot be true together with add_generation_prompt=true.")
            if not messages:
                raise ValueError("continue_final_message needs a message to continue.")
        add = (not continue_final_message) if add_generation_prompt is None else bool(add_generation_prompt)
        if continue_final_message:  # NOTE: as transformers: a tag after the final text marks where to cut
            messages = _tag_final_text(messages)
        return_dict = kwargs.pop("return_dict", False)  # NOTE: HF's keywords are not template variables
        for name in HF_RENDER_ARGS[2:]:  # NOTE: beyond tokenize and return_dict, taken here
            if kwargs.pop(name, None) not in (None, False):
                raise ValueError(f"apply_chat_template's {name} (Hugging Face's) is not supported: it gives the text, "
                                 "or with tokenize=True the ids as a list.")
        source, named = self._template_source(chat_template, tools)
        if named:
            chat_template = None  # NOTE: the model's own: errors name it so
        context = {k: v for k, v in self._special.items() if v is not None}
        context.update(kwargs)
        msgs = _template_messages(messages, *_content_format(source), developer="developer" in source)
        budget = _RANGE_BUDGET.set([MAX_TEMPLATE_RANGE_STEPS])
        try:
            text = _compile(source).render(messages=msgs, tools=tools,
                                           documents=documents, add_generation_prompt=add, **context)
        except _RangeBudgetError as e:
            owner = "the given chat template" if chat_template is not None else self._template_owner
            raise ChatTemplateError(f"{owner} {e}") from None
        except jinja2.TemplateError as e:
            owner = "the given chat template" if chat_template is not None else self._template_owner
            raise ChatTemplateError(f"{owner} rejected the conversation: {e}") \
                from e
        except Exception as e:  # NOTE: templates are code; a TypeError is as much a refusal
            owner = "the given chat template" if chat_template is not None else self._template_owner
            raise ChatTemplateError(f"{owner} failed on this conversation "
                                    f"({type(e).__name__}: {e}).") from e
        finally:
            _RANGE_BUDGET.reset(budget)
        if continue_final_message:  # NOTE: as transformers: cut at the tag (its text searched for failed where
            # it was empty, or where the template writes it again after the message: "m" in <|im_end|>)
            i = text.rfind(_CONTINUE_TAG.strip())
            if i < 0:
                owner = "the given chat template" if chat_template is not None else self._template_owner
                raise ChatTemplateError(f"{owner} does not write the final message's text, so there is nothing to "
                                        "continue (continue_final_message).")
            text = text[:i] if text.startswith(_CONTINUE_TAG, i) else text[:i].rstrip()
        # NOTE: `tokenize` as HF's (which defaults to it): the prompt's ids, the template's special
        # tokens as written (none added)
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return _Encoding(input_ids=ids, attention_mask=[1] * len(ids)) if return_dict else ids

    def resolve_template(self, chat_template: str | None) -> str | None:
        """A chat_template argument as vLLM reads it: a name of the model's templates, Jinja
        source, or a file holding it (read here); ValueError for a string that is none of them
        (a path that does not exist rendered as the prompt itself)."""
        if isinstance(chat_template, os.PathLike):
            chat_template = os.fspath(chat_template)
        if chat_template is None or not isinstance(chat_template, str) or chat_template in self._chat_templates:
            return chat_template
        if any(t in chat_template for t in ("{{", "{%", "{#", "\n")):  # NOTE: Jinja source (a path has none)
            return chat_template
        path = os.path.expanduser(chat_template)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
        names = ", ".join(sorted(self._chat_templates)) or "none"
        raise ValueError(f"chat_template {chat_template[:80]!r} is no Jinja template, no file and none of the "
                         f"model's template names ({names}).")

    def unread_variables(self, names: list[str], chat_template: str | None, tools) -> list[str]:
        """Those of `names` that the template chosen (as render_chat picks it) never reads, nor
        replaces a special token of ([] where it cannot be parsed: its render says why)."""
        from jinja2 import meta
        try:
            read = meta.find_undeclared_variables(_jinja_env().parse(self._template_source(chat_template, tools)[0]))
        except (jinja2.TemplateError, ChatTemplateError):
            return []
        return [n for n in names if n not in read and n not in self._special]

    def _template_source(self, chat_template: str | None, tools) -> tuple[str, bool]:
        """(the Jinja source render_chat renders with, whether chat_template named one of the model's)."""
        named = chat_template is not None and chat_template in self._chat_templates
        return (self._chat_templates[chat_template] if named else
                chat_template if chat_template is not None else self._pick_template(tools)), named

    def _pick_template(self, tools) -> str:
        if not self._chat_templates:
            raise ChatTemplateError(
                "this model has no chat template (none in tokenizer_config.json or chat_template.jinja, "
                "nor a GGUF's tokenizer.chat_template): send a plain prompt instead of chat messages, or "
                "give one (the server's --chat-template, Engine.chat's chat_template).")
        # NOTE: HF picks the "tool_use" template when tools are given and one exists.
        if tools and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" in self._chat_templates:
            return self._chat_templates["default"]
        if len(self._chat_templates) == 1:
            return next(iter(self._chat_templates.values()))
        raise ChatTemplateError(f"the model has several chat templates "
                                f"({sorted(self._chat_templates)}) and none named 'default'.")

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    # ---- Hugging Face's names, for scripts written against vLLM's LLM.get_tokenizer() --------
    is_fast = True
    name_or_path = ""          # the model directory (from_dir)

    def __call__(self, text, text_pair=None, add_special_tokens: bool = True, padding=False, truncation=None,
                 max_length: int | None = None, return_tensors: str | None = None,
                 return_attention_mask: bool | None = None, padding_side: str | None = None,
                 **kwargs) -> "_Encoding":
        """HF's tokenizer(text): input_ids and attention_mask; a list of texts gives a list of each.
        HF's padding (True/"longest", "max_length"; with the pad token, on padding_side),
        truncation/max_length and return_tensors ("np", "pt") as HF's; text pairs are refused."""
        if text_pair is not None:
            raise ValueError("Text pairs (text_pair) are not supported by this tokenizer; join the texts yourself.")
        _refuse_hf(kwargs, "the tokenizer call", "add_special_tokens, padding, padding_side, truncation, "
                   "max_length, return_tensors and return_attention_mask")
        side = self.padding_side if padding_side is None else padding_side
        if side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}.")
        batch = isinstance(text, (list, tuple))
        ids = [self._encode_one(t, add_special_tokens, truncation, max_length, padding)
               for t in (text if batch else [text])]
        masks = [[1] * len(i) for i in ids]
        if padding not in _NO_PADDING:
            if padding not in (True, "longest", "max_length"):
                raise ValueError(f"padding must be True, 'longest', 'max_length' or False, got {padding!r}.")
            if self.pad_token_id is None:
                raise ValueError("Asking to pad, but this tokenizer has no padding token (its config names none).")
            width = max(map(len, ids), default=0)
            if padding == "max_length":  # NOTE: HF's: max_length, else a model_max_length the config gives
                width = max_length if max_length is not None else (
                    self.model_max_length if self.model_max_length < _HF_NO_LIMIT else width)
            for i, m in zip(ids, masks):
                pad = max(0, width - len(i))
                if side == "left":
                    i[:0], m[:0] = [self.pad_token_id] * pad, [0] * pad
                else:
                    i.extend([self.pad_token_id] * pad)
                    m.extend([0] * pad)
        if return_tensors is not None:
            ids, masks = _tensors(ids, return_tensors), _tensors(masks, return_tensors)
        elif not batch:
            ids, masks = ids[0], masks[0]
        out = _Encoding(input_ids=ids)
        if return_attention_mask is not False:
            out["attention_mask"] = masks
        return out

    def __len__(self) -> int:
        """Number of token ids, added tokens included (HF's `len(tokenizer)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    # NOTE: HF's <key> and <key>_id of each special token the tokenizer config names (eos_token_id
    # below; bos_token_id and pad_token_id are set in __init__)
    eos_token = _special_token("eos_token")
    bos_token = _special_token("bos_token")
    pad_token = _special_token("pad_token")
    unk_token, unk_token_id = _special_token("unk_token"), _special_id("unk_token")
    sep_token, sep_token_id = _special_token("sep_token"), _special_id("sep_token")
    cls_token, cls_token_id = _special_token("cls_token"), _special_id("cls_token")
    mask_token, mask_token_id = _special_token("mask_token"), _special_id("mask_token")

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer config's EOS (HF's); generation stops at every id of eos_token_ids."""
        found = self.named_eos_token_id
        return found if found is not None else min(self.eos_token_ids, default=None)

    @property
    def named_eos_token_id(self) -> int | None:
        """The id of the EOS the tokenizer config names; None where it names none (vLLM's
        tokenizer.eos_token_id then, where eos_token_id falls back to an id of eos_token_ids)."""
        return self._token_id(self._special["eos_token"])

    @property
    def all_special_tokens(self) -> list[str]:
        """The tokenizer config's special tokens (bos, eos, unk, pad, ..., then its additional
        ones), as HF lists them."""
        return list(dict.fromkeys([t for t in self._special.values() if t is not None] + self._additional))

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in (self._token_id(t) for t in self.all_special_tokens) if i is not None]

    @property
    def chat_template(self) -> str | None:
        return self._chat_templates.get("default") or next(iter(self._chat_templates.values()), None)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def get_added_vocab(self) -> dict[str, int]:
        """HF's: the added tokens' text -> id."""
        return {t.content: i for i, t in self._backend.get_added_tokens_decoder().items()}

    def convert_tokens_to_ids(self, tokens):
        """A token's id (None if it has none), or a list of them."""
        unk = self.unk_token_id  # NOTE: HF's: a token outside the vocabulary is the unknown token's id
        if isinstance(tokens, str):
            found = self._backend.token_to_id(tokens)
            return unk if found is None else found
        return [unk if i is None else i for i in (self._backend.token_to_id(t) for t in tokens)]

    def convert_ids_to_tokens(self, ids):
        """A token id's token (as the vocabulary spells it), or a list of them."""
        if isinstance(ids, (list, tuple)):
            return [self._backend.id_to_token(int(i)) for i in ids]
        return self._backend.id_to_token(int(ids))

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        """HF's tokenize: the tokens of text as the vocabulary spells them (no BOS unless asked)."""
        return self.convert_ids_to_tokens(self.encode(text, add_special_tokens=add_special_tokens))

    def convert_tokens_to_string(self, tokens) -> str:
        """Tokens (as the vocabulary spells them) back to text, through the tokenizer's decoder."""
        decoder = self._backend.decoder  # NOTE: HF's: the tokens through the decoder, known to the vocabulary or not
        return decoder.decode(list(tokens)) if decoder is not None else " ".join(tokens)

    @property
    def special_tokens_map(self) -> dict:
        """HF's special_tokens_map: bos_token, eos_token, ... as the tokenizer config names them."""
        return {k: v for k, v in self._special.items() if v is not None}

    @property
    def vocab(self) -> dict[str, int]:
        return self.get_vocab()


def _refuse_hf(kwargs: dict, where: str, takes: str) -> None:
    """One sentence naming Hugging Face keywords this tokenizer does not take (not a TypeError)."""
    if kwargs:
        raise ValueError(f"{where} does not support {', '.join(sorted(kwargs))} (Hugging Face's keyword"
                         f"{'s' if len(kwargs) > 1 else ''}); it takes {takes}.")


def _tensors(rows: list[list[int]], kind: str):
    """Equal-length rows as HF's return_tensors: "np" (int64) or "pt" (torch, int64)."""
    if len({len(r) for r in rows}) > 1:
        raise ValueError("return_tensors needs sequences of one length; pass padding=True as well.")
    if kind == "np":
        return np.array(rows, dtype=np.int64).reshape(len(rows), -1)
    if kind == "pt":
        import torch
        return torch.tensor(np.array(rows, dtype=np.int64).reshape(len(rows), -1))
    raise ValueError(f"return_tensors must be 'np' or 'pt', got {kind!r}.")


class _Encoding(dict):
    """HF's BatchEncoding as far as scripts read it: enc["input_ids"] or enc.input_ids."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one token at a time.

    Each `add(token_id)` decodes only a small window (the vLLM prefix/read offset scheme):
    `ids[prefix_offset:read_offset]` was emitted already and gives the left context, and the
    delta is what `ids[prefix_offset:]` adds to it. Text ending in U+FFFD (a UTF-8 character
    split across tokens) is held back until a later token completes it; `flush()` releases what
    is held at the end of the stream. With no prompt (or any byte-level BPE tokenizer) the deltas
    joined equal `tokenizer.decode(output_ids)` for output that is valid UTF-8 (a run of
    byte-fallback tokens that is not: the window's decode keeps the valid bytes a whole decode
    may replace, as vLLM's windows do). With a prompt, its last tokens are the left context, so
    a sentencepiece first token keeps its leading space, as in decode(prompt + output) minus
    decode(prompt).
    """

    _CONTEXT = (5, 24)  # prompt tokens of left context: the fewest that decode whole, as vLLM

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def __init__(self, tokenizer: Tokenizer, prompt_ids=(), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        prompt = list(prompt_ids)
        lo, hi = self._CONTEXT
        # NOTE: the last 5 tokens can start inside a character (byte-fallback pieces): a byte run
        # that decodes to U+FFFD, left context that would cost a sentencepiece first token its
        # space; longer ones may start on a character boundary
        # NOTE: a prompt ending inside a character (a max_tokens cut, continued from its ids) keeps
        # that tail unread: the output token that completes the character emits all of it, as
        # vLLM's incremental detokenizer does (dropping the tail gave U+FFFD)
        tail = self._open_tail(prompt)
        body = prompt[:len(prompt) - tail]
        self._ids = body[-lo:]
        if "\ufffd" in self._decode(self._ids):
            for n in range(lo + 1, min(len(body), hi) + 1):
                if "\ufffd" not in self._decode(body[-n:]):
                    self._ids = body[-n:]
                    break
        self._prefix_text = self._decode(self._ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._ids += prompt[len(prompt) - tail:]

    def _open_tail(self, prompt: list[int]) -> int:
        return open_tail(self._tokenizer, prompt, self._skip)

    def add(self, token_id: int) -> str:
        """The text this token adds; "" while it only holds part of a character."""
        self._ids.append(int(token_id))
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd"):
            return ""
        return self._emit(new_text)

    def flush(self) -> str:
        """Whatever is held back (possibly ending in U+FFFD); call when the sequence ends."""
        new_text = self._decode(self._ids[self._prefix_offset:])
        return self._emit(new_text) if len(new_text) > len(self._prefix_text) else ""

    def _emit(self, new_text: str) -> str:
        if new_text.startswith(self._prefix_text) and not self._rewrote_bytes(new_text):
            delta = new_text[len(self._prefix_text):]
        else:
            # NOTE: the window's decode rewrote text already emitted: a byte-fallback run that ends
            # in an open character decodes whole to U+FFFD (a character sent before it included),
            # and slicing it by the old text's length sent U+FFFD for bytes sent already
            delta = self._unread_text()
        # NOTE: the window slides: the tokens just emitted become the next left context.
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:])
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _rewrote_bytes(self, new_text: str) -> bool:
        """Whether the window's decode turned bytes emitted already into U+FFFD: a byte-fallback
        run that is not UTF-8 decodes to U+FFFD for every byte of it, the left context's bytes
        included, and where a decoder strips the window's leading space (SentencePiece's Strip)
        the left context's text is "" though its byte was sent as " "."""
        if "\ufffd" not in new_text:
            return False
        return new_text.count("\ufffd") > self._prefix_text.count("\ufffd") + self._unread_text().count("\ufffd")

    def _unread_text(self) -> str:
        """The text of the tokens not emitted yet from their own bytes (U+FFFD for bytes that
        make no character)."""
        ids = self._ids[self._read_offset:]
        token_bytes = getattr(self._tokenizer, "token_bytes", None)
        if token_bytes is None:
            return self._decode(ids)
        # NOTE: the tokens decode() leaves out (the backend's special ones), where the tokenizer says
        skipped = getattr(self._tokenizer, "skipped_ids", None)
        skip = set(self._tokenizer.all_special_ids if skipped is None else skipped) if self._skip else set()
        return b"".join(token_bytes(t) for t in ids if t not in skip).decode("utf-8", "replace")


def open_tail(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> int:
    """How many last tokens of `ids` hold the start of a character they do not finish (0 when
    they end on a character boundary): an IncrementalDetokenizer given them as its prompt
    emits that character with the output token that completes it."""
    def decode(part):
        return tokenizer.decode(part, skip_special_tokens=skip_special_tokens) if part else ""
    n = len(ids)
    for t in range(0, min(4, n)):  # NOTE: a character is at most 4 bytes: 4 tokens
        if not decode(ids[max(0, n - t - 8):n - t]).endswith("\ufffd"):
            break
    else:
        return 0
    if t and hasattr(tokenizer, "token_bytes"):
        try:  # NOTE: a typed U+FFFD (or other whole text) is no open character
            b"".join(tokenizer.token_bytes(i) for i in ids[n - t:]).decode("utf-8")
            return 0
        except UnicodeDecodeError:
            pass
    return t


# NOTE: Hugging Face apply_chat_template's own arguments: never template variables
HF_RENDER_ARGS = ("tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length",
                  "return_assistant_tokens_mask")


def _compile(source: str) -> jinja2.Template:
    return _jinja_env().from_string(source)


def _template_messages(messages: list[dict], parts: bool = False, wrap_strings: bool = False,
                       developer: bool = True) -> list[dict]:
    """Messages as HF hands them to templates: None-valued keys dropped, but content None is ""
    (OpenAI clients send it beside tool calls; vLLM's), tool calls' JSON-string arguments parsed
    (vLLM's), reasoning aliased as `reasoning_content` and `thinking`; a list of text parts as
    it is where the template loops over content (`parts`), else joined by newlines (vLLM's
    "string" content format); a string as it is (as HF hands it), or as one text part where the
    template only takes parts (`wrap_strings`, as vLLM). Not `developer` (the template never
    names that role): a developer message is a system one."""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise ValueError(f"Each message must be a dict with a role, got {type(m).__name__}.")
        had_content = "content" in m
        m = {k: v for k, v in m.items() if v is not None}
        if had_content and "content" not in m:
            m["content"] = ""
        if m.get("role") == "developer" and not developer:
            m["role"] = "system"
        if isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [template_call(c) for c in m["tool_calls"]]
        if "content" in m and (wrap_strings or not isinstance(m["content"], str)):
            texts = _text_parts(m["content"])
            m["content"] = [{"type": "text", "text": t} for t in texts] if parts else "\n".join(texts)
        reasoning = next((m[k] for k in _REASONING_KEYS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def template_call(call):
    """A tool call with its `arguments` as the object a JSON string gives (not a JSON object,
    or empty: {}, as the server does); any other call as it is."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"]) if fn["arguments"] else {}
    except ValueError:
        args = None
    if not isinstance(args, dict):
        log.warning("tool call %r: arguments are not a JSON object; the template sees {}.", fn.get("name"))
        args = {}
    return {**call, "function": {**fn, "arguments": args}}


def _text_parts(content) -> list[str]:
    """The texts of a message's content: a string, or a list of {"type": "text", "text": ...}
    parts (or of strings, or of OpenAI's {"type": "refusal", "refusal": ...}); ValueError for any
    other part."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, dict) and part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])  # NOTE: an OpenAI assistant's refusal, replayed: its text, as vLLM
        elif isinstance(part, dict) and part.get("type") == "text":
            raise ValueError(f"A text content part needs its 'text' as a string, got {part.get('text')!r}.")
        elif isinstance(part, dict) and part.get("type") == "refusal":
            raise ValueError(f"A refusal content part needs its 'refusal' as a string, got {part.get('refusal')!r}.")
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"Only text content parts ({{'type': 'text', 'text': ...}}, or an assistant's "
                             f"'refusal') are supported, got type {kind!r}.")
    return texts


@functools.lru_cache(maxsize=64)
def _content_format(source: str) -> tuple[bool, bool]:
    """(parts, wrap_strings): whether the template loops over a message's content, and whether
    it then has no branch for a string (no `is string`/`mapping`/... test anywhere), so that a
    string content must reach it as one text part (vLLM's "openai" format) and not as letters."""
    from jinja2 import nodes
    if not _iterates_content(source):
        return False, False
    tree = _jinja_env().parse(source)
    kinds = {"string", "mapping", "iterable", "sequence"}
    names = {a.target.name for a in tree.find_all(nodes.Assign)
             if isinstance(a.target, nodes.Name) and _is_content(a.node)}
    # NOTE: a test of content itself (or of a variable set from it), not of anything else
    return True, not any(t.name in kinds and (_is_content(t.node) or (isinstance(t.node, nodes.Name)
                                                                     and t.node.name in names))
                         for t in tree.find_all(nodes.Test))


@functools.lru_cache(maxsize=64)
def _iterates_content(source: str) -> bool:
    """Whether a template loops over a message's content (vLLM's "openai" content format: it
    wants lists of parts), directly or through a variable set from it."""
    from jinja2 import nodes
    try:
        tree = _jinja_env().parse(source)
    except jinja2.TemplateError:
        return False
    is_content = _is_content
    names = {a.target.name for a in tree.find_all(nodes.Assign)
             if isinstance(a.target, nodes.Name) and is_content(a.node)}
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, nodes.Filter):
            it = it.node
        if is_content(it) or (isinstance(it, nodes.Name) and it.name in names):
            return True
    return False


def _is_content(node) -> bool:
    """A template expression that reads a message's content (m.content, m['content'], filtered)."""
    from jinja2 import nodes
    while isinstance(node, (nodes.Filter, nodes.Test)):
        node = node.node
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return isinstance(node, nodes.Getattr) and node.attr == "content"


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # NOTE: jinja's own tojson escapes HTML characters; HF templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` only: the builtin type would hand templates its
    unbound methods (`dict.update(messages[0], ...)` mutates what the sandbox keeps immutable)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace() without underscore-prefixed attributes (as HF's sandbox hardening)."""

    def __init__(*args, **kwargs):  # NOTE: no named self, so `namespace(self=...)` still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed attributes on a namespace ({name!r}).")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


# NOTE: range() steps one render may take over all its calls: the sandbox caps each range (100000), not
# their nesting, and a template looping on a chat_template_kwargs value kept a thread busy for ever (six
# such requests held every tokenizing thread, and the server answered nothing more)
MAX_TEMPLATE_RANGE_STEPS = 2_000_000
_RANGE_BUDGET: contextvars.ContextVar = contextvars.ContextVar("numa_runtime_range_budget", default=None)


class _RangeBudgetError(jinja2.exceptions.SecurityError):
    pass


def _bounded_range(*args):
    """The sandbox's range, counted against the render's budget."""
    r = jinja2.sandbox.safe_range(*args)
    budget = _RANGE_BUDGET.get()
    if budget is not None:
        budget[0] -= len(r)
        if budget[0] < 0:
            raise _RangeBudgetError(f"looped over more than {MAX_TEMPLATE_RANGE_STEPS:,} range() steps for this "
                                    "conversation (chat_template_kwargs too large for it?).")
    return r


_ENV = None


def _jinja_env() -> ImmutableSandboxedEnvironment:
    global _ENV
    if _ENV is None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["dict"] = _Dict()
        env.globals["namespace"] = _Namespace
        env.globals["range"] = _bounded_range
        _ENV = env
    return _ENV


def _load_chat_templates(model_dir: str, config: dict) -> dict:
    """name -> template source, from the first found of: chat_template.jinja (with
    additional_chat_templates/*.jinja), tokenizer_config.json's chat_template (a string, or a list
    of {"name", "template"}), chat_template.json. NOTE: as transformers' tokenizer and vLLM for a
    text model: chat_template.json is a processor's file, read only where the tokenizer has none."""
    templates = {}
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            templates["default"] = f.read()
        extra_dir = os.path.join(model_dir, "additional_chat_templates")
        if os.path.isdir(extra_dir):
            for name in sorted(os.listdir(extra_dir)):
                if name.endswith(".jinja"):
                    with open(os.path.join(extra_dir, name), encoding="utf-8") as f:
                        templates[name[:-len(".jinja")]] = f.read()
        return templates
    source = config.get("chat_template")
    if source is None:
        source = _read_json(os.path.join(model_dir, "chat_template.json")).get("chat_template")
    if isinstance(source, str):
        templates["default"] = source
    elif isinstance(source, list):
        templates.update({t["name"]: t["template"] for t in source})
    return templates


def _token_content(token) -> str | None:
    # tokenizer_config stores a special token as a string or as a serialized AddedToken dict
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            from .config import UnsupportedModelError
            raise UnsupportedModelError(f"{path} is not valid JSON ({e}).") from None


def _apply_added_tokens_decoder(backend: _BackendTokenizer, decoder) -> None:
    """tokenizer_config's added_tokens_decoder as transformers applies it over tokenizer.json: an
    added token's special, lstrip, rstrip and single_word flags are the config's (they were
    tokenizer.json's alone), and a token the config adds at the next id that tokenizer.json lacks
    is added. An entry whose id tokenizer.json holds with another text is left to tokenizer.json."""
    if not isinstance(decoder, dict):
        return
    from tokenizers import AddedToken
    have = backend.get_added_tokens_decoder()
    entries = sorted((int(k), v) for k, v in decoder.items()
                     if str(k).isdigit() and isinstance(v, dict) and isinstance(v.get("content"), str) and v["content"])
    for i, v in entries:
        cur = have.get(i)
        flags = {f: bool(v.get(f, getattr(cur, f, False))) for f in ("single_word", "lstrip", "rstrip", "special")}
        if cur is not None:
            if cur.content != v["content"] or all(getattr(cur, f) == flags[f] for f in flags):
                continue
            token = AddedToken(v["content"], normalized=cur.normalized, **flags)
        elif backend.get_vocab_size(with_added_tokens=True) == i and backend.token_to_id(v["content"]) is None:
            token = AddedToken(v["content"], normalized=bool(v.get("normalized", not flags["special"])), **flags)
        else:
            continue
        (backend.add_special_tokens if flags["special"] else backend.add_tokens)([token])


def _mark_named_special(backend: _BackendTokenizer, names: list) -> None:
    """The tokens the tokenizer config names (bos, eos, unk, pad, its additional ones) are special
    tokens of the backend, as transformers makes them when it loads the folder: matched in text as
    one token and left out where special tokens are skipped (a pad token that tokenizer.json holds
    as a normal token stayed in texts). Their ids do not change; a name the vocabulary lacks is
    left out."""
    from tokenizers import AddedToken
    added = {t.content: t for t in backend.get_added_tokens_decoder().values()}
    mark = []
    for name in dict.fromkeys(n for n in names if n):
        cur = added.get(name)
        if cur is not None and not cur.special:
            mark.append(AddedToken(name, single_word=cur.single_word, lstrip=cur.lstrip, rstrip=cur.rstrip,
                                   normalized=cur.normalized, special=True))
        elif cur is None and backend.token_to_id(name) is not None:
            mark.append(AddedToken(name, normalized=False, special=True))
    if mark:
        backend.add_special_tokens(mark)
