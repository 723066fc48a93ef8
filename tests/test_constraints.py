"""Output constraints beyond a JSON schema, as vLLM's: structured_outputs (regex, choice, Lark or
GBNF grammar, json, json_object; guided_decoding its older name), allowed_token_ids, bad_words;
on the Engine and through the OpenAI server."""
import dataclasses
import json
import re

import numpy as np
import pytest

from models import build_model

from numa_runtime import Engine, GuidedDecodingParams, SamplingParams, StructuredOutputsParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    build_model(str(d), arch="llama")
    return str(d)


@pytest.fixture(scope="module")
def eng(model_dir):
    e = Engine(model_dir, dtype="float32", kv_cache_memory=1 << 24, max_model_len=256)
    yield e
    e.close()


PLATE = r"[a-z]{2,4}-[0-9]{3}"


def test_regex_is_matched_whole_and_ends_the_output(eng):
    """A random model sampling at temperature 1 writes only what the regex allows, and stops
    when the regex is complete; n > 1 (copies of the params) keeps the constraint."""
    outs = eng.generate(["Hello", "The quick brown fox"], SamplingParams(
        n=2, temperature=1.0, seed=5, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=PLATE)))
    for o in outs:
        for c in o.outputs:
            assert re.fullmatch(PLATE, c.text), c.text
            assert c.finish_reason == "stop"
    assert not eng.has_unfinished_requests()


def test_choice_gives_one_of_the_strings(eng):
    choices = ["red", "green", "blue sky", "näive"]
    seen = set()
    for seed in range(8):
        o = eng.generate("Pick one", SamplingParams(temperature=1.0, seed=seed, max_tokens=20,
                                                    structured_outputs={"choice": choices}))[0]
        assert o.text in choices and o.finish_reason == "stop", o.text
        seen.add(o.text)
    assert len(seen) > 1  # sampled, not one string forced


@pytest.mark.parametrize("grammar", [
    'start: "(" num ("+" num)? ")"\nnum: /[0-9]/',          # Lark
    'root ::= "(" num ("+" num)? ")"\nnum ::= [0-9]',       # llama.cpp's GBNF
])
def test_grammar_lark_or_gbnf(eng, grammar):
    for seed in range(3):
        o = eng.generate("Sum", SamplingParams(temperature=1.0, seed=seed, max_tokens=20,
                                               guided_decoding=GuidedDecodingParams(grammar=grammar)))[0]
        assert re.fullmatch(r"\([0-9](\+[0-9])?\)", o.text) and o.finish_reason == "stop", o.text


def test_structured_outputs_json_is_a_json_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for so in ({"json": schema}, {"json": json.dumps(schema)}, StructuredOutputsParams(json=schema)):
        assert SamplingParams(structured_outputs=so).constraint == ("json", schema)
    assert SamplingParams(structured_outputs={"json_object": True}).constraint == ("json", {"type": "object"})
    sp = SamplingParams(n=2, json_schema=schema)
    assert dataclasses.replace(sp, n=1).constraint == ("json", schema)  # the engine's per-choice copy
    sp = SamplingParams(n=2, structured_outputs={"regex": "a+"})
    assert dataclasses.replace(sp, n=1).constraint == ("regex", "a+")


@pytest.mark.parametrize("kwargs, message", [
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"structured_outputs": {}}, "exactly one of .* got none"),
    ({"structured_outputs": {"pattern": "a"}}, "no field 'pattern'"),
    ({"structured_outputs": {"choice": []}}, "choice must be a non-empty list"),
    ({"structured_outputs": {"choice": ["a", 3]}}, "choice must be a non-empty list"),
    ({"structured_outputs": {"json": "{not json"}}, "json must be a JSON schema"),
    ({"structured_outputs": {"regex": ""}}, "regex must be a non-empty string"),
    ({"structured_outputs": "a+"}, "must be a StructuredOutputsParams or a dict"),
    ({"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}}, "not both"),
    ({"json_schema": {"type": "object"}, "structured_outputs": {"regex": "a"}}, "Give one output constraint"),
    ({"structured_outputs": {"regex": "a"}, "min_tokens": 2}, "min_tokens cannot be combined"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids must be a non-empty list"),
    ({"bad_words": "word"}, "bad_words must be a list"),
    ({"bad_words": ["ok", " "]}, "bad_words must be a list of non-empty strings"),
    ({"bad_words": ["\ud800"]}, "bad_words must be valid Unicode text, but it holds a lone surrogate"),
])
def test_bad_constraints_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unusable_regex_or_grammar_is_refused_naming_its_field(eng):
    # NOTE: in one sentence, without the column and doubled backslashes of llguidance's own wrapping
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex cannot be used: unclosed group\.$"):
        eng.generate("Hello", SamplingParams(structured_outputs={"regex": "(ab"}))
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex cannot be used: backreferences are not "
                                         r"supported\.$"):
        eng.generate("Hello", SamplingParams(structured_outputs={"regex": "(a)\\1"}))
    with pytest.raises(ValueError, match=r"^structured_outputs\.grammar cannot be used: "):
        eng.generate("Hello", SamplingParams(structured_outputs={"grammar": "start: undefined_rule"}))
    with pytest.raises(ValueError, match="allowed_token_ids names token 100000"):
        eng.generate("Hello", SamplingParams(allowed_token_ids=[1, 100000]))
    assert not eng.has_unfinished_requests()
    assert eng.generate("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].token_ids


def test_allowed_token_ids_picks_the_best_allowed_token(eng):
    """Greedy with allowed_token_ids takes the most likely allowed token: leaving out the model's
    first and second choices makes it take the third, at every step only allowed ids."""
    free = eng.generate("Hello world", SamplingParams(temperature=0, max_tokens=1, logprobs=3, ignore_eos=True))[0]
    ranked = list(free.outputs[0].logprobs[0])  # most likely first
    assert len(ranked) == 3
    allowed = [ranked[2], 7, 11, 13]
    out = eng.generate("Hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                     allowed_token_ids=allowed))[0]
    assert out.token_ids[0] == ranked[2] or out.token_ids[0] in (7, 11, 13) and ranked[2] not in (7, 11, 13)
    assert set(out.token_ids) <= set(allowed)
    sampled = eng.generate("Hello world", SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True,
                                                         allowed_token_ids=[5, 6]))[0]
    assert set(sampled.token_ids) <= {5, 6}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_filters_that_leave_no_token_end_the_request_in_an_error(eng, temperature):
    """allowed_token_ids that min_tokens or bad_words ban whole: greedy took token 0 of a row of
    -inf and sampling the last id, tokens the request excludes, without a word. The request
    ends in an error naming the fields, its tokens up to there and no more; a batch neighbour
    runs on."""
    eos = eng.tokenizer.eos_token_id
    word = eng.tokenizer.encode("e", add_special_tokens=False)
    cases = [(dict(allowed_token_ids=[eos], min_tokens=3), 0, "allowed_token_ids and min_tokens (which bans EOS"),
             (dict(allowed_token_ids=[17], stop_token_ids=[17], min_tokens=2), 0, "allowed_token_ids and min_tokens"),
             (dict(allowed_token_ids=word, bad_words=["e"]), 0,
              "allowed_token_ids and bad_words leave no token")]
    assert len(word) == 1, word  # NOTE: bad_words bans a one-token word at every position
    for kw, n, words in cases:
        sp = SamplingParams(temperature=temperature, seed=2, max_tokens=8, ignore_eos=True, **kw)
        fine = SamplingParams(temperature=temperature, seed=2, max_tokens=4, ignore_eos=True)
        bad, ok = eng.generate(["Hello world", "Hello world"], [sp, fine])
        o = bad.outputs[0]
        assert o.finish_reason == "error" and words in o.stop_reason, (kw, o.token_ids, o.stop_reason)
        assert o.stop_reason.endswith("leave no token it may sample next, so it ends here.")
        assert len(o.token_ids) == n
        assert set(o.token_ids) <= set(kw["allowed_token_ids"]) - {eos, *kw.get("stop_token_ids", [])}
        assert ok.outputs[0].finish_reason == "length" and len(ok.outputs[0].token_ids) == 4
    assert not eng.has_unfinished_requests()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_constraint_that_allowed_token_ids_leave_no_token_ends_in_an_error(eng, temperature):
    """A choice whose tokens allowed_token_ids all exclude: greedy took token 0 of a row of -inf
    (an end-of-sequence token for some tokenizers), which ended the request as a normal stop
    with text the choice refuses; every token now goes through the grammar."""
    ids = eng.tokenizer.encode("yes no", add_special_tokens=False)
    allowed = [t for t in range(3, 60) if t not in ids][:5]
    o = eng.generate("Answer:", SamplingParams(temperature=temperature, seed=1, max_tokens=10,
                                               allowed_token_ids=allowed,
                                               structured_outputs={"choice": ["yes", "no"]}))[0].outputs[0]
    assert o.finish_reason == "error", (o.text, o.finish_reason)
    assert o.stop_reason.startswith("the choice could not be followed: ") and o.stop_reason.endswith(
        "(allowed_token_ids or bad_words may exclude every token it allows next)."), o.stop_reason
    assert not eng.has_unfinished_requests()


def test_thousands_of_choices_and_properties_are_followed(eng):
    """3000 choices (quotes, backslashes, regex characters, non-ASCII) and an object of 600
    optional properties: as one Lark rule each alternative was an item of the parser's row,
    and past 2000 the request failed after its first token."""
    choices = [f'c{i} "q" \\ .*+?()[]{{}}|^$ é😀' for i in range(3000)]
    for seed in range(3):
        o = eng.generate("Pick", SamplingParams(temperature=1.0, seed=seed, max_tokens=40,
                                                structured_outputs={"choice": choices}))[0].outputs[0]
        assert o.finish_reason == "stop" and o.text in choices, (o.text, o.finish_reason, o.stop_reason)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)},
              "required": ["p599"]}
    o = eng.generate("Hello", SamplingParams(temperature=1.0, seed=0, max_tokens=40, json_schema=schema))[0].outputs[0]
    assert o.finish_reason in ("stop", "length") and len(o.token_ids) > 3, (o.text, o.finish_reason, o.stop_reason)
    assert o.finish_reason == "length" or "p599" in json.loads(o.text), o.text


def _contains(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_bad_words_never_appear_in_the_output(eng):
    """A word the unconstrained greedy output writes (one token, then two) is banned: the output
    changes and no tokenization of the word vLLM bans appears in it."""
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    free = eng.generate("Hello world", sp)[0].token_ids
    words = []
    for width in (1, 2):
        for i in range(len(free) - width + 1):
            word = eng.tokenizer.decode(free[i:i + width], skip_special_tokens=True).strip()
            if word and free[i:i + width] in eng._bad_words_ids([word]):
                words.append((word, free[i:i + width]))
                break
    assert len(words) == 2, "the model's greedy output has no word to ban"
    for word, ids in words:
        out = eng.generate("Hello world", dataclasses.replace(sp, bad_words=[word]))[0].token_ids
        assert out != free
        for banned in eng._bad_words_ids([word]):
            assert not _contains(out, banned), (word, banned, out)


def test_constraints_through_the_server(model_dir, eng):
    """guided_regex / guided_choice / guided_grammar / structured_outputs / allowed_token_ids /
    bad_words through the official openai client; a bad one is a 400 naming its field."""
    import openai
    from test_server import ServerProcess

    from numa_runtime.serve.responses import token_text

    srv = ServerProcess(["--model", model_dir, "--dtype", "float32", "--max-model-len", "256", "--num-threads", "1"])
    try:
        client = srv.client()
        model = client.models.list().data[0].id
        kw = dict(model=model, max_tokens=30, temperature=1.0, seed=2)
        r = client.completions.create(prompt="Hello", extra_body={"guided_regex": PLATE}, **kw)
        assert re.fullmatch(PLATE, r.choices[0].text) and r.choices[0].finish_reason == "stop"
        r = client.chat.completions.create(messages=[{"role": "user", "content": "Pick"}],
                                           extra_body={"guided_choice": ["yes", "no"]}, **kw)
        assert r.choices[0].message.content in ("yes", "no")
        r = client.chat.completions.create(messages=[{"role": "user", "content": "Pick"}], stream=True,
                                           extra_body={"structured_outputs": {"regex": PLATE}}, **kw)
        text = "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        assert re.fullmatch(PLATE, text), text
        small = {"type": "integer", "minimum": 0, "maximum": 99}
        pair = {"type": "object", "properties": {"a": small, "b": small}, "required": ["a", "b"]}
        for extra in ({"structured_outputs": {"disable_any_whitespace": True}},
                      {"structured_outputs": {"json": None, "regex": None, "disable_any_whitespace": True}},
                      {"guided_json": pair, "structured_outputs": {"disable_any_whitespace": True}}):
            fmt = {} if "guided_json" in extra else {"response_format": {"type": "json_schema", "json_schema": {
                "name": "pair", "schema": pair}}}
            r = client.chat.completions.create(messages=[{"role": "user", "content": "Pair"}], extra_body=extra,
                                               **{**kw, "max_tokens": 40}, **fmt)
            text = r.choices[0].message.content
            assert text == json.dumps(json.loads(text), separators=(",", ":")), text
        r = client.completions.create(prompt="Sum", extra_body={"guided_grammar": 'root ::= "(" [0-9] ")"'}, **kw)
        assert re.fullmatch(r"\([0-9]\)", r.choices[0].text)
        r = client.completions.create(prompt="Hello", extra_body={"allowed_token_ids": [5, 6]}, logprobs=1,
                                      **{**kw, "max_tokens": 8})
        tokens = r.choices[0].logprobs.tokens
        assert len(tokens) == 8 and set(tokens) <= {token_text(eng.tokenizer.token_bytes(t)) for t in (5, 6)}
        for body, field in (({"guided_regex": "(ab"}, "guided_regex"),
                            ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs"),
                            ({"guided_choice": "yes"}, "guided_choice"),
                            ({"guided_regex": "a", "guided_choice": ["b"]}, None),
                            ({"guided_regex": "a", "response_format": {"type": "json_object"}}, None),
                            ({"allowed_token_ids": [10 ** 6]}, "allowed_token_ids"),
                            ({"bad_words": "x"}, "bad_words")):
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(prompt="Hello", extra_body=body, **kw)
            if field:
                assert e.value.body["param"] == field, (body, e.value.body)
            assert "\n" not in e.value.body["message"]
        # a word the greedy output starts with, banned: the server writes what the Engine writes
        greedy = dict(model=model, max_tokens=12, temperature=0)
        free = eng.generate("Hello", SamplingParams(temperature=0, max_tokens=12))[0]
        word = eng.tokenizer.decode(free.token_ids[:1], skip_special_tokens=True).strip()
        assert word and free.token_ids[:1] in eng._bad_words_ids([word])
        want = eng.generate("Hello", SamplingParams(temperature=0, max_tokens=12, bad_words=[word]))[0].text
        assert want != free.text
        assert client.completions.create(prompt="Hello", **greedy).choices[0].text == free.text
        r = client.completions.create(prompt="Hello", extra_body={"bad_words": [word]}, **greedy)
        assert r.choices[0].text == want
    finally:
        srv.stop()


def test_bad_word_rule_matches_vllm():
    from numa_runtime.sampler import bad_word_bans
    words = [[7], [3, 4], [1, 2, 9]]
    assert bad_word_bans(words, []) == [7]
    assert bad_word_bans(words, [5, 3]) == [7, 4]
    assert bad_word_bans(words, [1, 2]) == [7, 9]
    assert bad_word_bans(words, [2]) == [7]


def test_logprobs_of_a_constrained_request_are_of_the_allowed_tokens(eng):
    """As vLLM V1 (its grammar bitmask comes before the sampler): with an output constraint the
    logprobs are those of the masked distribution; the allowed tokens' probabilities sum to 1
    and a forbidden token never shows with a finite logprob."""
    import math
    out = eng.generate("Pick", SamplingParams(temperature=0, max_tokens=10, logprobs=20,
                                              structured_outputs={"choice": ["yes", "no"]}))[0]
    c = out.outputs[0]
    assert c.text in ("yes", "no")
    text = ""
    for tid, step in zip(c.token_ids, c.logprobs):
        finite = {t: lp.logprob for t, lp in step.items() if lp.logprob > -math.inf}
        assert abs(sum(math.exp(v) for v in finite.values()) - 1.0) < 1e-4, finite
        for t in finite:
            assert any(w.startswith(text + eng.tokenizer.decode([t], skip_special_tokens=True))
                       for w in ("yes", "no")), t
        text += eng.tokenizer.decode([tid], skip_special_tokens=True)


def test_logprob_rank_counts_ties_and_min_tokens_bans_eos_with_ignore_eos(eng):
    """vLLM's rank counts the tokens at least as likely (a tie ranks 2, not 1); min_tokens bans EOS
    even with ignore_eos (vLLM always adds EOS to the min_tokens stop set)."""
    from numa_runtime.sampler import rank_of
    assert rank_of(np.array([1.0, 3.0, 3.0, 0.0]), 1) == 2 and rank_of(np.array([1.0, 3.0, 3.0, 0.0]), 0) == 3
    eos = min(eng.eos_ids)
    out = eng.generate("Hello", SamplingParams(temperature=0, max_tokens=8, min_tokens=5, ignore_eos=True,
                                               logit_bias={eos: 50.0}))[0]
    assert eos not in out.token_ids[:5] and out.token_ids[5:] == [eos] * 3, out.token_ids


def test_a_constraint_set_after_construction_counts(eng):
    """As vLLM reads the params when a request is added: structured_outputs or json_schema set on
    a SamplingParams after it was made constrain the output (they were ignored with n=1), and one
    cleared no longer does."""
    sp = eng.get_default_sampling_params()
    sp.max_tokens, sp.seed, sp.temperature = 12, 0, 1.0
    sp.structured_outputs = StructuredOutputsParams(choice=["yes", "no"])
    assert eng.generate("Pick", sp)[0].text in ("yes", "no")
    later = SamplingParams(max_tokens=40, seed=0, temperature=1.0)
    later.json_schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                         "additionalProperties": False}
    assert set(json.loads(eng.generate("Pick", later)[0].text)) == {"a"}
    cleared = SamplingParams(max_tokens=12, structured_outputs={"choice": ["yes", "no"]})
    cleared.structured_outputs = None
    assert cleared.constraint is None
    sp.guided_decoding = {"regex": "a"}
    with pytest.raises(ValueError, match="not both"):
        eng.generate("Pick", sp)
    # the constraint as it is when the request is added: one edited in place counts (a memo of the
    # first kept it), and min_tokens is refused however the constraint was set
    so = StructuredOutputsParams(regex="[a-c]{3}")
    edited = SamplingParams(temperature=0, max_tokens=10, structured_outputs=so)
    assert re.fullmatch("[a-c]{3}", eng.generate("Pick", edited)[0].text)
    so.regex = "[x-z]{5}"
    assert re.fullmatch("[x-z]{5}", eng.generate("Pick", edited)[0].text)
    late = SamplingParams(min_tokens=5, max_tokens=20)
    late.structured_outputs = StructuredOutputsParams(choice=["yes", "no"])
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured output"):
        eng.generate("Pick", late)
    assert not eng.has_unfinished_requests()


@pytest.mark.parametrize("grammar, pattern", [
    ('?start: "yes" | "no"', r"yes|no"),                                  # Lark's ?start
    ('root ::= "caf\\u00e9" [\\x41-\\x43]', r"café[A-C]"),            # GBNF escapes
    ('root ::= start\nstart ::= "x" [0-9]', r"x[0-9]"),                   # a rule named start
    ('root ::= "\\\\u0041" | "\\\\x"', r"\\u0041|\\x"),               # escaped backslashes stay text
    # NOTE: control characters and quotes as escapes (the converter wrote \u0000 as \u and \u0022 ended the string)
    ('root ::= [^\\u0000-\\u001F]{1,4} "\\u0009" "\\u0022"', r'[^\x00-\x1f]{1,4}\t"'),
    ('root ::= [\\u00A0-\\uFFFF] [\\U0001F600-\\U0001F64F]', r"[\u00a0-\uffff][\U0001F600-\U0001F64F]"),
])
def test_grammars_as_vllm_and_llama_cpp_write_them(eng, grammar, pattern):
    out = eng.generate("Go", SamplingParams(temperature=1.0, seed=1, max_tokens=20,
                                            structured_outputs={"grammar": grammar}))[0]
    assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop", out.text


def test_regex_digits_are_ascii_and_an_empty_regex_says_so(eng):
    """\\d is [0-9] (llguidance's is Unicode's: Devanagari digits came out); a regex that
    matches nothing says so (it spoke of a JSON $ref)."""
    from numa_runtime.structured import ascii_classes
    assert ascii_classes(r"\d{2}[\d.]\D\\d") == r"[0-9]{2}[0-9.][^0-9]\\d"
    for seed in range(6):
        text = eng.generate("Hello", SamplingParams(temperature=1.0, seed=seed, max_tokens=10,
                                                    structured_outputs={"regex": r"\d{3}"}))[0].text
        assert re.fullmatch("[0-9]{3}", text), text
    # NOTE: \w too ([A-Za-z0-9_], as vLLM's backends and a JSON schema's ECMA-262 pattern read it): llguidance's
    # let accented and CJK letters through
    # (a hyphen after a class stays literal: [\w-.] of an e-mail pattern; \W in a class is a nested class)
    assert ascii_classes(r"\w+[\w-.][^\W]\W") == r"[A-Za-z0-9_]+[A-Za-z0-9_\-.][^[^A-Za-z0-9_]][^A-Za-z0-9_]"
    assert ascii_classes(r"[\w--\d]") == r"[A-Za-z0-9_--0-9]"  # NOTE: "--", a class difference, stays one
    schema = {"type": "object", "properties": {"k": {"type": "string", "pattern": r"^\w{6}$"}}, "required": ["k"]}
    for seed in range(6):
        for spec in ({"regex": r"\w{6}"}, {"regex": r"[^\W]{6}"}, {"json": schema}):
            text = eng.generate("Hello", SamplingParams(temperature=1.0, seed=seed, max_tokens=40,
                                                        structured_outputs=spec))[0].text
            word = text if "regex" in spec else json.loads(text)["k"]
            assert re.fullmatch("[A-Za-z0-9_]{6}", word), (spec, text)
    email = {"type": "string", "pattern": r"^[\w-\.]+@([\w-]+\.)+[\w-]{2,4}$"}  # NOTE: refused by a rewrite once
    for spec in ({"json": email}, {"regex": email["pattern"][1:-1]}):
        assert eng.generate("Hello", SamplingParams(max_tokens=4, structured_outputs=spec))[0].finish_reason == "length"
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex cannot be used: it matches no text\.$"):
        eng.generate("Hello", SamplingParams(structured_outputs={"regex": r"[^\s\S]"}))
    with pytest.raises(ValueError, match="allowed_token_ids names token"):
        eng.generate("Hello", SamplingParams(allowed_token_ids=[len(eng.tokenizer)]))



def test_json_constraints_allow_no_undeclared_property_by_default(eng):
    """As vLLM's default backend (xgrammar, strict): a JSON schema's objects take only the
    properties they declare, unless the schema opens them (additionalProperties); llguidance
    allowed any, and models filled their output with made-up keys (a forced tool call's
    arguments then failed **kwargs)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def accepts(spec, text, rid):
        eng.grammars.add(rid, "json", spec)
        try:
            m = eng.grammars._matchers[rid]
            ids = eng.tokenizer.encode(text, add_special_tokens=False)
            return all(m.consume_token(int(t)) for t in ids)
        finally:
            eng.grammars.forget(rid)
    assert accepts(schema, '{"a": 1}', "s1")
    assert not accepts(schema, '{"a": 1, "b": 2}', "s2")
    assert accepts({**schema, "additionalProperties": True}, '{"a": 1, "b": 2}', "s3")
    assert accepts({"type": "object"}, '{"b": 2}', "s4")  # NOTE: json_object: any object
    # a base object with variants (properties beside oneOf/anyOf branches that add their own): each
    # part stays open, or no instance could satisfy both (it was refused as unsatisfiable)
    for key in ("oneOf", "anyOf"):
        shape = {"type": "object", "properties": {"kind": {"enum": ["circle", "square"]}}, "required": ["kind"],
                 key: [{"properties": {"radius": {"type": "integer"}}, "required": ["radius"]},
                       {"properties": {"side": {"type": "integer"}}, "required": ["side"]}]}
        assert accepts(shape, '{"kind": "circle", "radius": 2}', "s5" + key)
        assert not accepts(shape, '{"kind": "circle"}', "s6" + key)


def test_disable_any_whitespace_writes_json_compact(eng):
    """vLLM's disable_any_whitespace: the JSON comes out compact (',' and ':'), as xgrammar
    writes it; it was taken and the output still had ', ' and ': '."""
    small = {"type": "integer", "minimum": 0, "maximum": 99}
    schema = {"type": "object", "properties": {"a": small, "b": {"type": "array", "items": small, "minItems": 2,
                                                                 "maxItems": 2}}, "required": ["a", "b"]}
    for compact in (False, True):
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
        assert so.constraint()[0] == ("json_compact" if compact else "json")
        for obj in ({"json": schema, "disable_any_whitespace": compact}, so):
            out = eng.generate("Hello", SamplingParams(temperature=0, max_tokens=60, structured_outputs=obj))[0]
            value = json.loads(out.text)
            assert out.text == json.dumps(value, separators=(",", ":") if compact else (", ", ": ")), out.text
    rid = "compact"
    eng.grammars.add(rid, "json_compact", schema)
    try:
        m = eng.grammars._matchers[rid]
        assert not all(m.consume_token(int(t)) for t in eng.tokenizer.encode('{"a": 1', add_special_tokens=False))
    finally:
        eng.grammars.forget(rid)
    with pytest.raises(ValueError, match="one output constraint"):
        SamplingParams(json_schema=schema, structured_outputs={"json": {"type": "object"},
                                                               "disable_any_whitespace": True})
    both = SamplingParams(json_schema=schema, structured_outputs={"json": schema, "disable_any_whitespace": True})
    assert both.constraint == ("json_compact", schema)
    # NOTE: as vLLM: options alone beside a schema given elsewhere (response_format) are that schema's
    beside = SamplingParams(json_schema=schema, structured_outputs={"disable_any_whitespace": True})
    assert beside.constraint == ("json_compact", schema)
    with pytest.raises(ValueError, match="backend 'xgrammar' is not available"):
        SamplingParams(json_schema=schema, structured_outputs={"backend": "xgrammar"})
    with pytest.raises(ValueError, match="exactly one of json, regex"):
        SamplingParams(structured_outputs={"disable_any_whitespace": True})
