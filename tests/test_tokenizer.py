"""Tokenizer and IncrementalDetokenizer against Hugging Face transformers.

Models: the converted default model (SmolLM2, byte-level BPE) and tokenizers trained here with
the `tokenizers` library (byte-level BPE; sentencepiece-style metaspace BPE with byte fallback).
"""
import json
import os
import random
import shutil

import jinja2
import numpy as np
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from numa_runtime.default_model import default_model_dir
from numa_runtime.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers", reason="SKIPPED: transformers is missing, so tokenizers "
                                                          "are not compared with it (scripts/test.sh installs it)")

TEXTS = [
    "Hello world",
    "  leading spaces,\ttabs\nand\r\nnewlines  ",
    "emoji 😀👍🏽 👨‍👩‍👧 and 中文字符,日本語のテキスト, café, naïve, Ωμέγα, привет",
    "numbers 12345 + 678 = 7023; pi ≈ 3.14159",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    "code: def f(x):\n    return {'a': x ** 2}  # ok",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Réponds en français. 🇫🇷"},
     {"role": "user", "content": "Bonjour !"},
     {"role": "assistant", "content": "Bonjour, comment puis-je aider ?"},
     {"role": "user", "content": "Écris un haïku."}],
]
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizer",
          "a small corpus for a small vocabulary 0123456789", "naïve café déjà vu"] * 20


@pytest.fixture(scope="module")
def smol_dir():
    return default_model_dir()


@pytest.fixture(scope="module")
def smol(smol_dir):
    return Tokenizer.from_dir(smol_dir)


@pytest.fixture(scope="module")
def smol_hf(smol_dir):
    return transformers.AutoTokenizer.from_pretrained(smol_dir)


# --- the default model vs transformers ---------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_hf(smol, smol_hf, text):
    for special in (True, False):
        ids = smol.encode(text, add_special_tokens=special)
        assert ids == smol_hf.encode(text, add_special_tokens=special)
        for skip in (True, False):
            assert smol.decode(ids, skip) == smol_hf.decode(ids, skip_special_tokens=skip)


def test_special_ids_match_hf(smol, smol_hf):
    assert smol.vocab_size == len(smol_hf) == 49152
    assert smol.bos_token_id == smol_hf.bos_token_id == 1
    # NOTE: EOS (<|im_end|>) and <|endoftext|>, a token whose text ends a turn (llama.cpp stops
    # on both; the converted model's generation_config lists both)
    assert smol_hf.eos_token_id == 2 and smol.eos_token_ids == {2, 0}


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(smol, smol_hf, messages, add_generation_prompt):
    ours = smol.render_chat(messages, add_generation_prompt=add_generation_prompt)
    theirs = smol_hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tokenize=False)
    assert ours == theirs


# --- IncrementalDetokenizer --------------------------------------------------------------------

def _stream(tokenizer, ids, prompt_ids=(), skip_special_tokens=True):
    det = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    deltas = [det.add(i) for i in ids]
    return deltas, det.flush()


def _random_text(rng):
    pieces = ["the", " cat", " 😀", "👍🏽", "👨‍👩‍👧", "中文", "字符", " café", "é", "Ω", "\n",
              "привет", " ", "…", "🇫🇷", "ﬁ", "𝔘𝔫𝔦"]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))


def test_deltas_join_to_decode_with_multibyte_splits(smol):
    rng = random.Random(0)
    num_held = 0
    for _ in range(200):
        ids = smol.encode(_random_text(rng))
        deltas, tail = _stream(smol, ids)
        assert "".join(deltas) == smol.decode(ids, skip_special_tokens=True) and tail == ""
        for d in deltas:
            assert "\ufffd" not in d
            d.encode("utf-8")  # valid UTF-8: no lone surrogates
        num_held += deltas.count("")
    assert num_held > 100  # characters really were split across tokens


def test_deltas_with_prompt_and_special_tokens(smol):
    rng = random.Random(1)
    special = [1, 2, 0]
    for _ in range(50):
        prompt = smol.encode(_random_text(rng))
        ids = smol.encode(_random_text(rng)) + [rng.choice(special)]
        ids += smol.encode(_random_text(rng))
        for skip in (True, False):
            deltas, tail = _stream(smol, ids, prompt, skip)
            assert "".join(deltas) + tail == smol.decode(ids, skip)
            assert tail == "" and not any("\ufffd" in d for d in deltas)


def test_prompt_ending_inside_a_character(smol):
    """A prompt cut inside a character (a max_tokens cut continued from its ids): the output
    emits the whole character once its last bytes come, as vLLM's detokenizer primed with the
    prompt does (the output alone, decoded, starts with U+FFFD)."""
    ids = smol.encode("a 😀 b 日本")
    split = 0
    for cut in range(1, len(ids)):
        deltas, tail = _stream(smol, ids[cut:], prompt_ids=ids[:cut])
        whole = max(k for k in range(cut + 1) if not smol.decode(ids[:k]).endswith("\ufffd"))
        split += whole < cut
        skip = dict(skip_special_tokens=True)
        assert "".join(deltas) + tail == smol.decode(ids, **skip)[len(smol.decode(ids[:whole], **skip)):], cut
        assert not any("\ufffd" in d for d in deltas) and tail == ""
    assert split >= 2  # the cut really fell inside characters


def test_uniformly_random_ids_join_to_decode_after_flush(smol):
    # Random ids can form invalid UTF-8: then U+FFFD is the right text, released at the latest
    # by the next valid character or by flush().
    rng = random.Random(2)
    for _ in range(100):
        ids = [rng.randrange(smol.vocab_size) for _ in range(rng.randint(1, 40))]
        deltas, tail = _stream(smol, ids)
        assert "".join(deltas) + tail == smol.decode(ids, skip_special_tokens=True)


def test_flush_releases_an_unfinished_character(smol):
    ids = smol.encode("ok 😀")
    deltas, tail = _stream(smol, ids[:-1])  # the emoji's last byte never comes
    assert "".join(deltas) == "ok" and "".join(deltas) + tail == smol.decode(ids[:-1])
    assert tail.endswith("\ufffd")


def test_detokenizer_decodes_a_bounded_window(smol):
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return smol.decode(ids, skip_special_tokens)

    ids = smol.encode(_random_text(random.Random(3)) * 40)
    det = IncrementalDetokenizer(Counting(), smol.encode("a prompt of some length " * 20))
    deltas = [det.add(i) for i in ids]
    assert "".join(deltas) == smol.decode(ids, skip_special_tokens=True)
    assert len(ids) > 500 and max(calls) <= 12  # never the whole sequence


# --- tokenizers trained here -------------------------------------------------------------------

def _train_byte_level(model_dir, config, generation_config=None, bos_in_post_processor=True):
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    if bos_in_post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    tok.save(str(model_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
              "pad_token": "<pad>", **config}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (model_dir / "generation_config.json").write_text(json.dumps(generation_config))
    return model_dir


def test_added_tokens_count_as_hfs(tmp_path):
    """vocab_size is the base vocabulary (it counted the added tokens: 400 where transformers
    says 397), len() every id, get_added_vocab() the added ones (it was missing), as transformers'."""
    d = _train_byte_level(tmp_path, {})
    tok = Backend.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens(["<tool>"])
    tok.add_tokens(["zzqx"])
    tok.save(str(d / "tokenizer.json"))
    ours, theirs = Tokenizer.from_dir(str(d)), transformers.AutoTokenizer.from_pretrained(str(d))
    assert (ours.vocab_size, len(ours)) == (theirs.vocab_size, len(theirs)) and len(ours) > ours.vocab_size
    assert ours.get_added_vocab() == theirs.get_added_vocab() and "zzqx" in ours.get_added_vocab()


@pytest.mark.parametrize("config,bos_in_post_processor", [
    ({}, True), ({}, False), ({"add_bos_token": True}, False), ({"add_bos_token": False}, True),
    ({"add_bos_token": True, "add_eos_token": True}, True)])
def test_trained_byte_level_matches_hf(tmp_path, config, bos_in_post_processor):
    # Not a Llama-style class: tokenizer.json's post-processor alone decides, as in HF.
    d = _train_byte_level(tmp_path, config, bos_in_post_processor=bos_in_post_processor)
    ours, theirs = Tokenizer.from_dir(str(d)), transformers.AutoTokenizer.from_pretrained(str(d))
    for text in TEXTS + CORPUS[:4]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        assert ids.count(0) == text.count("<s>") + bos_in_post_processor
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
        deltas, tail = _stream(ours, ids)
        assert "".join(deltas) == ours.decode(ids, skip_special_tokens=True) and tail == ""


def test_trained_tokenizer_eos_ids_and_missing_template(tmp_path):
    d = _train_byte_level(tmp_path, {}, generation_config={"eos_token_id": [2, 1]})
    tok = Tokenizer.from_dir(str(d))
    assert tok.eos_token_ids == {1, 2} and tok.bos_token_id == 0 and tok.pad_token_id == 2
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "hi"}])


TEMPLATE = """{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role == 'system' and not loop.first %}
        {{ raise_exception('system must be first') }}
    {% endif %}
    {% if m.role == 'stop' %}{% break %}{% endif %}
    <{{ m.role }}>{% generation %}{{ m.content }}{% endgeneration %}</{{ m.role }}>
    {% set ns.n = ns.n + 1 %}
{% endfor %}
{% if tools %}TOOLS {{ tools | tojson }}{% endif %}
[{{ ns.n }} messages; bos={{ bos_token }} eos={{ eos_token }}; year {{ strftime_now('%Y')[:2] }}]
{% if add_generation_prompt %}<assistant>{% endif %}"""
TOOL_TEMPLATE = "TOOL MODE {{ tools | tojson(indent=2) }} {{ messages[-1]['content'] }}"
TOOLS = [{"type": "function", "function": {"name": "météo", "description": "Wetter für Köln",
                                           "parameters": {"type": "object", "properties": {}}}}]


def _template_dir(tmp_path, how):
    config = {}
    if how == "string":
        config["chat_template"] = TEMPLATE
    elif how == "named":
        config["chat_template"] = [{"name": "default", "template": TEMPLATE},
                                   {"name": "tool_use", "template": TOOL_TEMPLATE}]
    elif how == "beside_processor_json":
        config["chat_template"] = TEMPLATE
    d = _train_byte_level(tmp_path, config)
    if how == "jinja_file":
        (d / "chat_template.jinja").write_text(TEMPLATE)
    elif how == "beside_processor_json":  # NOTE: a processor's file: the tokenizer's template wins (it did not)
        (d / "chat_template.json").write_text(json.dumps({"chat_template": "PROCESSOR {{ messages }}"}))
    return d


@pytest.mark.parametrize("how", ["string", "named", "jinja_file", "beside_processor_json"])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_sources_and_helpers_match_hf(tmp_path, how, tools):
    d = _template_dir(tmp_path, how)
    ours, theirs = Tokenizer.from_dir(str(d)), transformers.AutoTokenizer.from_pretrained(str(d))
    for messages in CONVERSATIONS + [[{"role": "user", "content": "a"}, {"role": "stop"},
                                      {"role": "user", "content": "never shown"}]]:
        for gen in (True, False):
            text = ours.render_chat(messages, add_generation_prompt=gen, tools=tools)
            assert text == theirs.apply_chat_template(messages, add_generation_prompt=gen,
                                                      tools=tools, tokenize=False)
    if tools and how == "named":
        assert text.startswith("TOOL MODE") and "météo" in text  # tojson keeps non-ASCII
    else:
        assert "never shown" not in text  # {% break %}


def test_chat_template_errors_are_clear(tmp_path):
    tok = Tokenizer.from_dir(str(_template_dir(tmp_path, "string")))
    bad = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
    with pytest.raises(ChatTemplateError, match="system must be first"):
        tok.render_chat(bad)
    tok._chat_templates = {"default": "{{ messages.__class__.__mro__ }}"}
    with pytest.raises(ChatTemplateError):  # the sandbox refuses
        tok.render_chat([{"role": "user", "content": "a"}])
    # a loop a request variable sizes is bounded over the whole render (each range is, by the sandbox; nested,
    # 10**10 steps held a thread for ever), and the next render has its own budget
    from numa_runtime.tokenizer import MAX_TEMPLATE_RANGE_STEPS
    tok._chat_templates = {"default": "{% for i in range(depth) %}{% for j in range(depth) %}{% endfor %}{% endfor %}"
                                      "{{ messages[0]['content'] }}"}
    msgs = [{"role": "user", "content": "a"}]
    with pytest.raises(ChatTemplateError, match=rf"looped over more than {MAX_TEMPLATE_RANGE_STEPS:,} range\(\) steps"):
        tok.apply_chat_template(msgs, tokenize=False, depth=100000)
    assert tok.apply_chat_template(msgs, tokenize=False, depth=1000) == "a"  # 10**6 steps, twice in a row
    assert tok.apply_chat_template(msgs, tokenize=False, depth=1000) == "a"


@pytest.mark.parametrize("source", [
    "{{ dict.update(messages[0], {'role': 'x'}) }}{{ messages[0].role }}",  # the builtin's unbound methods
    "{% set ns = namespace(_x=1) %}{{ ns._x }}",
    "{% set ns = namespace(x=1) %}{% set ns._y = 2 %}{{ ns.x }}",
])
def test_chat_template_sandbox_refuses_what_hf_refuses(tmp_path, source):
    d = _train_byte_level(tmp_path, {"chat_template": source + "{{ dict(a=1) }} {{ dict.fromkeys('ab', 0) }}"})
    ours, theirs = Tokenizer.from_dir(str(d)), transformers.AutoTokenizer.from_pretrained(str(d))
    messages = [{"role": "user", "content": "a"}]
    with pytest.raises(jinja2.TemplateError):
        theirs.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ChatTemplateError):
        ours.render_chat(messages)
    ours._chat_templates = {"default": "{{ dict(a=1) }} {{ dict.fromkeys('ab', 0) }}"}
    assert ours.render_chat(messages) == "{'a': 1} {'a': 0, 'b': 0}"


def _train_metaspace(model_dir, config=None, bos_in_post_processor=True):
    """SentencePiece-style BPE: metaspace pre-tokenizer, byte fallback for unknown characters."""
    tok = Backend(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    tok = Backend.from_str(json.dumps(spec))
    if bos_in_post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", 1)])
    tok.save(str(model_dir / "tokenizer.json"))
    config = config if config is not None else {"add_bos_token": True}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "unk_token": "<unk>", **config}))
    return model_dir


def test_metaspace_byte_fallback_tokenizer(tmp_path):
    d = _train_metaspace(tmp_path)
    ours, theirs = Tokenizer.from_dir(str(d)), transformers.AutoTokenizer.from_pretrained(str(d))
    rng = random.Random(4)
    for text in TEXTS + [_random_text(rng) for _ in range(100)]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text) and ids.count(1) == 1 + text.count("<s>")
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
        out = ours.encode(text, add_special_tokens=False)
        deltas, tail = _stream(ours, out)  # no prompt: first token loses its space, as decode
        assert "".join(deltas) == ours.decode(out, skip_special_tokens=True) and tail == ""
        assert not any("\ufffd" in d for d in deltas)
        prompt = ours.encode("the lazy dog")
        deltas, tail = _stream(ours, out, prompt)  # prompt as left context keeps the space
        full, head = ours.decode(prompt + out, skip_special_tokens=True), ours.decode(prompt, skip_special_tokens=True)
        assert "".join(deltas) == full[len(head):] and tail == ""
    assert _stream(ours, ours.encode(" 😀", add_special_tokens=False))[0].count("") >= 3


def test_byte_fallback_stream_sends_each_character_once(tmp_path):
    """SentencePiece <0xNN> byte tokens: a lone lead byte after a whole character turned the
    window's decode into U+FFFD for every byte (the whole run), and slicing it by the emitted
    text's length sent U+FFFD for a character already sent; the text is the bytes' own now."""
    from numa_runtime.tokenizer import open_tail
    tok = Tokenizer.from_dir(str(_train_metaspace(tmp_path)))
    byte = {b: tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    word = tok.encode(" café", add_special_tokens=False)
    for ids, want in [
            # an open lead byte mid-stream
            ([byte[b] for b in "日".encode()] + [byte[0xE6]] + word, "日\ufffd café"),
            ([byte[b] for b in "日本".encode()] + [byte[0xE8]], "日本\ufffd"),           # cut inside a character
            ([byte[b] for b in "日本".encode()] + [byte[0xE8], byte[0xAA]], "日本\ufffd"),
            # a space byte, then bytes that make no character: the space's window decodes to ""
            # (the decoder strips its leading space), then with them to U+FFFD for each byte, the
            # space included; sent twice before
            ([byte[b] for b in "本".encode()] + [byte[0x20], byte[0xB8], byte[0x18]] + word,
             "本 \ufffd\x18 café")]:
        deltas, tail = _stream(tok, ids)
        assert "".join(deltas) + tail == want, (deltas, tail)
        assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8", "replace") == want
    cut = [byte[b] for b in "日本".encode()][:-1]  # a prompt ending inside 本: its last 2 tokens are open
    assert open_tail(tok, cut) == 2 and open_tail(tok, cut[:3]) == 0


@pytest.mark.parametrize("config,bos_in_post_processor,num_bos,eos_last", [
    ({"add_bos_token": True}, True, 1, False),  # the usual Llama case: agrees with HF
    ({}, True, 1, False),
    ({"add_bos_token": True}, False, 1, False),  # flags rebuild the post-processor (HF 4)
    ({"add_bos_token": False}, True, 0, False),
    ({"add_bos_token": True, "add_eos_token": True}, True, 1, True)])
def test_llama_style_add_bos_token_never_doubles(tmp_path, config, bos_in_post_processor,
                                                 num_bos, eos_last):
    d = _train_metaspace(tmp_path, config, bos_in_post_processor)
    ours = Tokenizer.from_dir(str(d))
    ids = ours.encode("hello world")
    assert ids.count(1) == num_bos and ids[:num_bos] == [1] * num_bos
    assert (ids[-1] == 2) == eos_last
    assert ids[num_bos:len(ids) - eos_last] == ours.encode("hello world", add_special_tokens=False)
    if bos_in_post_processor and num_bos == 1 and not eos_last:
        assert ids == transformers.AutoTokenizer.from_pretrained(str(d)).encode("hello world")


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_token_bytes_join_to_the_text(smol, tmp_path, kind):
    """Logprobs show each token's bytes: a token holding part of a character (an emoji split
    over byte-level pieces, or SentencePiece <0xNN> bytes) has its own bytes, not U+FFFD's, and
    a text's tokens join to the text (SentencePiece: after the space it prepends)."""
    tok = smol if kind == "byte_level" else Tokenizer.from_dir(str(_train_metaspace(tmp_path)))
    partial = 0
    for text in TEXTS + ["😀 the lazy dog"]:
        ids = tok.encode(text, add_special_tokens=False)
        raw = [tok.token_bytes(i) for i in ids]
        joined = b"".join(raw).decode("utf-8")
        assert joined == text or (kind == "metaspace" and joined == " " + text), (joined, text)
        for b in raw:
            try:
                b.decode("utf-8")
            except UnicodeDecodeError:
                partial += 1
                assert b"\xef\xbf\xbd" not in b  # U+FFFD
    assert partial >= 4


PARTS_TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{% if m.content is string %}{{ m.content }}"
                  "{% else %}{% for p in m.content %}<{{ p.text }}>{% endfor %}{% endif %}{% endfor %}")
STRING_TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
SET_TEMPLATE = ("{% for m in messages %}{% set c = m['content'] %}{% if c is string %}{{ c }}{% else %}"
                "{% for p in c %}<{{ p['text'] }}>{% endfor %}{% endif %}{% endfor %}")
ONLY_PARTS_TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{% for p in m.content %}<{{ p.text }}>{% endfor %}"
                       "{% endfor %}")


@pytest.mark.parametrize("source,want", [
    (PARTS_TEMPLATE, "[user]<Hello><World>[assistant]Hi"),  # loops over content: the parts as they are
    (SET_TEMPLATE, "<Hello><World>Hi"),                      # ... through a variable set from it
    (STRING_TEMPLATE, "[user]Hello\nWorld[assistant]Hi"),    # does not: texts joined by newlines (vLLM)
    # no branch for a string: a string reaches it as one text part (as vLLM), not as its letters
    (ONLY_PARTS_TEMPLATE, "[user]<Hello><World>[assistant]<Hi>"),
    # ... even when it tests something else for being a string
    ("{% if tools is string %}T{% endif %}" + ONLY_PARTS_TEMPLATE, "[user]<Hello><World>[assistant]<Hi>"),
])
def test_content_parts_reach_a_template_as_it_reads_them(tmp_path, source, want):
    d = _train_byte_level(tmp_path, {"chat_template": source})
    tok = Tokenizer.from_dir(str(d))
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]},
                {"role": "assistant", "content": "Hi"}]
    assert tok.render_chat(messages, add_generation_prompt=False) == want
    with pytest.raises(ValueError, match="Only text content parts"):
        tok.render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])
    # an OpenAI assistant's refusal part, replayed, is its text (as vLLM; it was refused)
    refused = [messages[0], {"role": "assistant", "content": [{"type": "refusal", "refusal": "Hi"}]}]
    assert tok.render_chat(refused, add_generation_prompt=False) == tok.render_chat(
        [messages[0], {"role": "assistant", "content": [{"type": "text", "text": "Hi"}]}], add_generation_prompt=False)
    with pytest.raises(ValueError, match=r"^A text content part needs its 'text' as a string, got None\.$"):
        tok.render_chat([{"role": "user", "content": [{"type": "text"}]}])  # "got type 'text'" before


def test_continue_final_message_ends_the_prompt_with_its_text(tmp_path):
    d = _template_dir(tmp_path, "string")
    ours, theirs = Tokenizer.from_dir(str(d)), transformers.AutoTokenizer.from_pretrained(str(d))
    messages = [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "Once upon a"}]
    text = ours.render_chat(messages, continue_final_message=True)
    assert text == theirs.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert text.endswith("Once upon a")
    with pytest.raises(ValueError, match="cannot be true together with add_generation_prompt=true"):
        ours.render_chat(messages, continue_final_message=True, add_generation_prompt=True)
    # NOTE: as HF and vLLM, any last message may be continued
    assert ours.render_chat(messages[:1], continue_final_message=True).endswith("Tell me")
    # a ChatML template: an empty last message, or one whose text the template writes again after it
    # (its text was searched for: "m" matched inside <|im_end|>, "" was never cut)
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    for last in ("", "m", "end", "Once upon a "):
        conv = [messages[0], {"role": "assistant", "content": last}]
        text = ours.render_chat(conv, continue_final_message=True, chat_template=chatml)
        assert text == theirs.apply_chat_template(conv, continue_final_message=True, tokenize=False,
                                                  chat_template=chatml), (last, text)
    # text parts (joined by newlines for a template that writes content whole, as vLLM's): cut after the last
    parts = [messages[0], {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                                            {"type": "text", "text": "m"}]}]
    assert ours.render_chat(parts, continue_final_message=True, chat_template=chatml).endswith("assistant\na\nm")
    with pytest.raises(ValueError, match="does not write the final message's text"):
        ours.render_chat(messages, continue_final_message=True, chat_template="{{ messages[0].content }}")


def _text_state(tokenizer, prompt_ids, out_ids, read_text=True, every=None, **params):
    """Feed out_ids through a TextState as the engine does: its last output (its text checked
    against the deltas unless not `read_text`); `every`: a list each output is appended to."""
    from numa_runtime.outputs import TextState
    from numa_runtime.request import Request, RequestStatus
    from numa_runtime.sampling_params import SamplingParams

    class Group:
        request_id = "g"
    sp = SamplingParams(**params)
    req = Request("r", list(prompt_ids), sp)
    req.status = RequestStatus.RUNNING
    ts = TextState(req, IncrementalDetokenizer(tokenizer, prompt_ids, sp.skip_special_tokens), Group(),
                   set(tokenizer.eos_token_ids), tokenizer.named_eos_token_id)
    deltas, out = [], None
    for t in out_ids:
        req.append_output_token(t)
        status = ts.add_token(t, 1 << 20)
        if status is not None:
            req.status = status
        out = ts.output(0)
        deltas.append(out.delta)
        if every is not None:
            every.append(out)
        if status is not None:
            break
    assert not read_text or "".join(deltas) == out.text
    return out


def test_a_stop_string_shown_before_min_tokens_does_not_end_the_request_later(smol):
    """As vLLM: stops are not checked before min_tokens, and then only text that ends after the
    last check can match. A longer stop string beside it used to widen the search back over
    "What" of token 1, ending the request at min_tokens with its text cut to ''."""
    prompt = smol.encode("Q:")
    ids = smol.encode("What is it? It is a cat, a cat, a cat.", add_special_tokens=False)
    for stop in (["What"], ["What", "zzzzzzzzzz"]):
        out = _text_state(smol, prompt, ids, max_tokens=8, min_tokens=3, stop=stop)
        assert out.finish_reason == "length" and out.text == smol.decode(ids[:8]), (stop, out.text)
    out = _text_state(smol, prompt, ids, max_tokens=20, min_tokens=3, stop=["zzzzzzzzzz", "cat"])
    assert out.finish_reason == "stop" and out.stop_reason == "cat" and out.text == "What is it? It is a "


def test_text_released_at_the_end_is_checked_for_stop_strings(smol):
    """The last token holds the start of a character (released as U+FFFD at the end): that text
    is checked against the stop strings too, at max_tokens and at EOS."""
    prompt = smol.encode("Say:")
    ids = smol.encode("Hi 😀 there", add_special_tokens=False)[:2]  # "Hi", " " + part of 😀
    assert smol.decode(ids, skip_special_tokens=True) == "Hi \ufffd"
    out = _text_state(smol, prompt, ids, max_tokens=2, stop=[" "])
    assert (out.text, out.finish_reason, out.stop_reason) == ("Hi", "stop", " ")
    out = _text_state(smol, prompt, ids + [min(smol.eos_token_ids)], max_tokens=10, stop=["i "])
    assert (out.text, out.finish_reason, out.stop_reason) == ("H", "stop", "i ")


def test_outputs_pickle_with_their_text(smol):
    import pickle
    prompt = smol.encode("Q:")
    out = _text_state(smol, prompt, smol.encode("a cat", add_special_tokens=False), read_text=False, max_tokens=2)
    back = pickle.loads(pickle.dumps(out))  # NOTE: its text not read yet: built when pickled
    assert back.text == "a cat" and list(back.token_ids) == list(out.token_ids)


def test_a_chat_template_error_names_the_template_that_raised(smol_dir):
    """Under --chat-template (use_chat_template) an error named "the model's chat template"."""
    tok = Tokenizer.from_dir(smol_dir)  # NOTE: its own: use_chat_template changes it
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="^the given chat template rejected the conversation: nope"):
        tok.render_chat(msgs, chat_template="{{ raise_exception('nope') }}")
    tok.use_chat_template("{{ raise_exception('nope') }}")
    with pytest.raises(ChatTemplateError, match="^the --chat-template template rejected the conversation: nope"):
        tok.render_chat(msgs)


def test_running_text_leaves_out_what_a_stop_string_holds_back(smol):
    """While a request runs, an output's text is what its deltas sent: the characters held back
    as the possible start of a stop string are not in it (as vLLM's running text). They were,
    and the text then shrank when the stop completed ('Yes' running, 'Y' final)."""
    outs = []
    out = _text_state(smol, smol.encode("Say:"), smol.encode("Yes. No.", add_special_tokens=False),
                      every=outs, max_tokens=20, stop=["es."])
    texts = [o.text for o in outs]
    assert texts == ["".join(o.delta for o in outs[:k + 1]) for k in range(len(outs))]  # each: what was sent
    assert texts[-1] == "Y" and out.finish_reason == "stop"
    assert all(texts[-1].startswith(t) for t in texts)


# NOTE: the parts of Qwen2.5's template that read tool calls and content (arguments | tojson)
CALLS_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    ";{% endfor %}")


def test_openai_tool_history_renders_as_vllms_chat(smol):
    """Engine.chat / apply_chat_template take OpenAI's message form as vLLM's LLM.chat does: a
    tool call's arguments given as a JSON string reach the template as the object (they were
    encoded twice: "{\\"city\\": ...}"), content None is "" (templates reading message['content']
    failed), a string that is no JSON object is {}."""
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}},
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": ""}},
                {"id": "call_3", "type": "function", "function": {"name": "bad", "arguments": "[1]"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "20C"}]
    text = smol.render_chat(msgs, chat_template=CALLS_TEMPLATE, add_generation_prompt=False)
    assert text == '<|user|>Weather in Paris?;<|assistant|>[get_weather {"city": "Paris"}][now {}][bad {}];<|tool|>20C;'
    # NOTE: the server's own message form (arguments already an object) renders the same
    from numa_runtime.serve.protocol import ChatMessage
    served = [ChatMessage.model_validate(m).as_template_dict() for m in msgs]
    assert smol.render_chat(served, chat_template=CALLS_TEMPLATE, add_generation_prompt=False) == text


def test_a_developer_message_is_a_system_one_where_the_template_has_no_developer_role(smol):
    """As llama.cpp's server: newer OpenAI clients send the system prompt as role "developer";
    a template that never names that role (Qwen2.5's, SmolLM2's) dropped it unseen."""
    msgs = [{"role": "developer", "content": "ALWAYS ANSWER IN FRENCH"}, {"role": "user", "content": "hi"}]
    text = smol.render_chat(msgs)
    assert "ALWAYS ANSWER IN FRENCH" in text
    assert text == smol.render_chat([{"role": "system", "content": "ALWAYS ANSWER IN FRENCH"}, msgs[1]])
    own = "{% for m in messages %}{% if m.role == 'developer' %}D:{% endif %}{{ m.content }};{% endfor %}"
    assert smol.render_chat(msgs, chat_template=own, add_generation_prompt=False) == \
        "D:ALWAYS ANSWER IN FRENCH;hi;"


def test_the_hf_names_vllm_scripts_read(smol, smol_hf):
    """What scripts read from vLLM's LLM.get_tokenizer() (a transformers tokenizer) reads the same
    here: eos/bos tokens and ids, tokenizer(text).input_ids, len, token <-> id, batch_decode,
    get_vocab, the special ids, the chat template (each was an AttributeError)."""
    assert (smol.eos_token, smol.eos_token_id, smol.bos_token) == (smol_hf.eos_token, smol_hf.eos_token_id,
                                                                    smol_hf.bos_token)
    assert smol("Hello world").input_ids == smol_hf("Hello world").input_ids
    assert smol(["a b", "c"])["input_ids"] == smol_hf(["a b", "c"])["input_ids"]
    assert len(smol) == len(smol_hf) and smol.get_vocab() == smol_hf.get_vocab()
    assert smol.vocab_size == smol_hf.vocab_size and smol.get_added_vocab() == smol_hf.get_added_vocab()
    toks = smol_hf.convert_ids_to_tokens(smol_hf.encode("Hello world"))
    assert smol.convert_ids_to_tokens(smol.encode("Hello world")) == toks
    assert smol.convert_tokens_to_ids(toks) == smol_hf.convert_tokens_to_ids(toks)
    assert smol.convert_tokens_to_ids("<|im_end|>") == smol_hf.convert_tokens_to_ids("<|im_end|>")
    batch = [smol.encode("Hi there"), smol.encode("Bonjour")]
    assert smol.batch_decode(batch) == smol_hf.batch_decode(batch)
    assert sorted(smol.all_special_ids) == sorted(smol_hf.all_special_ids)
    assert smol.chat_template == smol_hf.chat_template
    msgs = [{"role": "user", "content": "Hi"}]
    got = smol.apply_chat_template(msgs, tokenize=True, return_dict=True, add_generation_prompt=True)
    want = smol_hf.apply_chat_template(msgs, tokenize=True, return_dict=True, add_generation_prompt=True)
    assert got["input_ids"] == list(want["input_ids"]) and got.attention_mask == list(want["attention_mask"])
    with pytest.raises(ValueError, match="return_tensors .* is not supported"):
        smol.apply_chat_template(msgs, tokenize=True, return_tensors="pt")


def test_apply_chat_template_and_decode_take_hf_defaults_and_forms(smol, smol_hf, tmp_path, smol_dir):
    """As HF's (what vLLM's get_tokenizer() gives): apply_chat_template gives ids and no generation
    prompt by default (ours gave the text with one), takes conversation= and a list of
    conversations, and a chat_template that names one of the model's templates renders it (its
    name came back as the text); decode takes one id or token_ids=; the unknown token and its id
    read as HF's, and a token outside the vocabulary converts to it (None)."""
    msgs = [{"role": "user", "content": "Hi"}]
    for kw in ({}, {"add_generation_prompt": True}, {"tokenize": False},
               {"tokenize": False, "add_generation_prompt": True}):
        assert smol.apply_chat_template(msgs, **kw) == smol_hf.apply_chat_template(msgs, **kw), kw
        assert smol.apply_chat_template(conversation=msgs, **kw) == smol_hf.apply_chat_template(conversation=msgs, **kw)
        two = [msgs, msgs + [{"role": "assistant", "content": "Hello"}]]
        assert smol.apply_chat_template(two, **kw) == smol_hf.apply_chat_template(two, **kw), kw
    assert smol.render_chat(msgs) == smol_hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert smol.apply_chat_template(msgs, add_generation_prompt=None, tokenize=False) == smol_hf.apply_chat_template(
        msgs, add_generation_prompt=None, tokenize=False)
    with pytest.raises(ValueError, match="empty conversation"):
        smol.apply_chat_template([])
    batch = [smol.encode("Hello"), smol.encode("there friend")]
    assert smol.decode(batch) == smol_hf.decode(batch) and smol.decode(np.array([batch[0], batch[0]])) == [
        "Hello", "Hello"]
    ids = smol.encode("Hello there")
    assert smol.decode(ids[0]) == smol_hf.decode(ids[0]) and smol.decode(np.int64(ids[0])) == smol_hf.decode(ids[0])
    assert smol.decode(token_ids=ids) == smol_hf.decode(token_ids=ids) and smol.decode(np.array(ids)) == "Hello there"
    assert (smol.unk_token, smol.unk_token_id) == (smol_hf.unk_token, smol_hf.unk_token_id)
    assert smol.convert_tokens_to_ids(["zzzzqqq", "Hello"]) == smol_hf.convert_tokens_to_ids(["zzzzqqq", "Hello"])
    assert smol.convert_tokens_to_ids("zzzzqqq") == smol_hf.convert_tokens_to_ids("zzzzqqq") == smol.unk_token_id
    d = tmp_path / "named"
    d.mkdir()
    shutil.copy(os.path.join(smol_dir, "tokenizer.json"), d / "tokenizer.json")
    cfg = json.loads(open(os.path.join(smol_dir, "tokenizer_config.json")).read())
    cfg["chat_template"] = [{"name": "default", "template": "D:{{ messages[0]['content'] }}"},
                            {"name": "tool_use", "template": "T:{{ messages[0]['content'] }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    named = Tokenizer.from_dir(str(d))
    assert named.apply_chat_template(msgs, chat_template="tool_use", tokenize=False) == "T:Hi"
    assert named.apply_chat_template(msgs, tokenize=False) == "D:Hi"


def test_the_tokenizer_call_takes_hf_padding_truncation_and_tensors(smol, smol_hf):
    """tok(texts, padding=True), truncation/max_length, return_tensors="np"/"pt" and encode's
    truncation and tensors read as HF's (each was a TypeError); text pairs and keywords this
    tokenizer lacks are refused in one sentence naming them."""
    import torch
    texts = ["a", "b c d e", "Hello world, how are you today?"]
    for kw in ({"padding": True}, {"truncation": True, "max_length": 3}, {"padding": "max_length", "max_length": 12},
               {"padding": True, "truncation": True, "max_length": 4}):
        assert dict(smol(texts, **kw)) == {k: list(v) for k, v in smol_hf(texts, **kw).items()}, kw
    for side in ("left", "right"):
        smol.padding_side = smol_hf.padding_side = side
        try:
            assert dict(smol(texts, padding=True)) == dict(smol_hf(texts, padding=True))
        finally:
            smol.padding_side = smol_hf.padding_side = "right"
    for kind in ("np", "pt"):
        ours, theirs = smol(texts, padding=True, return_tensors=kind), smol_hf(texts, padding=True, return_tensors=kind)
        assert type(ours["input_ids"]) is type(theirs["input_ids"])
        np.testing.assert_array_equal(np.asarray(ours["input_ids"]), np.asarray(theirs["input_ids"]))
        np.testing.assert_array_equal(np.asarray(ours["attention_mask"]), np.asarray(theirs["attention_mask"]))
    assert torch.equal(smol.encode("Hello there", return_tensors="pt"),
                       smol_hf.encode("Hello there", return_tensors="pt"))
    assert smol.encode("Hello world, how are you", truncation=True, max_length=2) == smol_hf.encode(
        "Hello world, how are you", truncation=True, max_length=2)
    assert smol("hi", return_attention_mask=False) == {"input_ids": smol.encode("hi")}
    with pytest.raises(ValueError, match="Text pairs"):
        smol("hi", "there")
    with pytest.raises(ValueError, match="does not support return_offsets_mapping"):
        smol("hi", return_offsets_mapping=True)
    with pytest.raises(ValueError, match="pass padding=True"):
        smol(texts, return_tensors="np")
    assert smol.is_fast and smol.name_or_path == smol_hf.name_or_path


def test_truncation_keeps_the_added_special_tokens_and_sides_come_from_the_config(smol_dir, tmp_path):
    """A tokenizer that wraps text in BOS/EOS (Llama 3's post-processor): truncation cuts the
    text and keeps them, on either side, and max_length alone truncates, as HF's (EOS, or BOS on
    the left, was cut away); padding_side and truncation_side come from the config (they were
    always right); padding='max_length' without max_length pads to model_max_length."""
    from tokenizers import processors
    d = tmp_path / "wrapped"
    d.mkdir()
    backend = Backend.from_file(os.path.join(smol_dir, "tokenizer.json"))
    bos, eos = "<|im_start|>", "<|im_end|>"
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A {eos}", special_tokens=[
        (bos, backend.token_to_id(bos)), (eos, backend.token_to_id(eos))])
    backend.save(str(d / "tokenizer.json"))
    cfg = json.loads(open(os.path.join(smol_dir, "tokenizer_config.json")).read())
    cfg.update(model_max_length=64, padding_side="left", truncation_side="left")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = Tokenizer.from_dir(str(d)), transformers.AutoTokenizer.from_pretrained(str(d))
    assert (ours.padding_side, ours.truncation_side) == (hf.padding_side, hf.truncation_side) == ("left", "left")
    long = "The quick brown fox jumps over the lazy dog again and again"
    for side in ("left", "right"):
        ours.truncation_side = hf.truncation_side = side
        for kw in ({"truncation": True, "max_length": 4}, {"max_length": 4}, {"truncation": True, "max_length": 2}):
            assert ours(long, **kw)["input_ids"] == hf(long, **kw)["input_ids"], (side, kw)
            assert ours.encode(long, **kw) == hf.encode(long, **kw), (side, kw)
    assert ours(long, truncation=True, max_length=4)["input_ids"][-1] == ours.convert_tokens_to_ids(eos)
    # vLLM's truncate_prompt_tokens: the text cut from the left whatever the config's side, the
    # special tokens kept (the last k ids had dropped the BOS)
    ours.truncation_side = hf.truncation_side = "left"
    want = hf(long, truncation=True, max_length=5)["input_ids"]
    ours.truncation_side = "right"
    assert ours.encode_last(long, 5) == want and want[0] == ours.convert_tokens_to_ids(bos)
    assert ours.encode_last(long, 100) == hf(long)["input_ids"]
    for kw in ({"padding": True}, {"padding": "max_length"}, {"padding": True, "padding_side": "right"}):
        assert dict(ours(["hi", long], **kw)) == {k: list(v) for k, v in hf(["hi", long], **kw).items()}, kw
    assert ours.encode("hi", padding="max_length", max_length=6) == hf.encode("hi", padding="max_length", max_length=6)
    with pytest.raises(ValueError, match="encode does not support stride"):
        ours.encode("hi", stride=2)


def test_decode_keeps_special_tokens_unless_skipped_as_hf(smol, smol_hf, smol_dir, tmp_path):
    """HF's decode keeps special tokens by default (ours skipped them); tokenize,
    convert_tokens_to_string, special_tokens_map, model_max_length and vocab read as HF's, and
    all_special_tokens lists a config's additional special tokens after the named ones."""
    ids = smol.encode("<|im_start|>user\nHi there<|im_end|>")
    assert smol.decode(ids) == smol_hf.decode(ids) == "<|im_start|>user\nHi there<|im_end|>"
    assert smol.decode(ids, skip_special_tokens=True) == smol_hf.decode(ids, skip_special_tokens=True)
    assert smol.batch_decode([ids, ids[1:]]) == smol_hf.batch_decode([ids, ids[1:]])
    for text in ("Hello world, hi", "  spaced\tout \u00e9t\u00e9 \U0001F600"):
        assert smol.tokenize(text) == smol_hf.tokenize(text)
        assert smol.convert_tokens_to_string(smol.tokenize(text)) == smol_hf.convert_tokens_to_string(
            smol_hf.tokenize(text))
    assert smol.convert_tokens_to_string(["Hello", "nosuchtoken"]) == smol_hf.convert_tokens_to_string(
        ["Hello", "nosuchtoken"])
    assert smol.special_tokens_map == smol_hf.special_tokens_map
    assert smol.model_max_length == smol_hf.model_max_length == 8192
    assert smol.vocab == smol_hf.vocab
    d = tmp_path / "tok"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(smol_dir, name), d / name)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["additional_special_tokens"] = ["<|im_start|>", "<repo_name>"]
    del cfg["model_max_length"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = Tokenizer.from_dir(str(d)), transformers.AutoTokenizer.from_pretrained(str(d))
    assert ours.all_special_tokens == hf.all_special_tokens and "<repo_name>" in ours.all_special_tokens
    assert sorted(ours.all_special_ids) == sorted(hf.all_special_ids)
    assert ours.special_tokens_map == hf.special_tokens_map
    assert ours.model_max_length == hf.model_max_length


def test_tokens_the_config_names_are_special_as_in_transformers(tmp_path):
    """A pad token that tokenizer.json holds as a normal added token, a base-vocabulary token
    named as an additional special token, and transformers 5's named extra_special_tokens: each is
    special, as transformers makes them on load (matched as one token, left out of a text that
    skips special tokens); they stayed in texts, or were not named at all."""
    d = _train_byte_level(tmp_path, {})
    tok = Backend.from_file(str(d / "tokenizer.json"))
    tok.add_tokens(["<tool_call>"])  # NOTE: not special in tokenizer.json
    base = next(t for t, i in sorted(tok.get_vocab(with_added_tokens=False).items(), key=lambda kv: kv[1])
                if len(t) > 3 and t.isalpha())
    tok.save(str(d / "tokenizer.json"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(pad_token="<tool_call>", extra_special_tokens={"image_token": base})
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, theirs = Tokenizer.from_dir(str(d)), transformers.AutoTokenizer.from_pretrained(str(d))
    text = f"the <tool_call> lazy{base} dog"
    ids = ours.encode(text)
    assert ids == theirs.encode(text) and ours.convert_tokens_to_ids(base) in ids
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert "<tool_call>" not in ours.decode(ids, skip_special_tokens=True)
    assert sorted(ours.all_special_ids) == sorted(theirs.all_special_ids)
    deltas, tail = _stream(ours, ids)
    assert "".join(deltas) + tail == ours.decode(ids, skip_special_tokens=True)


def test_a_stream_leaves_out_the_special_tokens_decode_leaves_out(tmp_path):
    """A special token of tokenizer.json that the config does not name, right after bytes that make
    no character (the stream's byte path): it was kept in the streamed text ("the\ufffd<|im_start|> the")."""
    d = _train_metaspace(tmp_path)
    tok = Backend.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>"])
    tok.save(str(d / "tokenizer.json"))
    ours = Tokenizer.from_dir(str(d))
    ids = (ours.encode("the", add_special_tokens=False) + [ours.convert_tokens_to_ids(t) for t in ("<0xE6>", "<0x80>")]
           + [ours.convert_tokens_to_ids("<|im_start|>")] + ours.encode(" the", add_special_tokens=False))
    deltas, tail = _stream(ours, ids)
    # NOTE: the stream's bytes make one U+FFFD of the cut character, decode() one a byte (by design)
    assert ours.decode(ids, skip_special_tokens=True) == "the\ufffd\ufffd the"
    assert "".join(deltas) + tail == "the\ufffd the"


@pytest.mark.parametrize("name,content,words", [
    ("tokenizer.json", '{"model": {"type": "Foo"}}', "is not a tokenizer.json the tokenizers library reads"),
    ("tokenizer_config.json", "{'bos_token': 1}", "tokenizer_config.json is not valid JSON")])
def test_a_tokenizer_file_that_cannot_be_read_is_named(tmp_path, name, content, words):
    d = _train_byte_level(tmp_path, {})
    (d / name).write_text(content)
    from numa_runtime.config import UnsupportedModelError
    with pytest.raises(UnsupportedModelError, match=words):
        Tokenizer.from_dir(str(d))


def test_added_tokens_decoder_of_the_config_applies_as_in_transformers(tmp_path):
    """tokenizer_config's added_tokens_decoder over tokenizer.json, as transformers reads it: a
    token's special / lstrip / rstrip flags are the config's (a pad-like token stayed in texts and
    kept its spaces), and a token it adds at the next id is added (it was 10 pieces of its text)."""
    d = _train_byte_level(tmp_path, {})
    tok = Backend.from_file(str(d / "tokenizer.json"))
    tok.add_tokens(["<|x|>"])
    tok.save(str(d / "tokenizer.json"))
    x, new = tok.token_to_id("<|x|>"), tok.get_vocab_size(with_added_tokens=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {
        str(x): {"content": "<|x|>", "special": True, "lstrip": True, "rstrip": True, "single_word": False,
                 "normalized": False},
        str(new): {"content": "<|new|>", "special": True, "lstrip": False, "rstrip": False, "single_word": False,
                   "normalized": False}}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, theirs = Tokenizer.from_dir(str(d)), transformers.AutoTokenizer.from_pretrained(str(d))
    for text in ("the <|x|> lazy", "a<|new|> dog <|x|>", "<|new|><|x|>"):
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.encode("<|new|>", add_special_tokens=False) == [new] and len(ours) == len(theirs) == new + 1
