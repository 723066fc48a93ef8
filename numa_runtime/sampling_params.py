"""SamplingParams: how one request's tokens are chosen and when it stops."""
from __future__ import annotations

import json
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields


_GREEDY_BELOW = 1e-5  # a temperature under this samples greedily (vLLM's _SAMPLING_EPS)


@dataclass
class StructuredOutputsParams:
    """What the output must follow, as vLLM's StructuredOutputsParams (GuidedDecodingParams before
    vLLM 0.10.2): exactly one of a JSON schema (`json`, a dict or a string holding one), any JSON
    object (`json_object`), a regular expression (`regex`, Rust regex syntax, matched whole), one
    of a list of strings (`choice`), or a context-free grammar (`grammar`, Lark or llama.cpp's
    GBNF). llguidance enforces each while sampling (structured.py)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # NOTE: vLLM's options: what they ask is what happens here (one backend, llguidance; objects
    # closed as xgrammar's strict mode closes them), or one sentence (constraint)
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    backend: str | None = None
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def check_options(self) -> None:
        """ValueError (one sentence) for an option this server cannot honour."""
        if self.backend not in (None, "auto", "guidance", "llguidance"):
            raise ValueError(f"structured_outputs' backend {self.backend!r} is not available; llguidance (vLLM's "
                             "'guidance') serves every constraint here: leave backend out.")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs' whitespace_pattern is not supported; JSON output is written with "
                             "', ' and ': ' (or ',' and ':' with disable_any_whitespace).")
        if self.structural_tag is not None:
            raise ValueError("structured_outputs' structural_tag is not supported.")
        if self.disable_any_whitespace not in (False, True):
            raise ValueError("structured_outputs' disable_any_whitespace must be true or false.")

    def kinds(self) -> list[str]:
        """The constraint fields set (json, regex, choice, grammar, json_object): none in options
        sent beside another field's schema (response_format, json_schema)."""
        return [f.name for f in fields(self) if f.name in _KINDS and getattr(self, f.name) not in (None, False)]

    def constraint(self) -> tuple[str, object]:
        """(kind, spec): ("json", a schema dict), ("regex", str), ("choice", [str]) or ("grammar",
        str); ValueError (one sentence) unless exactly one is given and it is well formed."""
        self.check_options()
        given = self.kinds()
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar or "
                             f"json_object, got {', '.join(given) or 'none'}.")
        kind = given[0]
        value = getattr(self, kind)
        # NOTE: disable_any_whitespace: JSON written compact (',' and ':'), as xgrammar writes it so
        json_kind = "json_compact" if self.disable_any_whitespace else "json"
        if kind == "json_object":
            if value is not True:
                raise ValueError(f"structured_outputs' json_object must be true, got {value!r}.")
            return json_kind, {"type": "object"}
        if kind == "json":
            schema = json_schema_of(value)
            if schema is None:
                raise ValueError("structured_outputs' json must be a JSON schema: a dict, or a string holding one.")
            return json_kind, schema
        if kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or any(not isinstance(c, str) or not c for c in value)):
                raise ValueError(f"structured_outputs' choice must be a non-empty list of non-empty strings, "
                                 f"got {value!r}.")
            return "choice", list(value)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"structured_outputs' {kind} must be a non-empty string, got {value!r}.")
        return kind, value


_KINDS = ("json", "regex", "choice", "grammar", "json_object")
JSON_KINDS = ("json", "json_compact")  # constraint kinds whose spec is a JSON schema
GuidedDecodingParams = StructuredOutputsParams  # vLLM's name before 0.10.2


def json_schema_of(value) -> dict | None:
    """A JSON schema given as a dict or as a string holding one (vLLM takes both), or None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


# SamplingParams.from_optional: None stands for these fields' defaults (as vLLM's)
_OPTIONAL_DEFAULTS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                      "frequency_penalty")


@dataclass
class SamplingParams:
    """Per-request sampling settings, validated once at construction.

    temperature 0 (or under 1e-5, as vLLM) means greedy. `seed` gives a request its own random
    stream, so that the same logits sample the same tokens whatever else runs beside it; the
    logits themselves can move in their last bits with the batch a step runs in (as in vLLM), and
    so a near tie can flip. `stop` strings are cut from the returned text; `stop_token_ids` end the
    request and are not returned (like EOS) unless `include_stop_str_in_output`.
    `logit_bias` maps token ids to a value added to their logits before sampling.
    `json_schema` (a JSON schema as a dict; {"type": "object"} for any object) constrains the
    output to JSON that matches it; `structured_outputs` (vLLM's; `guided_decoding`, its older
    name) to a JSON schema, a regex, one of a list of strings or a grammar (structured.py).
    `allowed_token_ids` restricts every sampled token to that list; `bad_words` bans words (each
    with and without a leading space, as vLLM: the last token of a word is banned when the tokens
    generated last spell the rest of it).
    Integer fields take Python ints only (a bool is not an int).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: RequestOutput.prompt_logprobs with this many most likely tokens
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: max_model_len)
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    json_schema: dict | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    guided_decoding: StructuredOutputsParams | dict | None = None  # vLLM's name before 0.10.2
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # NOTE: vLLM's fields whose defaults are what happens here; other values are refused by name
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    logits_processors: list | None = None
    output_kind: object = None

    def __post_init__(self):
        for name, ok, why in (("spaces_between_special_tokens", (True,), "special tokens are decoded as the "
                               "tokenizer writes them"),
                              ("detokenize", (True,), "outputs always carry their text"),
                              ("logits_processors", (None, []), "no Python code runs in the sampling loop; "
                               "logit_bias, allowed_token_ids and bad_words cover the common uses"),
                              ("output_kind", (None, 0, "CUMULATIVE"), "outputs are cumulative, with the delta "
                               "beside them (CompletionOutput.delta, new_token_ids)")):
            value = getattr(self, name)
            value = getattr(value, "name", value)  # NOTE: vLLM's RequestOutputKind enum
            value = value.upper() if name == "output_kind" and isinstance(value, str) else value  # "cumulative"
            if value not in ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported ({why}).")
        if self.seed == -1 and not isinstance(self.seed, bool):  # NOTE: vLLM's "no seed"
            self.seed = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        self.stop = list(self.stop or [])
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}.")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None and not isinstance(self.logit_bias, Mapping):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}.")
        self.logit_bias = dict(self.logit_bias or {})
        self._structured()
        if self.allowed_token_ids is not None:
            if (not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
                    or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, "
                                 f"got {self.allowed_token_ids!r}.")
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if self.bad_words is not None:
            if (not isinstance(self.bad_words, (list, tuple))
                    or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
                raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}.")
            from .tokenizer import check_text
            for w in self.bad_words:
                check_text("bad_words", w)
            self.bad_words = list(self.bad_words) or None
        self._check()
        self._check_lists()
        # NOTE: numpy scalars pass the checks; keep plain Python numbers from here on
        for name in _FLOATS:
            setattr(self, name, float(getattr(self, name)))
        if self.temperature < _GREEDY_BELOW:  # NOTE: as vLLM: so small a temperature is greedy
            self.temperature = 0.0
        for name in _INTS:
            if getattr(self, name) is not None:
                setattr(self, name, int(getattr(self, name)))
        self.logit_bias = {int(t): float(v) for t, v in self.logit_bias.items()}

    @classmethod
    def from_optional(cls, **kwargs) -> "SamplingParams":
        """vLLM's SamplingParams.from_optional: the constructor's keywords, where None means the
        default for n, temperature, top_p, top_k, min_p and the penalties (a request's unset
        fields), and logit_bias's values are clipped to [-100, 100] (its keys read as ints)."""
        known = {f.name for f in fields(cls)}
        bad = sorted(set(kwargs) - known)
        if bad:
            raise TypeError(f"SamplingParams.from_optional() got an unexpected keyword {bad[0]!r}.")
        for name in _OPTIONAL_DEFAULTS:
            if name in kwargs and kwargs[name] is None:
                del kwargs[name]
        bias = kwargs.get("logit_bias")
        if isinstance(bias, Mapping):
            kwargs["logit_bias"] = {  # NOTE: what is no id or no number is left to the constructor's check
                (int(t) if isinstance(t, str) and t.strip().lstrip("-").isascii() and t.strip().lstrip("-").isdigit() else t):
                (min(100.0, max(-100.0, float(v))) if isinstance(v, numbers.Real) and not isinstance(v, bool) else v)
                for t, v in bias.items()}
        return cls(**kwargs)

    def _structured(self):
        """Check the output constraint now (one sentence for a bad one); `constraint` reads it
        from the fields each time, so that a field set after construction counts, as in vLLM."""
        for name in ("structured_outputs", "guided_decoding"):
            if isinstance(getattr(self, name), Mapping):
                setattr(self, name, as_structured_outputs(getattr(self, name)))
        self.constraint  # noqa: B018 - its ValueError is the caller's

    @property
    def constraint(self) -> tuple[str, object] | None:
        """The output constraint as (kind, spec), kind "json" ("json_compact": no whitespace between
        tokens), "regex", "choice" or "grammar"; or
        None. From json_schema, structured_outputs or guided_decoding, whichever is set (ValueError
        if two are, or if it is malformed): read afresh each time (the engine reads it once, when a
        request is added, and keeps it on the request)."""
        so = self.structured_outputs if self.structured_outputs is not None else self.guided_decoding
        if self.structured_outputs is not None and self.guided_decoding is not None:
            raise ValueError("Give structured_outputs or guided_decoding (its older name), not both.")
        if isinstance(so, Mapping):
            so = as_structured_outputs(so)
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {so!r}.")
        # NOTE: as vLLM: structured_outputs with options only (disable_any_whitespace) beside a
        # json_schema (response_format) are that schema's options
        options = so is not None and self.json_schema is not None and not so.kinds()
        if options:
            so.check_options()
        constraint = so.constraint() if so is not None and not options else None
        if self.json_schema is not None:
            if constraint is not None and (constraint[0] not in JSON_KINDS or constraint[1] != self.json_schema):
                raise ValueError("Give one output constraint: json_schema or structured_outputs, not both.")
            if not isinstance(self.json_schema, dict):
                raise ValueError(f"json_schema must be a dict (a JSON schema) or None, got {self.json_schema!r}.")
            kind = constraint[0] if constraint is not None else (
                "json_compact" if options and so.disable_any_whitespace else "json")
            constraint = kind, self.json_schema
        return constraint

    def request_constraint(self) -> tuple[str, object] | None:
        """`constraint` as a request runs it: ValueError too when min_tokens is set beside it."""
        constraint = self.constraint
        if constraint is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured output: the constraint decides where "
                             "the output ends.")
        return constraint

    def _check(self):
        def bad(msg):
            raise ValueError(msg)
        if not _is_int(self.n) or self.n < 1:
            bad(f"n must be a positive integer, got {self.n!r}.")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer of at least 1 (or unset), got {self.max_tokens!r}.")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).")
        if not _is_num(self.temperature) or self.temperature < 0 or self.temperature > 100:
            bad(f"temperature must be a number in [0, 100], got {self.temperature!r}.")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}.")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}.")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}.")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0 or self.repetition_penalty > 10:
            bad(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}.")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2.0 <= v <= 2.0:
                bad(f"{name} must be in [-2, 2], got {v!r}.")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 1 << 64):
            bad(f"seed must be an integer in [0, 2**64) or None, got {self.seed!r}.")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            bad(f"logprobs must be an integer in [0, 20] or None, got {self.logprobs!r}.")
        if self.truncate_prompt_tokens is not None and (not _is_int(self.truncate_prompt_tokens)
                                                        or not (self.truncate_prompt_tokens == -1
                                                                or self.truncate_prompt_tokens >= 1)):
            bad(f"truncate_prompt_tokens must be -1 or a positive integer, got {self.truncate_prompt_tokens!r}.")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            bad(f"prompt_logprobs must be an integer in [0, 20] or None, got {self.prompt_logprobs!r}.")
        self.request_constraint()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be True or False, got {getattr(self, name)!r}.")

    def _check_lists(self):
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings.")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integer token ids, got {self.stop_token_ids!r}.")
        for t, v in self.logit_bias.items():
            if not _is_int(t) or t < 0:
                raise ValueError(f"logit_bias keys must be non-negative integer token ids, got {t!r}.")
            if not _is_num(v) or not -100 <= v <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {t}.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self) -> "SamplingParams":
        """vLLM's: a deep copy (a change to it changes no request made with this one)."""
        import copy
        return copy.deepcopy(self)

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def as_structured_outputs(so: Mapping) -> "StructuredOutputsParams":
    """A structured_outputs dict as StructuredOutputsParams; ValueError naming an unknown key."""
    known = {f.name for f in fields(StructuredOutputsParams)}
    unknown = sorted(set(so) - known)
    if unknown:
        raise ValueError(f"structured_outputs has no field {unknown[0]!r}; it takes json, regex, choice, "
                         "grammar or json_object.")
    return StructuredOutputsParams(**so)


def _is_int(v) -> bool:
    # NOTE: numpy integers are integers; a bool is not, though Python calls it one
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INTS = ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")


def _is_num(v) -> bool:
    # NOTE: numpy floats and integers are numbers too; NaN is not
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and v == v
