"""Structured output: a JSON schema enforced while sampling (rank 0).

llguidance (a maintained grammar engine) reads the model's own tokenizer.json and, for each
request with `SamplingParams.json_schema`, keeps a matcher that says which tokens may come
next. The sampler masks the others out; the engine feeds each sampled token back and ends the
request when the schema is complete.
"""
from __future__ import annotations

import json
import re
import threading

import numpy as np


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 - the bitmask helpers
    except ImportError:
        raise ValueError("json_schema needs the llguidance package; install it with "
                         "`pip install llguidance`.") from None
    return llguidance


# NOTE: json.dumps' layout; flexible whitespace would let a model spend its tokens on newlines.
# "json_compact" (disable_any_whitespace): json.dumps' separators=(",", ":"), as xgrammar writes it
_LAYOUT = {"json": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
           "json_compact": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}}


class Grammars:
    """The grammar matchers of the requests that have a json_schema, by request id."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        self._tokenizer, self._vocab, self._eos = tokenizer, vocab_size, sorted(eos_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._matchers: dict = {}
        self._kinds: dict[str, str] = {}

    def prepare(self):
        """Build llguidance's view of the tokenizer (about a second for 50k tokens; once)."""
        with self._lock:
            if self._ll_tokenizer is None:
                llg = _llguidance()
                try:
                    self._ll_tokenizer = llg.LLTokenizer(_llguidance_json(self._tokenizer.to_json()),
                                                         n_vocab=self._vocab, eos_token=self._eos)
                except ValueError as e:  # NOTE: the model's files disagree: the server's fault, not the request's
                    raise RuntimeError(f"Structured output cannot run on this model: its tokenizer does not fit "
                                       f"its {self._vocab}-token vocabulary ({e}).") from None
        return self._ll_tokenizer

    def add(self, request_id: str, kind: str, spec) -> None:
        """Start a matcher for the request's constraint (SamplingParams.constraint: "json" and a
        schema, "regex", "choice" or "grammar"); ValueError naming the field if it cannot be used
        (a schema that nests too deep or that no finite JSON value completes from its start, a
        regex or grammar that does not parse)."""
        llg = _llguidance()
        field = _FIELD[kind]
        if kind in _LAYOUT:
            if nesting_depth(spec, MAX_TEXT_DEPTH, refs=False) > MAX_TEXT_DEPTH:
                raise ValueError(f"json_schema cannot be used: its JSON nests more than {MAX_TEXT_DEPTH} objects and "
                                 "lists deep; move the deep parts into $defs and $ref them.")
            depth = nesting_depth(spec, MAX_DEPTH)
            if depth > MAX_DEPTH:
                raise ValueError(f"json_schema cannot be used: it nests more than {MAX_DEPTH} levels deep "
                                 f"(through its $refs).")
        try:
            grammar = _grammar(llg, kind, spec)
        except (ValueError, TypeError, RuntimeError) as e:
            raise ValueError(f"{field} cannot be used: {_first_line(str(e), kind)}.") from None
        tokenizer = self.prepare()
        # NOTE: llguidance's compiler recurses natively as deep as the schema's $ref chains: on a
        # thread of its own with a large stack, so that no schema within MAX_DEPTH can overflow
        # the engine thread's stack (a chain of 3000 $refs was a segmentation fault)
        matcher = _on_big_stack(lambda: self._first_mask(llg.LLMatcher(tokenizer, grammar, log_level=0,
                                                                        limits=_limits(llg))))
        if matcher.is_error():
            raise ValueError(f"{field} cannot be used: {_first_line(matcher.get_error(), kind)}.")
        self._matchers[request_id] = matcher
        self._kinds[request_id] = kind

    def _first_mask(self, matcher):
        """Compute the matcher's first mask (the grammar's errors that only show there, such as a
        $ref to itself, show now) and return the matcher."""
        if not matcher.is_error():
            from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
            fill_next_token_bitmask(matcher, allocate_token_bitmask(1, self._vocab))
        return matcher

    def error(self, request_id: str) -> str | None:
        """Why the request's grammar failed (it can allow no next token), or None."""
        matcher = self._matchers.get(request_id)
        if matcher is None or not matcher.is_error():
            return None
        what = _WHAT[self._kinds.get(request_id, "json")]
        return f"the {what} could not be followed: {_first_line(matcher.get_error())}."

    def mask(self, request_id: str, row: np.ndarray) -> None:
        """Set the logits of tokens the schema forbids next to -inf. row: [V] f32, in place."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return
        from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask
        bits = allocate_token_bitmask(1, self._vocab)  # [1, ceil(V / 32)] int32
        fill_next_token_bitmask(matcher, bits)
        apply_token_bitmask_inplace(row[None, :], bits)

    def advance(self, request_id: str, token_id: int) -> bool:
        """Feed the sampled token; True when the request must end (the schema is complete, or
        the token broke it, which only a ban on every allowed token can cause)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        return not matcher.consume_token(int(token_id)) or matcher.is_stopped()

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._kinds.pop(request_id, None)


# SamplingParams.constraint's kind -> the SamplingParams field an error names (the server renames it)
_FIELD = {"json": "json_schema", "json_compact": "json_schema", "regex": "structured_outputs.regex",
          "choice": "structured_outputs.choice",
          "grammar": "structured_outputs.grammar"}


_WHAT = {"json": "JSON schema", "json_compact": "JSON schema", "regex": "regex", "choice": "choice",
         "grammar": "grammar"}


def _llguidance_json(text: str) -> str:
    """The tokenizer.json llguidance reads: without the added tokens whose decoder Replace-s their
    one character (a GGUF's user-defined byte-alphabet tokens, gguf_tokenizer.byte_char_tokens).
    llguidance takes such a token for its one byte (0xF6 for ö), so forced text holding ö tokenized
    to it and then failed the grammar ("Köln" ended in an error); without them ö is written by
    the byte tokens of its UTF-8."""
    tj = json.loads(text)
    dec = tj.get("decoder") or {}
    replaced = {d.get("pattern", {}).get("String") for d in dec.get("decoders") or () if d.get("type") == "Replace"}
    if not replaced or dec.get("type") != "Sequence":
        return text
    tj["added_tokens"] = [t for t in tj.get("added_tokens") or () if t.get("special") or t.get("content") not in replaced]
    return json.dumps(tj)


def strict_schema(schema: dict) -> dict:
    """No property an object schema does not declare (OpenAI's `strict: true`, and the default
    of vLLM's xgrammar backend, so of every JSON constraint here). A copy of
    `schema` whose object schemas with `properties` get additionalProperties false, through every
    place a schema nests (llguidance, as JSON Schema, allows undeclared properties: a small model
    filled max_tokens with made-up keys). A node that declares its properties together with
    others (allOf members, a $ref beside properties, dependentSchemas, if/then, anyOf/oneOf branches
    beside properties: a base object with its variants) or already says what else it allows stays
    open: closing each part would forbid the others' properties."""
    maps = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
    lists = ("anyOf", "oneOf", "prefixItems")
    single = ("items", "additionalItems", "unevaluatedItems", "additionalProperties", "unevaluatedProperties",
              "propertyNames", "not", "if", "then", "else", "contains")
    shared = ("allOf", "$ref", "dependentSchemas", "dependencies", "if", "then", "else",
              "additionalProperties", "unevaluatedProperties", "patternProperties")

    composed: set[str] = set()  # "#/$defs/X" a $ref combines with other properties: X stays open too

    def variants(node) -> bool:  # NOTE: properties shared by anyOf/oneOf branches that add their own
        return isinstance(node, dict) and "properties" in node and any(
            isinstance(node.get(k), list) for k in ("anyOf", "oneOf"))

    def scan(node, in_all_of: bool = False):
        if isinstance(node, list):
            for sub in node:
                scan(sub, in_all_of)
        elif isinstance(node, dict):
            if isinstance(node.get("$ref"), str) and (in_all_of or "properties" in node):
                composed.add(node["$ref"])
            for k, sub in node.items():
                scan(sub, k == "allOf" or (k in ("anyOf", "oneOf") and variants(node)))
    scan(schema)

    def walk(node, closable: bool = True):
        if not isinstance(node, dict):
            return node
        out = dict(node)
        branches = variants(node)
        for k in maps:
            if isinstance(out.get(k), dict):
                out[k] = {name: walk(sub, f"#/{k}/{name}" not in composed) for name, sub in out[k].items()}
        for k in lists:
            if isinstance(out.get(k), list):
                out[k] = [walk(sub, closable=not (branches and k != "prefixItems")) for sub in out[k]]
        if isinstance(out.get("allOf"), list):
            out["allOf"] = [walk(sub, closable=False) for sub in out["allOf"]]
        for k in single:
            if isinstance(out.get(k), (dict, list)):
                out[k] = [walk(sub) for sub in out[k]] if isinstance(out[k], list) else walk(out[k])
        if branches and isinstance(out.get("oneOf"), list) and "anyOf" not in out:
            # NOTE: open variants are not provably exclusive, which llguidance needs of a oneOf: taken as
            # anyOf (as xgrammar takes every oneOf); an output two variants both fit is rarely meant
            out["anyOf"] = out.pop("oneOf")
        if closable and "properties" in out and not branches and not any(k in node for k in shared):
            out["additionalProperties"] = False
        return out
    return walk(schema)


def _grammar(llg, kind: str, spec) -> str:
    """llguidance's grammar for a constraint; ValueError if it does not parse."""
    if kind in _LAYOUT:  # NOTE: closed, as vLLM's default backend (xgrammar, strict) closes them
        return llg.LLMatcher.grammar_from_json_schema(strict_schema(spec), defaults=_LAYOUT[kind])
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(ascii_classes(spec))
    if kind == "choice":
        # NOTE: one regex (one lexeme): as a Lark rule of N alternatives the parser's row held an
        # item each, and 2000 or more choices failed after the first token (llguidance's row limit)
        return llg.LLMatcher.grammar_from_regex("|".join(_literal_regex(c) for c in spec))
    if "::=" not in spec:  # NOTE: vLLM's test: GBNF defines rules with ::=, Lark with ':'
        return llg.LLMatcher.grammar_from_lark(spec)
    from llguidance.gbnf_to_lark import gbnf_to_lark
    try:
        lark = gbnf_to_lark(_gbnf_for_converter(spec))
    except Exception as e:  # noqa: BLE001 - the converter raises what its parser raises
        raise ValueError(f"it does not parse as GBNF ({_first_line(str(e))})") from None
    return llg.LLMatcher.grammar_from_lark(lark)


# NOTE: Earley items at one position of the output: llguidance's default (2000) failed an object of
# 501 optional properties after its first token; the lexer and per-step limits stay as they are
MAX_ITEMS_IN_ROW = 20000


def _limits(llg):
    return llg.LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW)


def _literal_regex(text: str) -> str:
    """A regex matching exactly `text`: ASCII letters and digits as they are, every other
    character as its code point (\\x{HEX})."""
    return "".join(c if c.isascii() and c.isalnum() else "\\x{%X}" % ord(c) for c in text)


_ASCII_CLASSES = {"d": "0-9", "w": "A-Za-z0-9_"}


def ascii_classes(regex: str) -> str:
    r"""\d as [0-9], \w as [A-Za-z0-9_] and \D, \W as their complements (the ranges alone inside a
    class, the complements as a nested class), as vLLM's grammar backends read a regex (and as
    llguidance reads a JSON schema's pattern already, by ECMA-262): llguidance's regex classes are
    Unicode's, and \d let Devanagari and Arabic-Indic digits through, \w accented and CJK letters."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            if nxt in _ASCII_CLASSES:
                out.append(_ASCII_CLASSES[nxt] if in_class else "[%s]" % _ASCII_CLASSES[nxt])
            elif nxt.lower() in _ASCII_CLASSES and nxt.isupper():
                out.append("[^%s]" % _ASCII_CLASSES[nxt.lower()])  # NOTE: a nested class inside a class
            else:
                out.append(regex[i:i + 2])
                i += 2
                continue
            i += 2
            # NOTE: [\w-.]: a hyphen after a class is literal ("--", llguidance's class difference, stays)
            if in_class and regex[i:i + 1] == "-" and regex[i + 1:i + 2] != "-":
                out.append("\\-")
                i += 1
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


_UNSAFE = set('"\\]-^[')  # characters an escape must not turn literal inside a GBNF string or class


def _gbnf_for_converter(gbnf: str) -> str:
    r"""llama.cpp's GBNF as llguidance's converter reads it: \uXXXX / \UXXXXXXXX / \xXX escapes as
    the characters (it wrote \u00e9 as the invalid \ue9), but as \xXX where the character would
    end a string or class or is a control character up to 0xFF; and a rule named start renamed
    (root becomes start there)."""
    def char(m):
        if m.group(0) == "\\\\":  # NOTE: an escaped backslash: what follows it is text
            return m.group(0)
        code = int(m.group(1) or m.group(2) or m.group(3), 16)
        ch = chr(code)
        if ch in _UNSAFE or (not ch.isprintable() and code <= 0xFF):
            # NOTE: kept as an escape the converter passes on whole (\u0000 it wrote as \u)
            return "\\x%02X" % code
        return ch
    text = re.sub(r"\\\\|\\u([0-9a-fA-F]{4})|\\U([0-9a-fA-F]{8})|\\x([0-9a-fA-F]{2})", char, gbnf)
    if re.search(r"(?m)^\s*start\s*::=", text):
        # NOTE: outside strings and classes only
        parts = re.split(r'("(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\])', text)
        text = "".join(p if i % 2 else re.sub(r"\bstart\b", "start__", p) for i, p in enumerate(parts))
    return text


MAX_DEPTH = 1000  # levels of a schema, its $refs followed (real schemas nest a few dozen)
# NOTE: llguidance reads a schema's JSON text with serde_json's recursion limit (128, some of it its
# own wrapping): a schema nested 125 objects and lists deep in its text failed with "recursion limit
# exceeded at line 1 column N" of a text the user never wrote; $refs do not count (MAX_DEPTH)
MAX_TEXT_DEPTH = 124
_STACK_BYTES = 256 << 20  # virtual: only the pages a deep schema touches are ever committed


_PLAIN = {"NoExtensionBias": "a $ref that refers only to itself (no JSON value satisfies it)"}
_PLAIN_TEXT = {"NoExtensionBias": "it matches no text"}  # the same error for a regex, a choice or a grammar


def _first_line(error: str, kind: str = "json") -> str:
    """llguidance's error without its dump of parser state (the lines after the first); a header
    line ("regex parse error:") gets the line that says why, and known terse errors a sentence."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()] or ["unknown error"]
    first = lines[0]
    if first.endswith(":"):
        why = next((line for line in lines[1:] if line.startswith("error:")), lines[-1] if len(lines) > 1 else "")
        first = f"{first} {why.removeprefix('error:').strip()}" if why else first.rstrip(":")
    first = first.split(". Enable 'coerce_one_of'")[0]  # NOTE: an option of llguidance's, not ours
    if kind == "regex":  # NOTE: the position and the quoted pattern were those of llguidance's own wrapping of it
        first = _WRAPPED_REGEX.sub("", first)
    return (_PLAIN if kind in _LAYOUT else _PLAIN_TEXT).get(first.rstrip("."), first.rstrip("."))


# llguidance's prefix to an error of a regex it wrapped into a grammar: `at 1(8): invalid regex "(a)\\1" (in
# regex): regex parse error: ` (a column of the wrapping, the pattern with its backslashes doubled)
_WRAPPED_REGEX = re.compile(r'^at \d+\(\d+\): invalid regex ".*" \(in regex\): (?:regex parse error: )?', re.S)


_COMPILER: dict = {}  # the one thread with a large stack that builds matchers, and its queue
_COMPILER_LOCK = threading.Lock()


def _on_big_stack(fn):
    """fn() on the process's grammar thread (a _STACK_BYTES stack, started once: the stack size
    is a process-wide setting, changed only while that thread starts); its result, or its
    exception raised here."""
    import queue
    with _COMPILER_LOCK:
        if "queue" not in _COMPILER:
            jobs = queue.SimpleQueue()

            def serve():
                while True:
                    job, box, done = jobs.get()
                    try:
                        box["out"] = job()
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        box["err"] = e
                    done.set()
            old = threading.stack_size()
            try:
                threading.stack_size(_STACK_BYTES)
                threading.Thread(target=serve, name="grammar-compile", daemon=True).start()
            finally:
                threading.stack_size(old)
            _COMPILER["queue"] = jobs
    box, done = {}, threading.Event()
    _COMPILER["queue"].put((fn, box, done))
    done.wait()
    if "err" in box:
        raise box["err"]
    return box["out"]


def nesting_depth(schema, cap: int, refs: bool = True) -> int:
    """The deepest nesting of a schema's objects and lists, following its local $refs ("#",
    "#/$defs/x", any JSON pointer into it) unless not `refs` (then: as written); a $ref back into
    its own chain (a recursive schema) adds nothing. Iterative, and stops once past `cap`."""
    def target(ref):
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node = schema
        for part in [p for p in ref[1:].split("/") if p != ""]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def children(node):
        items = list(node.values()) if isinstance(node, dict) else list(node)
        if refs and isinstance(node, dict) and "$ref" in node:
            items.append(target(node["$ref"]))
        return iter([c for c in items if isinstance(c, (dict, list))])

    if not isinstance(schema, (dict, list)):
        return 0
    depth: dict[int, int] = {}   # id(node) -> its depth, once known
    deepest: dict[int, int] = {}  # id(node) -> deepest child so far
    stack, on_stack = [(schema, children(schema))], {id(schema)}
    while stack:
        node, it = stack[-1]
        child = next(it, None)
        if child is None:
            stack.pop()
            on_stack.discard(id(node))
            d = depth[id(node)] = 1 + deepest.pop(id(node), 0)
            if d > cap:
                return d
            if stack:
                p = id(stack[-1][0])
                deepest[p] = max(deepest.get(p, 0), d)
        elif id(child) in depth:
            deepest[id(node)] = max(deepest.get(id(node), 0), depth[id(child)])
        elif id(child) not in on_stack:  # NOTE: else a back edge (recursion): adds nothing
            on_stack.add(id(child))
            stack.append((child, children(child)))
    return depth[id(schema)]
