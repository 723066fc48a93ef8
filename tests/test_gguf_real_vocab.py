"""Real models' GGUF tokenizers against the token ids their own Hugging Face tokenizers give.

llama.cpp keeps vocabulary-only GGUF files of real models (Llama 3, Llama 2, Qwen2, Qwen3.5,
DeepSeek LLM and Coder, Phi-3, GPT-2, StarCoder, ...) beside test texts (.inp) and the ids transformers' tokenizer of
each model gives for them (.out). They ship in the source distribution of llama-cpp-python on
PyPI (vendor/llama.cpp/models), which this test downloads once per run (set
NUMA_RUNTIME_LLAMA_VOCAB to a folder holding the files to use a local copy).
"""
import os

import pytest
from llama_sdist import extract

from numa_runtime.gguf_tokenizer import write_tokenizer
from numa_runtime.tokenizer import Tokenizer

PREFIX = "vendor/llama.cpp/models/ggml-vocab-"
# tokenizer.ggml.model / pre of each: llama = SentencePiece
VOCABS = ["llama-bpe", "llama-spm", "qwen2", "qwen35", "phi-3", "gpt-2", "starcoder", "refact", "command-r",
          "deepseek-llm", "deepseek-coder", "mpt"]
SEP = "\n__ggml_vocab_test__\n"


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    local = os.environ.get("NUMA_RUNTIME_LLAMA_VOCAB")
    if local:
        return local
    return extract(tmp_path_factory, lambda rel: rel.startswith(PREFIX) and
                   rel[len(PREFIX):].split(".gguf")[0] in VOCABS)


@pytest.mark.parametrize("name", VOCABS)
def test_real_vocab_equals_transformers_ids(vocab_dir, tmp_path, name):
    import gguf
    path = os.path.join(vocab_dir, f"ggml-vocab-{name}.gguf")
    reader = gguf.GGUFReader(path)
    meta = {n: f.contents() for n, f in reader.fields.items()}
    write_tokenizer(meta, str(tmp_path), meta["general.architecture"] + ".", source=path)
    tok = Tokenizer.from_dir(str(tmp_path))
    with open(path + ".inp", encoding="utf-8") as f:
        texts = f.read().split(SEP)
    with open(path + ".out") as f:
        wants = f.read().split("\n")
    assert len(texts) > 40
    for text, want in zip(texts, wants):
        assert tok.encode(text, add_special_tokens=False) == [int(x) for x in want.split()], text


def test_phi3_control_tokens_take_the_newline_after_them(vocab_dir, tmp_path):
    """As Phi-3's tokenizer_config (rstrip) and llama.cpp: its chat template writes "<|user|>\\n"
    and the newline goes with the control token; it was encoded as two extra tokens (▁, <0x0A>)
    after each, a prompt the model never saw."""
    import gguf
    path = os.path.join(vocab_dir, "ggml-vocab-phi-3.gguf")
    meta = {n: f.contents() for n, f in gguf.GGUFReader(path).fields.items()}
    write_tokenizer(meta, str(tmp_path), "phi3.", source=path)
    tok = Tokenizer.from_dir(str(tmp_path))
    ids = tok.encode("<s><|user|>\nHello<|end|>\n<|assistant|>\n", add_special_tokens=False)
    assert ids == [1, 32010, 15043, 32007, 32001], ids
    # NOTE: </s> too, a user-defined token in the GGUF (it took "▁", "<0x0A>" after it)
    assert tok.encode("</s>\nHi", add_special_tokens=False) == [2, 6324]
    assert tok.encode("<|end|>\nHi", add_special_tokens=False) == [32007, 6324]


@pytest.mark.parametrize("name", ["deepseek-coder", "deepseek-llm"])
def test_deepseek_byte_alphabet_tokens_are_their_characters(vocab_dir, tmp_path, name):
    """DeepSeek's user-defined tokens õ ö ü ú ... (byte-alphabet characters of bytes UTF-8 never
    holds) are text matched before BPE: "Köln" takes one of them, as llama.cpp and the model's own
    tokenizer encode it. They decoded as one invalid byte each ("K\\ufffdln"; llama.cpp copies their
    text), and a constraint that forced "ö" failed: llguidance read the token as that byte."""
    import gguf
    import llguidance as llg
    from numa_runtime.structured import _grammar, _limits, _llguidance_json
    path = os.path.join(vocab_dir, f"ggml-vocab-{name}.gguf")
    meta = {n: f.contents() for n, f in gguf.GGUFReader(path).fields.items()}
    write_tokenizer(meta, str(tmp_path), "llama.", source=path)
    tok = Tokenizer.from_dir(str(tmp_path))
    text = "Köln, Zürich, Málaga, smörgåsbord, Øre, dÿ"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(meta["tokenizer.ggml.token_type"][i] == 4 for i in ids)  # NOTE: the user-defined ones are used
    assert tok.decode(ids) == text and b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    lt = llg.LLTokenizer(_llguidance_json(tok._backend.to_str()), n_vocab=len(meta["tokenizer.ggml.tokens"]),
                         eos_token=[int(meta["tokenizer.ggml.eos_token_id"])])
    m = llg.LLMatcher(lt, _grammar(llg, "regex", "Köln|Zürich"), log_level=0, limits=_limits(llg))
    forced = m.compute_ff_tokens()  # NOTE: "K" starts only one of them: the rest is forced
    assert not m.is_error(), m.get_error()
    want = tok.encode("K", add_special_tokens=False)
    assert m.consume_tokens(want) and not m.is_error(), m.get_error()
    forced = m.compute_ff_tokens()
    assert not m.is_error() and m.consume_tokens(forced) and not m.is_error(), m.get_error()
    assert tok.decode(want + forced) == "Köln" and m.is_accepting()
