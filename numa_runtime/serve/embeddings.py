"""`POST /v1/embeddings`: unit-length embeddings from the loaded model (OpenAI's shape).

The official client asks for `encoding_format="base64"` by default (little-endian float32
bytes); "float" returns lists. Pooling is the server's `--embedding-pooling` (mean or last),
or the model's default (Engine.embed).
"""
from __future__ import annotations

import base64
from typing import Literal, Optional, Union

from pydantic import Field

from .protocol import _Body

MAX_INPUTS = 2048


class EmbeddingRequest(_Body):  # NOTE: strict (true is not a token id); null is a field's default
    model: Optional[str] = Field(None, description="The served model name; omit for the only model served.")
    input: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description="A string, a list of strings, a list of token ids, or a list of token id lists.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, description="Not supported; omit it.")
    user: Optional[str] = Field(None, description="Accepted and ignored.")

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        items = [x] if isinstance(x, str) or (x and all(isinstance(t, int) for t in x)) else list(x)
        if not items or any(len(i) == 0 for i in items):
            raise ValueError("input must contain at least one non-empty text or token list.")
        if len(items) > MAX_INPUTS:
            raise ValueError(f"input has {len(items)} items; send at most {MAX_INPUTS} per request.")
        if self.dimensions is not None:
            raise ValueError("dimensions is not supported; omit it to get the model's full embedding.")
        return items


def embeddings_body(model: str, vectors, num_tokens: int, encoding_format: str) -> dict:
    """vectors: [N, hidden] float32."""
    data = []
    for i, v in enumerate(vectors):
        emb = (base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding_format == "base64"
               else v.tolist())
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


async def create_embeddings(aengine, body: EmbeddingRequest, model_name: str, pooling: str | None) -> dict:
    """Run the embedding on the engine thread (between steps) and build the response body.
    Raises ValueError for bad input (the caller's 400)."""
    items = body.inputs()

    def run(engine):
        ids = [engine.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in items]
        return engine.embed(ids, pooling), sum(len(i) for i in ids)

    vectors, num_tokens = await aengine.call(run)
    return embeddings_body(model_name, vectors, num_tokens, body.encoding_format)
