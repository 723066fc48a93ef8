"""The tokenizer of a GGUF file (its `tokenizer.ggml.*` metadata) as tokenizer.json +
tokenizer_config.json, built with the `tokenizers` library.

Two GGUF tokenizer models:
  - "gpt2": byte-level BPE with the file's merges. `tokenizer.ggml.pre` names the split before
    BPE (llama.cpp's names): GPT-2's regex, GPT-2's after each digit alone (SmolLM, StarCoder),
    or the regexes of Llama 3, Qwen2/2.5/3 (with their NFC normalizer), Qwen3.5, Tekken, GPT-4o
    and Seed-Coder, as the models' own tokenizer.json write them, or the regex sequences of
    DeepSeek LLM/Coder/V3 and Viking. Llama 3 and Tekken emit a word that is itself in the
    vocabulary as that token (BPE `ignore_merges`).
  - "llama": SentencePiece BPE (Llama 2, Mistral 7B, TinyLlama). The file has pieces and scores,
    no merges: SentencePiece merges the adjacent pair whose joined piece scores highest, which is
    BPE with every split of every normal piece as a merge ranked by that piece's score (as
    transformers' converter from SentencePiece builds them). Spaces become U+2581, each text
    between special tokens gets one in front (`tokenizer.ggml.add_space_prefix`, as llama.cpp and
    transformers' legacy Llama tokenizer), and characters outside the vocabulary fall back to
    byte tokens <0xXX>.
Control tokens (type 3) and the unknown token (type 2) are special tokens (matched in text,
dropped by skip_special_tokens);
user-defined ones (type 4) are matched in text and kept. BOS/EOS are added around a text as
`tokenizer.ggml.add_bos_token` / `add_eos_token` say (llama.cpp's per-model defaults otherwise).
The stop tokens are EOS plus the file's end-of-turn / end-of-message tokens (`eot_token_id`,
`eom_token_id`) and the tokens whose text ends a turn (`<|im_end|>`, `<|eot_id|>`, ...):
`stop_token_ids(meta)`.
"""
from __future__ import annotations

import json
import logging
import os

from .config import UnsupportedModelError

log = logging.getLogger("numa_runtime")

# GGUF token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes as the models' tokenizer.json files write them
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
              r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_RE = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
              r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
              r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# GPT-4o's (o200k: Phi-4-mini, Kanana 2), Seed-Coder's, and the regex sequences of DeepSeek LLM,
# DeepSeek Coder, DeepSeek-V3 and Viking (each splits the pieces of the one before)
_GPT4O_RE = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
             r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SEED_CODER_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
                  r"|\s+(?!\S)|\s+")
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM_RES = (  # NOTE: its letters as DeepSeek LLM's tokenizer.json lists them
    r"[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    _CJK,
    r"\p{N}+")
_DEEPSEEK_CODER_RES = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")
_DEEPSEEK3_RES = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_VIKING_RES = (" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+", r"\p{N}")
# NOTE: llama.cpp's split of a BPE vocabulary with no pre-tokenizer named (older converters) or
# "default": runs of punctuation apart, GPT-2's regex, numbers apart, then digits in threes
_DEFAULT_RES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]")

# tokenizer.ggml.pre -> (split, NFC normalizer, ignore_merges, llama.cpp's default for add_bos)
# split: "gpt2" (GPT-2's regex), "digits" (each digit alone, then GPT-2's), a regex, or a tuple
# of regexes each splitting the pieces of the one before (llama.cpp's regex sequences)
BPE_PRE = {
    "default": (_DEFAULT_RES, False, False, False),
    **{name: ("gpt2", False, False, False) for name in ("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "roberta-bpe",
                                                         "trillion", "jais", "gigachat", "a.x-4.0", "mellum",
                                                         "granite-docling")},
    **{name: ("digits", False, False, False) for name in ("smollm", "starcoder", "refact", "codeshell",
                                                           "command-r", "exaone", "minerva-7b", "mellum2")},
    **{name: (_LLAMA3_RE, False, True, True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3",
                                                          "pixtral", "falcon-h1", "midm-2.0", "lfm2")},
    **{name: (_LLAMA3_RE, False, False, False) for name in ("smaug-bpe", "dbrx")},  # NOTE: dbrx: cl100k
    **{name: (_GPT4O_RE, False, False, False) for name in ("gpt-4o", "llama4", "kanana2", "talkie")},
    "seed-coder": (_SEED_CODER_RE, False, False, False),
    "deepseek-llm": (_DEEPSEEK_LLM_RES, False, False, False),
    "deepseek-coder": (_DEEPSEEK_CODER_RES, False, False, False),
    "deepseek-v3": (_DEEPSEEK3_RES, False, False, False),
    "viking": (_VIKING_RES, False, False, False),
    **{name: (_QWEN2_RE, True, False, False) for name in ("qwen2", "deepseek-r1-qwen", "megrez")},
    "qwen35": (_QWEN35_RE, False, False, False),
    "tekken": (_TEKKEN_RE, False, True, True),
}


def normalize_vocab(meta: dict, where: str = "") -> None:
    """The vocabulary as llama.cpp's loader takes it, in `meta` itself: an empty token is named
    "[EMPTY_<id>]"; a token whose text ends a turn (CONTROL_TEXTS: "<|im_end|>", ...) is a
    control token whatever type the file gives it (a normal one was matched in text as pieces);
    a string at two ids is refused (llama.cpp refuses it too: one id would have no text)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        return
    empty = [f"[EMPTY_{i}]" for i, t in enumerate(tokens) if t == ""]
    if empty:
        tokens = [t if t != "" else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        log.warning("%sthe GGUF vocabulary holds %d empty token(s); they are named %s as llama.cpp names them.",
                    where, len(empty), ", ".join(empty[:3]) + (", ..." if len(empty) > 3 else ""))
    seen: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if seen.setdefault(t, i) != i:  # NOTE: one id of the two would have no text (a text map keeps one)
            raise UnsupportedModelError(f"{where}the GGUF vocabulary holds the token {t!r} twice (ids {seen[t]} "
                                        f"and {i}), which llama.cpp refuses too; convert the model again.")
    meta["tokenizer.ggml.tokens"] = list(tokens)
    types = list(meta.get("tokenizer.ggml.token_type") or ())
    if len(types) == len(tokens):
        promoted = [i for i, (t, k) in enumerate(zip(tokens, types)) if t in CONTROL_TEXTS and k != CONTROL]
        for i in promoted:
            log.warning("%sGGUF token %d %r ends a turn but is not a control token; it is taken as one, as "
                        "llama.cpp takes it.", where, i, tokens[i])
            types[i] = CONTROL
        meta["tokenizer.ggml.token_type"] = types


def spm_defaults(meta: dict, where: str = "") -> None:
    """A SentencePiece ('llama') vocabulary's BOS and unknown token where the file names none, in
    `meta` itself, as llama.cpp takes them: BOS token 1, unknown the UNKNOWN-type token (else 0).
    Without an unknown token, text outside the vocabulary was dropped without a word."""
    if meta.get("tokenizer.ggml.model") != "llama":
        return
    tokens = list(meta.get("tokenizer.ggml.tokens") or ())
    types = list(meta.get("tokenizer.ggml.token_type") or ())
    unk = next((i for i, k in enumerate(types) if k == UNKNOWN), 0) if len(types) == len(tokens) else 0
    for name, default, role in (("tokenizer.ggml.bos_token_id", 1, "BOS"),
                                ("tokenizer.ggml.unknown_token_id", unk, "unknown")):
        if name not in meta and default < len(tokens):
            meta[name] = default
            log.warning("%sthe GGUF names no %s token (%s); it is token %d (%r), as llama.cpp takes a "
                        "SentencePiece vocabulary's.", where, role, name, default, tokens[default])


def write_tokenizer(meta: dict, out_dir: str, prefix: str, source: str = "") -> None:
    """tokenizer.json and tokenizer_config.json in out_dir for the GGUF metadata `meta`
    (`prefix`: the architecture's key prefix, e.g. "qwen2."; `source`: the file, for errors)."""
    kind = meta.get("tokenizer.ggml.model")
    where = f"{source}: " if source else ""
    meta = dict(meta)
    normalize_vocab(meta, where)
    if kind == "gpt2":
        tok, add_bos_default = _bpe(meta, where)
    elif kind == "llama":
        meta = dict(meta)
        spm_defaults(meta, where)
        tok, add_bos_default = _spm(meta, where)
    elif kind is None:
        raise UnsupportedModelError(f"{where}the GGUF holds no tokenizer (no tokenizer.ggml.model); convert the "
                                    "model again with its tokenizer.")
    else:
        raise UnsupportedModelError(f"{where}GGUF tokenizer model {kind!r} is not supported; numa_runtime "
                                    "reads byte-level BPE ('gpt2') and SentencePiece ('llama').")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    # NOTE: as llama.cpp (and Phi-3's tokenizer_config): Phi-3's special tokens (control, user-defined
    # and unknown types: </s> is user-defined in its GGUF) take the whitespace after them (its
    # template writes "<|user|>\n"), but <unk>, <s> and <|endoftext|>
    rstrip = (({t for t, k in zip(tokens, types) if k in (CONTROL, USER_DEFINED, UNKNOWN)} | {"</s>"} & set(tokens))
              - {"<unk>", "<s>", "<|endoftext|>"} if prefix == "phi3." and kind == "llama" else set())
    _add_special(tok, tokens, types, rstrip)

    def token(key):
        i = meta.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    around = []  # (token, id) of BOS / EOS where they are added around a text, else None
    for flag, name in ((add_bos, "bos"), (add_eos, "eos")):
        key = f"tokenizer.ggml.{name}_token_id"
        if flag and token(key) is None:
            raise UnsupportedModelError(f"{where}the GGUF asks for {name.upper()} around each text but names "
                                        "no such token.")
        around.append((token(key), int(meta[key])) if flag else None)
    _post_processor(tok, kind == "gpt2", *around)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "add_prefix_space": False,
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id") or token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(prefix + "context_length", 2048)),
        "tokenizer_class": "PreTrainedTokenizerFast",  # NOTE: tokenizer.json as it is, BOS included
    }
    # NOTE: gguf-py writes named templates (tool_use, rag) as tokenizer.chat_template.<name>, listed
    # in tokenizer.chat_templates: tokenizer_config's list form, which picks tool_use for tools
    named = [n for n in meta.get("tokenizer.chat_templates") or () if f"tokenizer.chat_template.{n}" in meta]
    if named:
        cfg["chat_template"] = ([{"name": "default", "template": meta["tokenizer.chat_template"]}]
                                if "tokenizer.chat_template" in meta else [])
        cfg["chat_template"] += [{"name": n, "template": meta[f"tokenizer.chat_template.{n}"]} for n in named]
    elif "tokenizer.chat_template" in meta:
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


# Tokens that end a turn by their text, whatever the file names (llama.cpp's vocabulary loader
# treats these as end of generation too): a chat GGUF whose EOS is the base model's end token
# still stops where its template closes a turn.
END_OF_TURN_TEXTS = frozenset((
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "_<EOT>", "<|END_OF_TURN_TOKEN|>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "<|return|>", "<|call|>", "<|end_of_turn|>"))
# NOTE: those whose token llama.cpp's loader makes a control token whatever the file's type (its
# end-of-generation texts; Command-R's and OpenChat's end of turn it leaves as typed)
CONTROL_TEXTS = END_OF_TURN_TEXTS - {"<|END_OF_TURN_TOKEN|>", "<|end_of_turn|>"}


def stop_token_ids(meta: dict) -> list[int]:
    """EOS, the end-of-turn and end-of-message tokens the file names, then the tokens whose text
    ends a turn (END_OF_TURN_TEXTS), each once."""
    ids, tokens = [], meta.get("tokenizer.ggml.tokens")
    n = len(tokens) if tokens is not None else float("inf")
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        # NOTE: as llama.cpp: an id outside the vocabulary is taken as unset
        if key in meta and 0 <= int(meta[key]) < n and int(meta[key]) not in ids:
            ids.append(int(meta[key]))
    for i, text in enumerate(meta.get("tokenizer.ggml.tokens") or ()):
        if text in END_OF_TURN_TEXTS and i not in ids:
            ids.append(i)
    return ids


def _bpe(meta: dict, where: str):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre") or "default"  # NOTE: "" as llama.cpp: as if not named
    if not meta.get("tokenizer.ggml.pre"):
        log.warning("%sthe GGUF names no pre-tokenizer (tokenizer.ggml.pre); its text is split as llama.cpp "
                    "splits it then ('default'), which may not be the model's own split.", where)
    if pre not in BPE_PRE:
        raise UnsupportedModelError(f"{where}GGUF pre-tokenizer {pre!r} is not supported (known: "
                                    f"{', '.join(sorted(BPE_PRE))}).")
    split, nfc, ignore_merges, add_bos = BPE_PRE[pre]
    tokens = list(meta["tokenizer.ggml.tokens"])
    if not meta.get("tokenizer.ggml.merges"):  # NOTE: as llama.cpp: without merges every word split into bytes
        raise UnsupportedModelError(f"{where}a byte-level BPE ('gpt2') GGUF tokenizer without "
                                    "tokenizer.ggml.merges; convert the model again.")
    merges = []
    for m in meta.get("tokenizer.ggml.merges") or []:
        a, sep, b = m.partition(" ")
        if not sep:
            raise UnsupportedModelError(f"{where}GGUF merge {m!r} is not two tokens.")
        merges.append((a, b))
    vocab = {t: i for i, t in enumerate(tokens)}
    kept, dropped = [], []
    for a, b in merges:
        (kept if a in vocab and b in vocab and a + b in vocab else dropped).append((a, b))
    if dropped:  # NOTE: llama.cpp loads such files; those merges never make a token of it
        log.warning("%s%d GGUF merges name a token outside the vocabulary (the first: %r); they are left out.",
                    where, len(dropped), " ".join(dropped[0]))
    tok = Tokenizer(models.BPE(vocab, kept, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges))
    if split == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False)
              for r in (split if isinstance(split, tuple) else (split,))),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if nfc:
        tok.normalizer = normalizers.NFC()
    literal = byte_char_tokens(tokens, list(meta.get("tokenizer.ggml.token_type") or []))
    if literal:
        # NOTE: each such added token (byte_char_tokens: "café", DeepSeek's õ ö ü ...) is spelled in the byte
        # alphabet as its own UTF-8 before the ByteLevel decoder, so it decodes to its text as llama.cpp
        # copies it (the decoder read each of its characters as one byte: "Köln" decoded to "K\ufffdln")
        from .tokenizer import _BYTE_LEVEL
        spell = {b: c for c, b in _BYTE_LEVEL.items()}
        tok.decoder = decoders.Sequence(
            [decoders.Replace(t, "".join(spell[b] for b in t.encode())) for t in literal] + [decoders.ByteLevel()])
    else:
        tok.decoder = decoders.ByteLevel()
    return tok, add_bos


def byte_char_tokens(tokens: list, types: list) -> list[str]:
    """A byte-level vocabulary's user-defined and control tokens written in characters of the
    byte alphabet that stand for other bytes than their own UTF-8 ("café", "×2"; DeepSeek's 13
    one-character tokens of bytes C0, C1 and F5-FF, which UTF-8 never holds): text tokens, as
    llama.cpp copies their text, where the ByteLevel decoder read each character as one byte
    ("café" decoded to "caf\ufffd"). One that a normal token holds is left as it is (the decoder's
    rewrite would reach that token too)."""
    from .tokenizer import _BYTE_LEVEL
    if len(types) != len(tokens):
        return []
    added = [t for t, k in zip(tokens, types) if k in (USER_DEFINED, CONTROL) and t and all(c in _BYTE_LEVEL for c in t)
             and bytes(_BYTE_LEVEL[c] for c in t) != t.encode()]
    if not added:
        return []
    # NOTE: one search of all normal tokens at once (NUL, byte 0, is "\u0100" in the byte alphabet)
    normal = "\x00".join(t for t, k in zip(tokens, types) if k == NORMAL)
    return [t for t in added if t not in normal]


def _spm(meta: dict, where: str):
    from tokenizers import Tokenizer, decoders, models, normalizers

    if meta.get("tokenizer.ggml.remove_extra_whitespaces"):
        raise UnsupportedModelError(f"{where}GGUF SentencePiece tokenizers that remove extra whitespace "
                                    "are not supported.")
    tokens = list(meta["tokenizer.ggml.tokens"])
    n = len(tokens)
    scores = list(meta.get("tokenizer.ggml.scores") or [])
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * n)
    if len(scores) != n or len(types) != n:
        raise UnsupportedModelError(f"{where}the GGUF SentencePiece vocabulary has {n} tokens but "
                                    f"{len(scores)} scores and {len(types)} token types.")
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    # NOTE: SentencePiece joins the adjacent pair whose joined piece scores highest: every split
    # of a normal piece into two normal pieces is a merge, ranked by the joined piece's score
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            a, b = piece[:cut], piece[cut:]
            if a in normal and b in normal:
                ranked.append((-float(scores[i]), normal[a], normal[b], a, b))
    ranked.sort()
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[int(unk)] if unk is not None and 0 <= int(unk) < n else None
    byte_fallback = any(t == BYTE for t in types)
    tok = Tokenizer(models.BPE(vocab, [(a, b) for *_, a, b in ranked], unk_token=unk_token,
                               fuse_unk=True, byte_fallback=byte_fallback))
    steps = [normalizers.Replace(" ", "\u2581")]
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("\u2581"))
        decode.append(decoders.Strip(" ", 1, 0))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence(decode)
    return tok, True  # llama.cpp adds BOS to SentencePiece models unless the file says not to


def _add_special(tok, tokens: list, types: list, rstrip: set = frozenset()) -> None:
    from tokenizers import AddedToken

    # NOTE: UNKNOWN (<unk>) is special too, as llama.cpp and transformers take it
    control = [AddedToken(t, normalized=False, special=True, rstrip=t in rstrip) for t, k in zip(tokens, types)
               if k in (CONTROL, UNKNOWN)]
    user = [AddedToken(t, normalized=False, special=False, rstrip=t in rstrip) for t, k in zip(tokens, types)
            if k == USER_DEFINED]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def _post_processor(tok, byte_level: bool, bos: tuple | None, eos: tuple | None) -> None:
    """Byte-level BPE's offsets, then BOS / EOS ((token, id), or None) around each text."""
    from tokenizers import processors

    steps = [processors.ByteLevel(trim_offsets=False)] if byte_level else []
    if bos or eos:
        def around(x):
            return ([bos[0]] if bos else []) + [x] + ([eos[0]] if eos else [])
        special = list(dict.fromkeys(t for t in (bos, eos) if t))
        steps.append(processors.TemplateProcessing(single=around("$A"), pair=around("$A") + around("$B"),
                                                   special_tokens=special))
    if steps:
        tok.post_processor = steps[0] if len(steps) == 1 else processors.Sequence(steps)
