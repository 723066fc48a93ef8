"""`POST /v1/embeddings`: unit-length embeddings from the loaded model (OpenAI's shape).

The official client asks for `encoding_format="base64"` by default (little-endian float32
bytes); "float" returns lists. Pooling is the server's `--embedding-pooling` (mean, last or
cls), or the model's default (Engine.embed). vLLM's `truncate_prompt_tokens`,
`add_special_tokens` and `normalize` work as there; `dimensions` where the model is Matryoshka.
"""
from __future__ import annotations

import base64
from typing import Any, ClassVar, Literal, Optional

import numpy as np
from pydantic import Field

from ..engine import check_input_length, embedding_size, first_bad_id, prompt_truncation
from ..tokenizer import check_text
from .async_engine import off_loop
from .protocol import _Body

MAX_INPUTS = 2048


class EmbeddingRequest(_Body):  # NOTE: strict (true is not a token id); null is a field's default
    _warn_ignored: ClassVar[bool] = True
    model: Optional[str] = Field(None, description="The served model name; omit for the only model served.")
    # NOTE: read by inputs() (a union's type errors named the wrong member: [1.5] "should be a valid string")
    input: Any = Field(..., description="A string, a list of strings, a list of token ids, or a list of token "
                                        "id lists.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, description="The first `dimensions` values, normalized again "
                                                        "(Matryoshka models only).")
    user: Optional[str] = Field(None, description="Accepted and ignored.")
    # vLLM's extensions
    truncate_prompt_tokens: Optional[int] = Field(None, description="Keep each input's last k tokens; -1: "
                                                                    "the context's length.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens to text inputs.")
    normalize: Optional[bool] = Field(None, description="Unit-length embeddings; default: as the model declares "
                                                        "(yes, but for a sentence-transformers model without "
                                                        "Normalize).")
    priority: int = Field(0, description="Not supported; must be 0.")
    use_activation: Optional[bool] = Field(None, description="vLLM's newer name for normalize.")
    # refused unless a no-op (vLLM's; `inputs` names them)
    embed_dtype: Optional[str] = Field(None, description="float32 only.")
    endianness: Optional[str] = Field(None, description="native or little only (this host's order).")
    truncation_side: Optional[str] = Field(None, description="left only: truncate_prompt_tokens keeps the last "
                                                             "tokens.")
    additional_data: Optional[Any] = Field(None, description="Not supported; must be absent.")

    def normalized(self) -> Optional[bool]:
        """normalize, or use_activation (the same switch under vLLM's newer name)."""
        if self.use_activation is not None and self.normalize is not None and self.use_activation != self.normalize:
            e = ValueError("use_activation and normalize are one switch; give one of them.")
            e.param = "use_activation"  # NOTE: the field the message opens with (kept lower-case, named as param)
            raise e
        return self.normalize if self.normalize is not None else self.use_activation

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        one = isinstance(x, str) or (isinstance(x, list) and len(x) > 0 and all(map(_is_token, x)))
        items = [x] if one else x
        if not isinstance(items, list) or not all(
                isinstance(i, str) or (isinstance(i, list) and all(map(_is_token, i))) for i in items):
            raise ValueError("input must be a string, a list of strings, a list of token ids, or a list of token id "
                             "lists.")
        if not items or any(len(i) == 0 for i in items):
            raise ValueError("input must contain at least one non-empty text or token list.")
        if len(items) > MAX_INPUTS:
            raise ValueError(f"input has {len(items)} items; send at most {MAX_INPUTS} per request.")
        if self.priority != 0:
            raise ValueError("priority is not supported by this server; remove it from the request.")
        for name, ok in (("embed_dtype", ("float32",)), ("endianness", ("native", "little")),
                         ("truncation_side", ("left",)), ("additional_data", ())):
            value = getattr(self, name)
            if value is not None and value not in ok:
                raise ValueError(f"{name} must be {' or '.join(ok)} on this server, got {value!r}." if ok else
                                 f"{name} is not supported by this server; remove it from the request.")
        self.normalized()
        for i, item in enumerate(items):
            if isinstance(item, str):
                check_text("input" if one else f"input[{i}]", item)
        return items


def _is_token(t) -> bool:
    """A token id as JSON gives it: an integer, not a boolean (strict, as the other fields)."""
    return type(t) is int


def embeddings_body(model: str, vectors, num_tokens: int, encoding_format: str) -> dict:
    """vectors: [N, size] float32."""
    data = []
    for i, v in enumerate(vectors):
        emb = (base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding_format == "base64"
               else v.tolist())
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


async def create_embeddings(aengine, body: EmbeddingRequest, model_name: str, pooling: str | None) -> dict:
    """Tokenize off the engine thread (a long text would hold every request's steps), then embed
    on it (between steps) and build the response body. Raises ValueError for bad input (the
    caller's 400)."""
    engine = aengine.engine
    items = body.inputs()
    keep = prompt_truncation(body.truncate_prompt_tokens, engine.max_model_len)
    embedding_size(engine.model_config, body.dimensions)
    tok = engine.tokenizer
    for i, item in enumerate(items):
        if isinstance(item, str) and keep is None:
            tok.check_length(item, engine.max_model_len)

    def tokenize() -> list[list[int]]:  # NOTE: a text's special tokens survive truncation, as in vLLM
        return [tok.prompt_ids(x, keep, body.add_special_tokens) for x in items]

    ids = await off_loop(tokenize)
    if any(not i for i in ids):
        raise ValueError("An input has no tokens (an empty text without special tokens); give it some text.")
    vocab = engine.model_config.vocab_size
    for i, one in enumerate(ids):  # NOTE: each input runs alone below: name the one at fault first
        check_input_length(i, len(one), engine.max_model_len)
        bad = first_bad_id(one, vocab)
        if bad is not None:  # NOTE: before any input runs (the engine found it when it reached it)
            raise ValueError(f"Input {i} holds token id {bad}, outside the vocabulary (size {vocab}).")

    # NOTE: one engine call an input (they run one after another anyway): steps of other requests
    # go between them, and a client gone (its handler cancelled) leaves the rest unrun
    vectors = []
    for one in ids:
        vectors.append(await aengine.call(
            lambda e, one=one: e.embed([one], pooling, normalize=body.normalized(), dimensions=body.dimensions)))
    vectors = np.concatenate(vectors)
    return embeddings_body(model_name, vectors, sum(map(len, ids)), body.encoding_format)
