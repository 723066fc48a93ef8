"""`numa-serve --quantization` and `--model x.gguf` through the official openai client: the
served tokens equal the in-process engine on the dequantized model."""
from gguf_helpers import write_gguf, write_reference
from models import build_model
from quant_helpers import write_dequantized_copy
from test_server import ServerProcess

from numa_runtime import Engine, SamplingParams
from numa_runtime.quant.formats import QuantFormat
from numa_runtime.quant.loader import head_quantization

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=384)
PROMPT = [1, 17, 42, 99, 5, 200, 13]


def expected_text(model_dir):
    """Greedy text of the in-process engine on (dequantized) `model_dir`."""
    e = Engine(model_dir, dtype="float32", kv_cache_memory=1 << 23, max_model_len=128)
    out = e.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    e.close()
    return out.outputs[0].text


def served(args, model_name):
    srv = ServerProcess([*args, "--dtype", "float32", "--max-model-len", "128",
                         "--kv-cache-memory", str(1 << 23)])
    try:
        r = srv.client().completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})
    finally:
        code = srv.stop()
    assert code == 0, srv.output()
    return r


def test_serve_quantization_flag(tmp_path):
    src, ref = str(tmp_path / "m"), str(tmp_path / "ref")
    build_model(src, arch="qwen2", **SHAPE)
    write_dequantized_copy(src, ref, QuantFormat.parse("int4"), head_quantization("auto", "int4"))
    r = served(["--model", src, "--quantization", "int4"], "m")
    assert r.usage.completion_tokens == 12
    assert r.choices[0].text == expected_text(ref)


def test_serve_gguf_model(tmp_path):
    src, ref, path = str(tmp_path / "m"), str(tmp_path / "ref"), str(tmp_path / "tiny.Q4_0.gguf")
    build_model(src, arch="llama", **{**SHAPE, "hidden_size": 256, "intermediate_size": 512})
    write_gguf(src, path, "Q4_0")
    write_reference(src, path, ref)
    r = served(["--model", path], "tiny.Q4_0")
    assert r.choices[0].text == expected_text(ref)


def test_serve_prefill_activations_flag(tmp_path):
    """`--prefill-activations int8` reaches the engine: the served greedy text equals the
    in-process bf16 engine's with the same option (and the log says which prefill runs); with
    a float32 engine it is a one-sentence error before serving."""
    import subprocess
    import sys
    src = str(tmp_path / "m")
    build_model(src, arch="qwen2", **SHAPE)
    prompt = PROMPT * 6  # 42 rows: past the decode rule
    kw = dict(dtype="bfloat16", quantization="int4", kv_cache_memory=1 << 23, max_model_len=128,
              prefill_activations="int8")
    e = Engine(src, **kw)
    want = e.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].text
    e.close()
    srv = ServerProcess(["--model", src, "--dtype", "bfloat16", "--quantization", "int4", "--max-model-len", "128",
                         "--kv-cache-memory", str(1 << 23), "--prefill-activations", "int8"])
    try:
        r = srv.client().completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})
    finally:
        code = srv.stop()
    assert code == 0, srv.output()
    assert r.choices[0].text == want
    assert "prefill activations: int8 blocks" in srv.output()
    p = subprocess.run([sys.executable, "-m", "numa_runtime.serve", "--model", src, "--dtype", "float32",
                        "--quantization", "int4", "--prefill-activations", "int8"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "needs dtype='bfloat16'" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
