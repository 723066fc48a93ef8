"""GGUF tokenizers (numa_runtime/gguf_tokenizer.py) against independent references.

- SentencePiece ("llama" model: Llama 2, Mistral): a BPE model trained here with the
  sentencepiece library, written into GGUF metadata as llama.cpp's converter writes it (pieces,
  scores, token types, no merges); our encode must equal sentencepiece's own encode, byte
  fallback and spaces included.
- Byte-level BPE ("gpt2" model) with the pre-tokenizers of Qwen2, Llama 3 and Tekken: a
  `tokenizers` BPE trained here with the split of each model's own tokenizer.json (the regexes
  below are theirs, written out here, not imported); our encode must equal it.
- An Engine on a GGUF of each kind: its prompt ids and stop tokens come from the metadata.
"""
import json
import os

import numpy as np
import pytest
from gguf_helpers import add_metadata

from numa_runtime.config import UnsupportedModelError
from numa_runtime.gguf_tokenizer import stop_token_ids, write_tokenizer
from numa_runtime.tokenizer import Tokenizer

CORPUS = "/usr/share/common-licenses/GPL-3"
EXTRA = ("Numbers 1234567 and 3.14159, dates 2026-12-02. Cafe naive facade, caf\u00e9 na\u00efve. "
         "I'm you're we'll IT'S. CAPS and MixedCase wordsHere.\n\n\tTabbed  double  spaces.\r\n")
TEXTS = ["Hello world", " leading space", "trailing space ", "two  spaces   three", "\n\nnewlines\n",
         "tabs\tand\r\nCRLF", "Numbers 1234567 and 3.14159", "I'm you're WE'LL It'S", "Caf\u00e9 na\u00efve",
         "\u6771\u4eac \u3068 \u5927\u962a", "emoji \U0001F600 end", "CamelCaseWords and ALLCAPS", "x" * 40,
         "a/b/c path/to/file.py", "   ", "", "0.5x 10x 100,000 1e-5",
         "This program is free software: you can redistribute it and/or modify it"]

# the pre-tokenizer regexes of the models' tokenizer.json files
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
          r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# the same splits as llama.cpp rewrites them (llama-vocab.cpp): contractions without (?i:), and
# GPT-4o's letter classes as lookaheads; each must split as the tokenizer.json regex we write
LLAMA3_CPP = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTION = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT4O_CPP = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTION + "?"
             r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTION + "?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SEED_CODER_CPP = (_CONTRACTION + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
                  r"|\s+(?!\S)|\s+")
SPECIALS = ["<|begin|>", "<|end|>", "<|im_start|>", "<|im_end|>"]


def corpus_lines():
    with open(CORPUS) as f:
        return f.read().splitlines() + [EXTRA] * 50


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    prefix = str(tmp_path_factory.mktemp("sp") / "sp")
    # NOTE: as Llama 2's tokenizer.model: BPE, byte fallback, identity normalization, spaces kept
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_lines()), model_prefix=prefix, vocab_size=1200, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, control_symbols=["[INST]", "[/INST]"], minloglevel=2)
    return spm.SentencePieceProcessor(model_file=prefix + ".model")


def sp_meta(sp) -> dict:
    """GGUF metadata of a SentencePiece model, as llama.cpp's converter writes it."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
                     else 5 if sp.is_unused(i) else 1)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
            "tokenizer.ggml.unknown_token_id": sp.unk_id()}


def ours(meta: dict, tmp_path) -> Tokenizer:
    d = str(tmp_path / "tok")
    os.makedirs(d, exist_ok=True)
    write_tokenizer(meta, d, "llama.")
    return Tokenizer.from_dir(d)


def test_sentencepiece_equals_sentencepiece(sp_model, tmp_path):
    tok = ours(sp_meta(sp_model), tmp_path)
    texts = TEXTS + ["\u00a7 \u00b6 \u2603 unseen characters fall back to bytes \u0416\u0436"]
    fallback = False
    for text in texts:
        want = sp_model.encode(text)
        assert tok.encode(text, add_special_tokens=False) == want, text
        assert tok.encode(text) == [sp_model.bos_id()] + want, text  # llama.cpp's default: BOS
        assert tok.decode(want, skip_special_tokens=True) == sp_model.decode(want), text
        fallback |= any(sp_model.is_byte(i) for i in want)
    assert fallback  # the byte-fallback path ran


def test_sentencepiece_space_prefix_after_special_tokens(sp_model, tmp_path):
    """Each text between special tokens gets its own space prefix (llama.cpp, transformers'
    legacy Llama tokenizer); special tokens in the text are matched."""
    tok = ours(sp_meta(sp_model), tmp_path)
    inst, end = sp_model.piece_to_id("[INST]"), sp_model.piece_to_id("[/INST]")
    got = tok.encode("[INST] What is GPL? [/INST]", add_special_tokens=False)
    assert got == [inst] + sp_model.encode(" What is GPL? ") + [end]


def test_sentencepiece_without_space_prefix(tmp_path):
    """tokenizer.ggml.add_space_prefix = false (a model trained without SentencePiece's dummy prefix)."""
    spm = pytest.importorskip("sentencepiece")
    prefix = str(tmp_path / "nop")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_lines()), model_prefix=prefix, vocab_size=800, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    meta = {**sp_meta(sp), "tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False}
    tok = ours(meta, tmp_path)
    for text in TEXTS:
        assert tok.encode(text) == sp.encode(text), text
        assert tok.decode(sp.encode(text), skip_special_tokens=True) == sp.decode(sp.encode(text)), text


def bpe_reference(split: str | None, nfc: bool, ignore_merges: bool):
    from tokenizers import Regex, Tokenizer as HF, decoders, models, normalizers, pre_tokenizers, trainers
    tok = HF(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus_lines(), trainers.BpeTrainer(
        vocab_size=1500, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def bpe_meta(ref, pre: str) -> dict:
    """GGUF metadata of a byte-level BPE tokenizer, as llama.cpp's converter writes it."""
    tj = json.loads(ref.to_str())
    vocab = tj["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens],
            "tokenizer.ggml.bos_token_id": tokens.index("<|begin|>"),
            "tokenizer.ggml.eos_token_id": tokens.index("<|end|>"), "tokenizer.ggml.add_bos_token": False}


@pytest.mark.parametrize("pre,split,nfc,ignore_merges", [
    ("qwen2", QWEN2, True, False), ("llama-bpe", LLAMA3, False, True), ("tekken", TEKKEN, False, True),
    ("dbrx", LLAMA3_CPP, False, False), ("gpt-4o", GPT4O_CPP, False, False),
    ("seed-coder", SEED_CODER_CPP, False, False)])
def test_byte_level_pre_tokenizers_equal_reference(tmp_path, pre, split, nfc, ignore_merges):
    ref = bpe_reference(split, nfc, ignore_merges)
    tok = ours(bpe_meta(ref, pre), tmp_path)
    chat = "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    for text in TEXTS + [chat, "e\u0301 and \u00e9", "HTTPServer's JSONParser WE'RE don't\n/path/ x/y"]:
        want = ref.encode(text).ids
        assert tok.encode(text, add_special_tokens=False) == want, text
        assert tok.decode(want, skip_special_tokens=False) == ref.decode(want, skip_special_tokens=False)
    assert tok.encode(chat, add_special_tokens=False)[0] == ref.token_to_id("<|im_start|>")


def test_pre_tokenizer_names_pick_different_splits(tmp_path):
    """The name decides the split: Qwen2 takes digits one by one, Llama 3 up to three."""
    ref = bpe_reference(LLAMA3, False, True)
    qwen = ours(bpe_meta(ref, "qwen2"), tmp_path / "q")
    llama = ours(bpe_meta(ref, "llama-bpe"), tmp_path / "l")
    digits = [ref.token_to_id(c) for c in "1234567"]
    assert qwen.encode("1234567", add_special_tokens=False) == digits
    assert llama.encode("1234567", add_special_tokens=False) == ref.encode("1234567").ids != digits


DEFAULT_CPP = (r"[\p{P}\$\+<=>\^~\|]+", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
               r"\p{N}+", r"[0-9][0-9][0-9]")


def llama_cpp_default_pieces(text: str, regexes=DEFAULT_CPP) -> list[str]:
    """llama.cpp's split of a BPE text by a sequence of regexes (llama-vocab.cpp; by default the
    one it takes when the file names no pre-tokenizer or "default"): each regex in turn splits
    every piece so far into its matches and the text between them; written here with the `regex`
    module."""
    import regex
    pieces = [text]
    for rx in regexes:
        out = []
        for p in pieces:
            at = 0
            for m in regex.finditer(rx, p):
                out += [x for x in (p[at:m.start()], m.group()) if x]
                at = m.end()
            out += [p[at:]] if p[at:] else []
        pieces = out
    return pieces


@pytest.mark.parametrize("named", [True, False])
def test_a_default_or_missing_pre_tokenizer_splits_as_llama_cpp(tmp_path, named, caplog):
    """Older converters name no pre-tokenizer; llama.cpp then splits punctuation runs apart and
    digits in threes (GPT-2's regex kept "1234567890" whole, other ids than llama.cpp's)."""
    from tokenizers import Tokenizer as HF, pre_tokenizers
    ref = bpe_reference(LLAMA3, False, True)
    meta = bpe_meta(ref, "default")
    if not named:
        del meta["tokenizer.ggml.pre"]
    d = tmp_path / "tok"
    d.mkdir()
    write_tokenizer(meta, str(d), "llama.", source="old.gguf")
    assert ("names no pre-tokenizer" in caplog.text) == (not named)
    hf = HF.from_file(str(d / "tokenizer.json"))
    byte = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    assert llama_cpp_default_pieces("1234567890") == ["123", "456", "789", "0"]
    for text in TEXTS + ["Hello, world!! 1234567890 $5+3=8 <a|b> ^~", "x=='y'; f(a,b)->c"]:
        want = [q for p in llama_cpp_default_pieces(text) for q, _ in byte.pre_tokenize_str(p)]
        assert [p for p, _ in hf.pre_tokenizer.pre_tokenize_str(text)] == want, text


_CJK_CPP = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# llama.cpp's regex sequences of DeepSeek LLM (its letter class cut to the ranges the texts use,
# which the test checks), DeepSeek Coder, DeepSeek-V3 and Viking
SEQUENCES = {
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_CPP, r"\p{N}"),
    "deepseek-llm": (r"[\r\n]", "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u0386\u0388-\u038a\u038c"
                     "\u038e-\u03a1\u03a3-\u03f5\u0531-\u0556\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f]+",
                     "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$", _CJK_CPP,
                     r"\p{N}+"),
    "deepseek-v3": (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "viking": (" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+", r"\p{N}"),
}
SEQUENCE_TEXTS = TEXTS + [
    "Hello, world!! 1234567890 $5+3=8 <a|b> ^~", "x=='y'; f(a,b)->c", "def f(x):\n    return x**2  # sq\n",
    "\u03b1\u03b2\u03b3 \u0394\u03ad\u03bb\u03c4\u03b1 \u0531\u0562 \uff21\uff22\uff43 \U00010400\U00010428 caf\u00e9 \u00b5s",
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002 \u3053\u3093\u306b\u3061\u306f \u30ab\u30bf\u30ab\u30ca \ud55c\uad6d\uc5b4 \u2018q\u2019 \u201cw\u201d",
    "trailing spaces   ", "Hyv\u00e4\u00e4 p\u00e4iv\u00e4\u00e4! Mit\u00e4 kuuluu? \u0928\u092e\u0938\u094d\u0924\u0947\u0964 \u2026ok",
    "a.b,c!d?e (paren) [brack] {brace} 3.14 1,000"]


@pytest.mark.parametrize("pre", sorted(SEQUENCES))
def test_regex_sequence_pre_tokenizers_split_as_llama_cpp(tmp_path, pre):
    """DeepSeek LLM/Coder/V3 and Viking split by a sequence of regexes, each over the pieces of the
    one before, as llama.cpp does (and their tokenizer.json, as a Sequence of isolated Splits)."""
    from tokenizers import Tokenizer as HF, pre_tokenizers
    meta = bpe_meta(bpe_reference(LLAMA3, False, False), pre)
    d = tmp_path / "tok"
    d.mkdir()
    write_tokenizer(meta, str(d), "llama.")
    hf = HF.from_file(str(d / "tokenizer.json"))
    byte = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "deepseek-llm":
        # the cut letter class covers every letter of the texts but kana, Devanagari and lowercase
        # Armenian, which DeepSeek LLM's class leaves out too (and CJK, split after it)
        import regex
        cut = regex.compile(SEQUENCES[pre][1][3:-1])
        assert all(cut.fullmatch(c) for t in SEQUENCE_TEXTS for c in t
                   if regex.match(r"\p{L}", c) and not regex.match(_CJK_CPP, c)
                   and not any(a <= c <= b for a, b in ("\u3040\u30ff", "\u0900\u097f", "\u0561\u0587")))
    for text in SEQUENCE_TEXTS:
        want = [q for p in llama_cpp_default_pieces(text, SEQUENCES[pre]) for q, _ in byte.pre_tokenize_str(p)]
        assert [p for p, _ in hf.pre_tokenizer.pre_tokenize_str(text)] == want, text
    assert ours(meta, tmp_path).decode(ours(meta, tmp_path).encode(SEQUENCE_TEXTS[-4], add_special_tokens=False)) \
        == SEQUENCE_TEXTS[-4]


def test_bos_eos_follow_the_metadata(tmp_path):
    ref = bpe_reference(LLAMA3, False, True)
    meta = {**bpe_meta(ref, "llama-bpe"), "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}
    tok = ours(meta, tmp_path)
    body = ref.encode("Hello world").ids
    assert tok.encode("Hello world") == [ref.token_to_id("<|begin|>")] + body + [ref.token_to_id("<|end|>")]
    meta.pop("tokenizer.ggml.add_bos_token")
    meta.pop("tokenizer.ggml.add_eos_token")
    # NOTE: without the keys, llama.cpp's default for Llama 3's pre-tokenizer: BOS
    assert ours(meta, tmp_path / "d").encode("Hello world") == [ref.token_to_id("<|begin|>")] + body


def test_stop_tokens_include_end_of_turn():
    meta = {"tokenizer.ggml.eos_token_id": 5, "tokenizer.ggml.eot_token_id": 9, "tokenizer.ggml.eom_token_id": 9}
    assert stop_token_ids(meta) == [5, 9]
    # a chat model whose EOS is the base model's end token: its template's end of turn stops too
    tokens = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "hello", "<|eot_id|>"]
    assert stop_token_ids({"tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.tokens": tokens}) == [1, 3, 5]


def test_the_unknown_token_is_special(sp_model, tmp_path):
    """<unk> (type 2) is matched in text and left out of decoded text, as llama.cpp and transformers do."""
    tok = ours(sp_meta(sp_model), tmp_path)
    unk, a = sp_model.unk_id(), sp_model.encode("a")
    assert tok.encode("a<unk>a", add_special_tokens=False) == a + [unk] + a
    assert tok.decode(a + [unk] + a, skip_special_tokens=True) == tok.decode(a + a, skip_special_tokens=True)


def test_a_sentencepiece_vocabulary_without_bos_or_unknown_ids_takes_llama_cpp_defaults(tmp_path, caplog):
    """No unknown id: text outside the vocabulary (no byte tokens) was dropped without a word; no
    BOS id: refused as if the file had asked for one. As llama.cpp: BOS 1, unknown the UNKNOWN-type
    token."""
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a", "\u2581b"]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0],
            "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1, 1, 1], "tokenizer.ggml.eos_token_id": 2}
    tok = ours(meta, tmp_path)
    assert tok.encode("a \u00e9\u00e9 b") == [1, 6, 3, 0, 7]
    assert tok.encode("a \u00e9\u00e9 b", add_special_tokens=False) == [6, 3, 0, 7]
    assert "names no unknown token (tokenizer.ggml.unknown_token_id); it is token 0 ('<unk>')" in caplog.text
    assert "names no BOS token (tokenizer.ggml.bos_token_id); it is token 1 ('<s>')" in caplog.text


def test_byte_level_metadata_llama_cpp_takes(tmp_path, caplog):
    """An empty pre-tokenizer name is llama.cpp's default split (it was refused); merges naming a
    token outside the vocabulary are left out with a warning (a raw tokenizers exception)."""
    ref = bpe_reference(LLAMA3, False, True)
    meta = bpe_meta(ref, "")
    meta["tokenizer.ggml.merges"] = list(meta["tokenizer.ggml.merges"]) + ["zz\u0120 qq"]
    tok = ours(meta, tmp_path)
    assert tok.decode(tok.encode("Hello world", add_special_tokens=False)) == "Hello world"
    assert "names no pre-tokenizer" in caplog.text
    assert "1 GGUF merges name a token outside the vocabulary (the first: 'zz\u0120 qq'); they are left out" in caplog.text


@pytest.mark.parametrize("meta,words", [
    ({}, "the GGUF holds no tokenizer \\(no tokenizer.ggml.model\\)"),
    ({"tokenizer.ggml.model": "bert"}, "'bert' is not supported"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "no-such-pre", "tokenizer.ggml.tokens": ["a"]},
     "'no-such-pre' is not supported"),
])
def test_unsupported_tokenizers_are_clear_errors(tmp_path, meta, words):
    with pytest.raises(UnsupportedModelError, match=words):
        write_tokenizer(meta, str(tmp_path), "llama.", source="x.gguf")


def write_tiny_gguf(path: str, tok_meta: dict, n_vocab: int) -> None:
    """A one-layer random llama GGUF with the given tokenizer metadata."""
    import gguf
    w = gguf.GGUFWriter(path, "llama")
    H, NH, FF = 64, 4, 128
    for k, v in [("block_count", 1), ("context_length", 256), ("embedding_length", H),
                 ("feed_forward_length", FF), ("attention.head_count", NH), ("attention.head_count_kv", NH),
                 ("rope.dimension_count", H // NH)]:
        w.add_uint32("llama." + k, v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    add_metadata(w, tok_meta)
    rng = np.random.default_rng(0)

    def add(name, shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))
    add("token_embd.weight", (n_vocab, H))
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(H, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(H, np.float32))
    for n in ("attn_q", "attn_k", "attn_v", "attn_output"):
        add(f"blk.0.{n}.weight", (H, H))
    add("blk.0.ffn_gate.weight", (FF, H))
    add("blk.0.ffn_up.weight", (FF, H))
    add("blk.0.ffn_down.weight", (H, FF))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_engine_on_sentencepiece_and_qwen2_ggufs(sp_model, tmp_path):
    from numa_runtime import Engine, SamplingParams
    ref = bpe_reference(QWEN2, True, False)
    qmeta = {**bpe_meta(ref, "qwen2"), "tokenizer.ggml.eot_token_id": ref.token_to_id("<|im_end|>")}
    cases = [("spm", sp_meta(sp_model), sp_model.get_piece_size(),
              lambda t: [sp_model.bos_id()] + sp_model.encode(t), {sp_model.eos_id()}),
             ("qwen2", qmeta, ref.get_vocab_size(), lambda t: ref.encode(t).ids,
              {ref.token_to_id("<|end|>"), ref.token_to_id("<|im_end|>")})]
    for name, meta, n_vocab, want, stops in cases:
        path = str(tmp_path / f"{name}.gguf")
        write_tiny_gguf(path, meta, n_vocab)
        eng = Engine(path, dtype="float32", kv_cache_memory=1 << 22, max_model_len=128)
        try:
            text = "What is the GNU General Public License?"
            assert eng.tokenizer.encode(text) == want(text)
            assert set(eng.tokenizer.eos_token_ids) == stops
            out = eng.generate([text], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
            assert len(out.token_ids) == 4
        finally:
            eng.close()


def test_first_token_keeps_its_space_after_a_prompt_ending_in_byte_pieces(sp_model, tmp_path):
    """A prompt whose last 5 tokens start inside a character (byte-fallback pieces of 日本語):
    the left context grows until it decodes whole (as vLLM), so the first generated word keeps
    its space: decode(prompt + out) minus decode(prompt). It came out glued ("日本語the")."""
    from numa_runtime.tokenizer import IncrementalDetokenizer
    tok = ours(sp_meta(sp_model), tmp_path)
    the = tok.encode("the the", add_special_tokens=False)[-1]
    for text in ("Translate to English: 日本語", "Smile 😀", "日本語"):
        prompt = tok.encode(text)
        det = IncrementalDetokenizer(tok, prompt)
        got = "".join(det.add(t) for t in [the] * 3) + det.flush()
        skip = dict(skip_special_tokens=True)
        want = tok.decode(prompt + [the] * 3, **skip)[len(tok.decode(prompt, **skip)):]
        assert got == want and want.startswith(" "), (text, got, want)


def with_tokens(meta: dict, tokens: list, types: list) -> dict:
    """`meta` with `tokens` of `types` appended (scores of -1000 where the vocabulary has scores)."""
    meta = {**meta, "tokenizer.ggml.tokens": list(meta["tokenizer.ggml.tokens"]) + tokens,
            "tokenizer.ggml.token_type": list(meta["tokenizer.ggml.token_type"]) + types}
    if "tokenizer.ggml.scores" in meta:
        meta["tokenizer.ggml.scores"] = list(meta["tokenizer.ggml.scores"]) + [-1000.0] * len(tokens)
    return meta


@pytest.fixture(scope="module")
def qwen2_bpe():
    return bpe_meta(bpe_reference(QWEN2, True, False), "qwen2")


@pytest.mark.parametrize("kind", ["sentencepiece", "byte_level"])
def test_a_string_the_vocabulary_holds_twice_is_refused(sp_model, qwen2_bpe, tmp_path, kind):
    """llama.cpp refuses a vocabulary that holds a string at two ids (one of them would have no
    text); so does the engine, in one sentence naming the token, not at the first decode of it."""
    meta = sp_meta(sp_model) if kind == "sentencepiece" else qwen2_bpe
    n = len(meta["tokenizer.ggml.tokens"])
    k = next(i for i, t in enumerate(meta["tokenizer.ggml.tokens"]) if len(t) > 3)
    twice = with_tokens(meta, [meta["tokenizer.ggml.tokens"][k]], [1])
    with pytest.raises(UnsupportedModelError, match=rf"holds the token .* twice \(ids {k} and {n}\), which llama.cpp "
                       "refuses too; convert the model again"):
        ours(twice, tmp_path)
    path = str(tmp_path / "twice.gguf")
    write_tiny_gguf(path, twice, n + 1)
    from numa_runtime import Engine
    with pytest.raises(UnsupportedModelError, match=r"twice.gguf: the GGUF vocabulary holds the token .* twice"):
        Engine(path, dtype="float32")


def test_empty_tokens_are_named_as_llama_cpp_names_them(qwen2_bpe, tmp_path, caplog):
    """Empty token strings (two of them would be one string twice) are "[EMPTY_<id>]", as llama.cpp names them."""
    n = len(qwen2_bpe["tokenizer.ggml.tokens"])
    tok = ours(with_tokens(qwen2_bpe, ["", ""], [1, 3]), tmp_path)
    assert tok.decode([n, n + 1]) == f"[EMPTY_{n}][EMPTY_{n + 1}]"
    assert tok.encode(f"a[EMPTY_{n + 1}]", add_special_tokens=False)[-1] == n + 1  # the control one, matched
    assert "2 empty token(s)" in caplog.text


@pytest.mark.parametrize("kind", ["sentencepiece", "byte_level"])
def test_end_of_turn_tokens_the_file_types_normal_are_control_tokens(sp_model, qwen2_bpe, tmp_path, caplog, kind):
    """A file that types "<|eot_id|>" as a normal token (llama.cpp: "probably a bug in the model. its
    type will be overridden"): it is matched in text as one token, not as pieces of it, and left out
    of a text that skips special tokens."""
    meta = sp_meta(sp_model) if kind == "sentencepiece" else qwen2_bpe
    n = len(meta["tokenizer.ggml.tokens"])
    tok = ours(with_tokens(meta, ["<|eot_id|>", "<|end_of_turn|>"], [1, 1]), tmp_path)
    ids = tok.encode("hi<|eot_id|>after", add_special_tokens=False)
    assert n in ids and ids == tok.encode("hi", add_special_tokens=False) + [n] + ids[ids.index(n) + 1:]
    assert tok.decode(ids, skip_special_tokens=True) == tok.decode([i for i in ids if i != n], skip_special_tokens=True)
    assert "is not a control token; it is taken as one" in caplog.text
    # NOTE: OpenChat's end of turn (a stop token here) llama.cpp leaves as the file types it: text pieces
    assert tok.encode("<|end_of_turn|>", add_special_tokens=False) != [n + 1]


def test_byte_level_added_tokens_decode_as_their_text(qwen2_bpe, tmp_path):
    """User-defined and control tokens of a byte-level vocabulary are text (llama.cpp copies it):
    "café" decoded to "caf\ufffd" and "×2" to "\ufffd2" (the decoder read é and × as one byte each)."""
    n = len(qwen2_bpe["tokenizer.ggml.tokens"])
    tok = ours(with_tokens(qwen2_bpe, ["caf\u00e9", "\u00d72", "<|x\u00e9|>"], [4, 4, 3]), tmp_path)
    assert tok.encode("one caf\u00e9 \u00d72", add_special_tokens=False)[-3:] == [n, tok.encode(" ", False)[0], n + 1]
    assert tok.decode([n, n + 1, n + 2]) == "caf\u00e9\u00d72<|x\u00e9|>"
    assert tok.decode(tok.encode("x caf\u00e9 y", add_special_tokens=False)) == "x caf\u00e9 y"
    assert [tok.token_bytes(i) for i in (n, n + 1)] == ["caf\u00e9".encode(), "\u00d72".encode()]


def test_sentencepiece_added_tokens_bytes_keep_their_spaces(sp_model, tmp_path):
    """token_bytes of an added token is its text: a lone decode of a SentencePiece vocabulary strips
    the first space of its text (the "  " token's bytes were one space, so the tokens' bytes did not
    join to the text)."""
    n = sp_model.get_piece_size()
    tok = ours(with_tokens(sp_meta(sp_model), ["  "], [4]), tmp_path)
    ids = tok.encode("a  a", add_special_tokens=False)
    assert n in ids and tok.token_bytes(n) == b"  "
    # NOTE: the first word piece's bytes hold SentencePiece's prepended space, which decode() strips
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == " " + tok.decode(ids)


def test_metadata_text_that_is_not_utf8_is_one_sentence(qwen2_bpe, tmp_path):
    path = str(tmp_path / "bad.gguf")
    meta = with_tokens(qwen2_bpe, [b"ab\xff"], [1])
    write_tiny_gguf(path, meta, len(meta["tokenizer.ggml.tokens"]))
    from numa_runtime import Engine
    with pytest.raises(UnsupportedModelError, match=r"bad.gguf: the GGUF metadata tokenizer.ggml.tokens holds text "
                       "that is not valid UTF-8"):
        Engine(path, dtype="float32")
