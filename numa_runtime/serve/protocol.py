"""OpenAI request bodies (pydantic, so /openapi.json describes them) and their SamplingParams.

Types are checked here; value ranges are checked once, by SamplingParams (its ValueError is
the client's 400). Unknown fields are ignored, as the OpenAI API does. No field names a file.
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..sampling_params import SamplingParams

MAX_CHOICES = 128  # n times the number of prompts, per request


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingRequest(_Body):
    model: Optional[str] = Field(None, description="The served model name; omit for the only model served.")
    max_tokens: Optional[int] = None
    temperature: Optional[float] = Field(None, description="0 is greedy; default 1.")
    top_p: Optional[float] = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = Field(None, description="Accepted and ignored.")
    # extensions (vLLM names)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: int = 0

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """SamplingParams for this request; ValueError (one sentence) if a value is out of range."""
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
        }
        # NOTE: any integer is a valid OpenAI seed; the sampler's generator wants a non-negative one.
        seed = None if self.seed is None else self.seed % (1 << 64)
        return SamplingParams(n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, seed=seed,
                              stop=self.stop, ignore_eos=self.ignore_eos, logprobs=logprobs,
                              **{k: v for k, v in given.items() if v is not None})


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description="A string, a list of strings, a list of token ids, or a list of token id lists.")
    logprobs: Optional[int] = Field(None, description="Number of most likely tokens to return per position (0-5).")
    echo: bool = Field(False, description="Not supported; must be false.")

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list; ValueError if there are none."""
        p = self.prompt
        if isinstance(p, str):
            out = [p]
        elif p and all(isinstance(t, int) for t in p):
            out = [p]
        else:
            out = list(p)
        if not out:
            raise ValueError("prompt must not be empty.")
        if any(len(x) == 0 for x in out):
            raise ValueError("Every prompt must contain at least one character or token.")
        if len(out) * self.n > MAX_CHOICES:
            raise ValueError(f"{len(out)} prompts times n={self.n} exceeds {MAX_CHOICES} completions per request.")
        if self.echo:
            raise ValueError("echo is not supported; send echo=false.")
        return out


class ContentPart(_Body):
    type: str = Field(..., description="Only 'text' is supported.")
    text: Optional[str] = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"Only text content parts ({{'type': 'text', 'text': ...}}) are supported, "
                                     f"got type {part.type!r}.")
            content = "\n".join(part.text for part in content)
        msg = {"role": self.role, "content": content if content is not None else ""}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Optional[int] = Field(None, description="Takes precedence over max_tokens.")
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, description="0-20; requires logprobs=true.")

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true.")
        return (self.top_logprobs or 0) if self.logprobs else None
