"""vLLM's prompt dicts (`vllm.inputs`), as Engine.generate takes them beside strings and token
lists: `TextPrompt(prompt="...")` and `TokensPrompt(prompt_token_ids=[...])` are plain dicts."""
from __future__ import annotations

from typing import TypedDict, Union

__all__ = ["TextPrompt", "TokensPrompt", "PromptType"]


class TextPrompt(TypedDict):
    """A prompt given as text (tokenized with the model's special tokens, as a string is)."""
    prompt: str


class _PromptText(TypedDict, total=False):
    prompt: str


class TokensPrompt(_PromptText):
    """A prompt given as token ids, used as they are (`prompt`, its text if given, is the output's
    prompt, as in vLLM)."""
    prompt_token_ids: list[int]


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]
