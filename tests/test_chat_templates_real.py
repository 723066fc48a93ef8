"""Real models' chat templates: our renderer against transformers' apply_chat_template.

llama.cpp keeps the chat templates of ~70 real models (Llama 3.x, Qwen2.5/3, Mistral, Phi-3.5,
DeepSeek-R1 distills, Hermes and Command-R tool use, Granite, Gemma, gpt-oss, ...) in
vendor/llama.cpp/models/templates of llama-cpp-python's source distribution on PyPI, which this
test downloads once per run (set NUMA_RUNTIME_LLAMA_TEMPLATES to a folder holding the .jinja files
to use a local copy). Every template renders every conversation below with both renderers, and
the strings must be equal; where transformers raises, we must raise ChatTemplateError.

The tool-use conversation goes through the server's request model first (OpenAI wire shape:
`arguments` a JSON string, `content: null`), and transformers gets what vLLM hands templates
(`arguments` parsed into a dict, content ""), so the server renders as vLLM does.
"""
import copy
import json
import os

import pytest
from llama_sdist import SDIST, extract
from tokenizers import Tokenizer as Backend
from tokenizers import models

from numa_runtime.serve.protocol import ChatCompletionRequest
from numa_runtime.tokenizer import ChatTemplateError, Tokenizer

transformers = pytest.importorskip("transformers", reason="SKIPPED: transformers is missing, so chat templates "
                                                          "are not compared with it (scripts/test.sh installs it)")

PREFIX = "vendor/llama.cpp/models/templates/"
TEMPLATES = [  # every .jinja file of that folder in SDIST
    "Apertus-8B-Instruct", "Apriel-1.6-15b-Thinker-fixed", "Bielik-11B-v3.0-Instruct", "ByteDance-Seed-OSS",
    "Cohere2MoE", "CohereForAI-c4ai-command-r-plus-tool_use", "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
    "GLM-4.6", "GLM-4.7-Flash", "GigaChat3-10B-A1.8B", "GigaChat3.1-10B-A1.8B", "HuggingFaceTB-SmolLM3-3B",
    "Kimi-K2-Instruct", "Kimi-K2-Thinking", "Kimi-K3", "LFM2-8B-A1B", "LFM2.5-8B-A1B", "LFM2.5-Instruct",
    "MiMo-VL", "MiniMax-M1", "MiniMax-M2", "MiniMax-M3", "Mistral-Small-3.2-24B-Instruct-2506",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "NVIDIA-Nemotron-Nano-v2",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
    "Qwen-QwQ-32B", "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "Qwen3-Coder", "Qwen3.5-4B", "Reka-Edge",
    "Spark2.5", "StepFun3.5-Flash", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek-ai-DeepSeek-V3.1", "deepseek-ai-DeepSeek-V3.2",
    "deepseek-ai-DeepSeek-V4-Flash-0731", "deepseek-ai-DeepSeek-V4", "fireworks-ai-llama-3-firefunction-v2",
    "google-gemma-2-2b-it", "google-gemma-4-31B-it-interleaved", "google-gemma-4-31B-it",
    "ibm-granite-granite-3.3-2B-Instruct", "ibm-granite-granite-4.0", "ibm-granite-granite-4.1",
    "inclusionai-ling-3.0-flash", "llama-cpp-deepseek-r1", "llama-cpp-rwkv-world",
    "meetkai-functionary-medium-v3.1", "meetkai-functionary-medium-v3.2", "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct", "meta-llama-Llama-3.3-70B-Instruct",
    "microsoft-Phi-3.5-mini-instruct", "mistralai-Ministral-3-14B-Reasoning-2512",
    "mistralai-Mistral-Nemo-Instruct-2407", "moonshotai-Kimi-K2", "muse-glimmer", "openai-gpt-oss-120b",
    "openbmb-MiniCPM5-1B", "poolside-Laguna-S-2.1", "poolside-Laguna-XS-2.1", "poolside-Laguna-XS.2",
    "tencent-Hy3", "unsloth-Apriel-1.5", "unsloth-mistral-Devstral-Small-2507", "upstage-Solar-Open-100B",
]
DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
LLAMA3 = ("<|begin_of_text|>", "<|eot_id|>")
# name prefix -> (bos_token, eos_token), as the models' tokenizer configs have them (Qwen: no BOS);
# "<s>", "</s>" for the others
SPECIAL = {
    "meta-llama": LLAMA3, "fireworks": LLAMA3, "meetkai": LLAMA3, "deepseek": DEEPSEEK, "llama-cpp-deepseek": DEEPSEEK,
    "NousResearch": ("<|begin_of_text|>", "<|im_end|>"), "Qwen": (None, "<|im_end|>"),
    "HuggingFaceTB": (None, "<|im_end|>"), "google-gemma": ("<bos>", "<eos>"),
    "microsoft-Phi": ("<s>", "<|endoftext|>"),
    "ibm-granite": (None, "<|end_of_text|>"), "openai-gpt-oss": ("<|startoftext|>", "<|return|>"),
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City name, e.g. Zürich"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
ASK = {"role": "user", "content": "What is the weather in Ouagadougou?"}
RESULT = {"role": "tool", "tool_call_id": "call00001", "content": '{"temperature": 21}'}
CALL = {"id": "call00001", "type": "function",  # NOTE: Mistral's templates want 9 alphanumerics
        "function": {"name": "get_weather", "arguments": {"city": "Ouagadougou", "unit": "celsius"}}}
# the tool-use turn as an OpenAI client sends it, and as vLLM hands it to the template
WIRE_CALL = [{"role": "system", "content": "You can call tools."}, ASK,
             {"role": "assistant", "content": None, "tool_calls": [
                 {**CALL, "function": {"name": "get_weather",
                                       "arguments": '{"city":"Ouagadougou","unit":"celsius"}'}}]},
             RESULT]
VLLM_CALL = [WIRE_CALL[0], ASK, {"role": "assistant", "content": "", "tool_calls": [CALL]}, RESULT]

# name -> messages, given to both renderers (with KWARGS[name])
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello! Who are you? Ça va ? 😀"}],
    "system_user": [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Hi"}],
    "multi_turn": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
                   {"role": "user", "content": "Tell me a joke."}],
    # the Python API as users call it: content None beside tool calls, a finished tool turn
    "tool_use_api": [ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]}, RESULT,
                     {"role": "assistant", "content": "It is 21 °C."}, {"role": "user", "content": "Thanks"}],
    "reasoning": [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
                  {"role": "user", "content": "And 3+3?"}],
}
KWARGS = {"tool_use_api": {"tools": [WEATHER]}, "no_thinking": {"enable_thinking": False}}
CONVERSATIONS["no_thinking"] = CONVERSATIONS["user"]
# templates that transformers (and vLLM) cannot render any of these conversations with, and why
RENDER_NOTHING = {
    "fireworks-ai-llama-3-firefunction-v2": "it reads a `functions` variable that only llama.cpp passes",
    "CohereForAI-c4ai-command-r-plus-tool_use": "it wants Cohere's flat tools (description, parameter_definitions)",
}


def special_tokens(name: str) -> tuple:
    return next((tokens for prefix, tokens in SPECIAL.items() if name.startswith(prefix)), ("<s>", "</s>"))


@pytest.fixture(scope="module")
def template_dir(tmp_path_factory):
    local = os.environ.get("NUMA_RUNTIME_LLAMA_TEMPLATES")
    if local:
        return local
    return extract(tmp_path_factory, lambda rel: rel.startswith(PREFIX) and rel.endswith(".jinja"))


def test_every_template_is_listed(template_dir):
    assert sorted(f[:-len(".jinja")] for f in os.listdir(template_dir) if f.endswith(".jinja")) == sorted(TEMPLATES)


def _backend(bos, eos) -> Backend:
    return Backend(models.WordLevel({"<unk>": 0, **{t: i + 1 for i, t in enumerate(filter(None, (bos, eos)))}},
                                    unk_token="<unk>"))


def _render(render, messages, kwargs):
    """(text, None), or (None, the exception) where the renderer raised."""
    try:
        return render(copy.deepcopy(messages), **kwargs), None
    except Exception as e:  # noqa: BLE001 - which one is the point of the comparison
        return None, e


def _server_messages(wire: list[dict]) -> list[dict]:
    body = ChatCompletionRequest.model_validate_json(json.dumps({"messages": wire}))
    return [m.as_template_dict() for m in body.messages]


def test_server_hands_templates_what_vllm_does():
    assert _server_messages(WIRE_CALL) == VLLM_CALL


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_renders_as_transformers(template_dir, name):
    with open(os.path.join(template_dir, name + ".jinja"), encoding="utf-8") as f:
        source = f.read()
    bos, eos = special_tokens(name)
    ours = Tokenizer(_backend(bos, eos), {"bos_token": bos, "eos_token": eos}, {}, {"default": source})
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=_backend(bos, eos), bos_token=bos, eos_token=eos,
                                                  chat_template=source)
    # NOTE: transformers gets what vLLM's LLM.chat hands it (content None is ""; it raised on templates
    # that read message['content'] of a tool-call turn); ours normalizes the same itself
    cases = {k: (v, [{**m, "content": "" if m.get("content") is None else m["content"]} for m in v],
                 KWARGS.get(k, {})) for k, v in CONVERSATIONS.items()}
    cases["tool_use_server"] = (_server_messages(WIRE_CALL), VLLM_CALL, {"tools": [WEATHER]})
    mismatches, rendered = [], 0
    for case, (our_messages, their_messages, kwargs) in cases.items():
        for gen in (True, False):
            call = {**kwargs, "add_generation_prompt": gen}
            want, their_error = _render(lambda m, **kw: theirs.apply_chat_template(m, tokenize=False, **kw),
                                        their_messages, call)
            got, our_error = _render(ours.render_chat, our_messages, call)
            ours_said = f"we raised {our_error!r}" if our_error else f"we rendered {got!r}"
            if their_error is not None and not isinstance(our_error, ChatTemplateError):
                mismatches.append(f"{case} gen={gen}: transformers raised {their_error!r}, {ours_said}")
            elif their_error is None and got != want:
                mismatches.append(f"{case} gen={gen}: transformers rendered {want!r}, {ours_said}")
            elif their_error is None:
                rendered += 1
                assert ("Ouagadougou" in got) == case.startswith("tool_use"), (case, got)
    assert not mismatches, "\n".join(mismatches)
    # NOTE: some templates render only some conversations (tool-use templates need tools, Gemma
    # refuses a system role); all but these render at least one.
    assert (rendered == 0) == (name in RENDER_NOTHING), RENDER_NOTHING.get(name, "renders nothing")


# ------------------------------------------------------------------ through the server
@pytest.fixture(scope="module")
def qwen3_server(template_dir, tmp_path_factory):
    """The tiny random Llama of test_server, with Qwen3's real chat template."""
    import shutil

    from test_server import ServerProcess, tiny_model_dir
    d = tmp_path_factory.mktemp("tiny-qwen3-template")
    shutil.copytree(tiny_model_dir(tmp_path_factory), d, dirs_exist_ok=True)
    shutil.copy(os.path.join(template_dir, "Qwen-Qwen3-0.6B.jinja"), d / "chat_template.jinja")
    srv = ServerProcess(["--model", str(d), "--dtype", "float32", "--max-model-len", "512",
                         "--served-model-name", "tiny", "--num-threads", "1"])
    yield srv, transformers.AutoTokenizer.from_pretrained(str(d))
    srv.stop()


def _prompt_tokens(srv, messages, **kw) -> int:
    r = srv.client().chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0, **kw)
    return r.usage.prompt_tokens


def test_server_renders_tool_calls_and_reasoning_as_vllm(qwen3_server):
    srv, hf = qwen3_server
    thought = "The user wants the weather; I should call get_weather."
    wire = copy.deepcopy(WIRE_CALL)
    wire[2]["reasoning_content"] = thought
    vllm = copy.deepcopy(VLLM_CALL)
    vllm[2].update(reasoning=thought, reasoning_content=thought)

    def count(messages):
        return len(hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    assert _prompt_tokens(srv, wire) == count(vllm)
    # what the server rendered before: tool calls, their ids and the reasoning dropped
    dropped = [{k: v for k, v in m.items() if k in ("role", "content")} for m in VLLM_CALL]
    assert count(dropped) != count(vllm)
    # arguments left a (compact) JSON string render differently in Qwen3's template
    as_string = copy.deepcopy(vllm)
    as_string[2]["tool_calls"][0]["function"]["arguments"] = wire[2]["tool_calls"][0]["function"]["arguments"]
    assert count(as_string) != count(vllm)


def test_server_passes_chat_template_kwargs(qwen3_server):
    srv, hf = qwen3_server
    messages = CONVERSATIONS["user"]

    def count(**kw):
        return len(hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False, **kw))
    assert _prompt_tokens(srv, messages) == count() != count(enable_thinking=False)
    off = _prompt_tokens(srv, messages, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off == count(enable_thinking=False)


def test_server_template_refusals_are_400(qwen3_server):
    import openai
    srv, _ = qwen3_server
    # NOTE: tools have their own field (chat_template_kwargs carrying them reached the template: a TypeError)
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs cannot set 'tools'"):
        _prompt_tokens(srv, CONVERSATIONS["user"], extra_body={"chat_template_kwargs": {"tools": 5}})
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs cannot set 'messages'"):
        _prompt_tokens(srv, CONVERSATIONS["user"], extra_body={"chat_template_kwargs": {"messages": []}})
