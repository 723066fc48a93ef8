"""AWQ and GPTQ int4 checkpoints, packed here from the formats' descriptions with random
integers, zero points and scales: the engine must reproduce the dense model w = s (q - z)."""
import json
import os
import shutil

import numpy as np
import pytest

from models import build_model
from quant_helpers import LINEARS, prefill_logits

from numa_runtime import Engine, SamplingParams
from numa_runtime.config import UnsupportedModelError
from numa_runtime.quant.loader import CHECKPOINT_METHODS

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=384)
PROMPT = [1, 17, 42, 99, 5, 200, 13, 7, 300, 64, 3, 250, 11]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
G = 64


def pack_words(vals: np.ndarray, axis: int) -> np.ndarray:
    """Eight 4-bit values along `axis` per int32 word, value j in bits 4j..4j+3."""
    v = np.moveaxis(vals.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    words = np.zeros(v.shape[:-1], np.uint32)
    for j in range(8):
        words |= v[..., j] << np.uint32(4 * j)
    return np.ascontiguousarray(np.moveaxis(words, -1, axis)).view(np.int32)


def pack(method, q, z, s, fmt):
    """q [K, N], z [K/G, N] -> the checkpoint's tensors."""
    k = q.shape[0]
    out = {"scales": s}
    if method == "gptq":
        out["qweight"] = pack_words(q, 0)                                   # [K/8, N]
        out["qzeros"] = pack_words(z - (1 if fmt == "gptq" else 0), 1)      # [K/G, N/8]
        out["g_idx"] = (np.arange(k) // G).astype(np.int32)
    else:
        # nibble i of a word holds column 8c + ORDER[i]
        perm = lambda a: a.reshape(a.shape[0], -1, 8)[:, :, AWQ_ORDER].reshape(a.shape)  # noqa: E731
        out["qweight"] = pack_words(perm(q), 1)                             # [K, N/8]
        out["qzeros"] = pack_words(perm(z), 1)                              # [K/G, N/8]
    return out


def write_checkpoints(src, qdir, ref_dir, method, fmt="gptq", seed=0, scales="float16", linears=LINEARS):
    """scales: the dtype the quantized checkpoint stores them in (float16, bfloat16, float32);
    linears: the projections (a weight's last module name) the checkpoint quantizes."""
    from safetensors.numpy import load_file, save_file
    rng = np.random.default_rng(seed)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    qt, dense = {}, {}
    for name, w in tensors.items():
        base = name[:-len("weight")]
        if not (name.endswith(".weight") and name.split(".")[-2] in linears):
            qt[name] = dense[name] = w
            continue
        n, k = w.shape
        q = rng.integers(0, 16, (k, n))
        ng = -(-k // G)  # NOTE: a partial last group where G does not divide K, as GPTQ stores it
        z = rng.integers(1, 16, (ng, n))
        s = rng.uniform(0.002, 0.01, (ng, n)).astype(np.float16)
        if scales == "bfloat16":  # NOTE: values bf16 holds exactly (and f16 too)
            s = (s.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float16)
        zk, sk = np.repeat(z, G, axis=0)[:k], np.repeat(s.astype(np.float32), G, axis=0)[:k]
        dense[name] = np.ascontiguousarray((sk * (q - zk).astype(np.float32)).T)    # [N, K]
        for key, val in pack(method, q, z, s, fmt).items():
            qt[base + key] = val
    for d, t in ((qdir, qt), (ref_dir, dense)):
        shutil.copytree(src, d)
        save_file(t, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    if scales != "float16":
        import torch
        from safetensors.torch import save_file as save_torch
        save_torch({k: (torch.from_numpy(v.astype(np.float32)).to(getattr(torch, scales)) if k.endswith(".scales")
                        else torch.from_numpy(v)) for k, v in qt.items()},
                   os.path.join(qdir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(qdir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": G, "desc_act": False,
                                  "sym": False, "version": "gemm", "checkpoint_format": fmt}
    with open(os.path.join(qdir, "config.json"), "w") as f:
        json.dump(cfg, f)


def engine(model):
    return Engine(model, dtype="float32", kv_cache_memory=1 << 23, max_model_len=128)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hfq") / "src")
    build_model(d, arch="qwen2", **SHAPE)
    return d


@pytest.mark.parametrize("method,fmt,scales", [("gptq", "gptq", "float16"), ("gptq", "gptq_v2", "float16"),
                                               ("awq", "gemm", "float16"), ("gptq", "gptq", "bfloat16"),
                                               ("awq", "gemm", "bfloat16"), ("awq", "gemm", "float32")])
def test_checkpoint_equals_dense_model(src, tmp_path, method, fmt, scales):
    """bf16 scales (a checkpoint saved in bf16) used to be read as the integers of their bits."""
    qdir, ref_dir = str(tmp_path / "q"), str(tmp_path / "ref")
    write_checkpoints(src, qdir, ref_dir, method, fmt, scales=scales)
    _assert_equals_dense(qdir, ref_dir, lambda m: (m.layers[0].gate_up_proj.dtype,), ("int4",))


def _assert_equals_dense(qdir, ref_dir, dtypes, want):
    """The quantized checkpoint's linears are `want` (dtypes(model)); its logits and greedy tokens
    those of the dense model of the same integers."""
    q, r = engine(qdir), engine(ref_dir)
    try:
        assert dtypes(q.runner.model) == want
        lq, lr = prefill_logits(q, PROMPT), prefill_logits(r, PROMPT)
        assert np.abs(lq - lr).max() <= 1e-4 * np.abs(lr).max()
        greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        assert q.generate([PROMPT], greedy)[0].token_ids == r.generate([PROMPT], greedy)[0].token_ids
    finally:
        q.close()
        r.close()


def _edit_config(d, **quant):
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"].update(quant)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)


def _edit_tensors(d, edit):
    from safetensors.numpy import load_file, save_file
    t = load_file(os.path.join(d, "model.safetensors"))
    edit(t)
    save_file(t, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})


def test_scales_that_float16_rounds_are_said_to_be_rounded_once(src, tmp_path, caplog):
    """Our packed weights hold f16 scales: f32 scales off the f16 grid ran rounded without a
    word. One warning names the file, a tensor and the size of the rounding; f16 scales (the
    first load) and f32 ones f16 holds exactly give none."""
    qdir, ref_dir = str(tmp_path / "q"), str(tmp_path / "ref")
    write_checkpoints(src, qdir, ref_dir, "awq", "gemm", scales="float32")
    engine(qdir).close()
    assert "rounded to it" not in caplog.text

    def nudge(t):
        for k in [k for k in t if k.endswith(".scales")]:
            t[k] = (t[k].astype(np.float32) * np.float32(1 + 2.0 ** -14)).astype(np.float32)
    _edit_tensors(qdir, nudge)
    caplog.clear()
    engine(qdir).close()
    said = [r.getMessage() for r in caplog.records if "rounded to it" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(qdir) and "scales do not fit float16 (stored as float32)" in said[0]
    assert "by up to 6.1e-05 of a scale" in said[0] or "by up to 6.0e-05 of a scale" in said[0], said[0]


def test_act_order_is_refused(src, tmp_path):
    """desc_act with a g_idx that permutes the groups is refused; with g_idx = k // group_size
    (static groups) the file runs as any other."""
    qdir, ref_dir = str(tmp_path / "q"), str(tmp_path / "ref")
    write_checkpoints(src, qdir, ref_dir, "gptq")
    _edit_config(qdir, desc_act=True)
    q, r = engine(qdir), engine(ref_dir)
    try:
        assert np.abs(prefill_logits(q, PROMPT) - prefill_logits(r, PROMPT)).max() <= 1e-4
    finally:
        q.close()
        r.close()

    def shuffle(t):
        name = next(n for n in t if n.endswith("g_idx"))
        t[name] = np.random.default_rng(0).permutation(t[name])
    _edit_tensors(qdir, shuffle)
    with pytest.raises(UnsupportedModelError, match="act-order"):
        engine(qdir)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_config_whose_groups_do_not_match_the_tensors_is_refused(src, tmp_path, method):
    """A group_size that does not describe the file (AWQ used to run it on the wrong scales), and
    scales or zeros one row short, each give one sentence naming the tensor."""
    from numa_runtime.quant.formats import QuantError
    qdir, ref_dir = str(tmp_path / "q"), str(tmp_path / "ref")
    write_checkpoints(src, qdir, ref_dir, method)
    _edit_config(qdir, group_size=128)
    with pytest.raises(QuantError, match="(qzeros|scales) has shape .* the quantization_config does not describe"):
        engine(qdir)
    _edit_config(qdir, group_size=G)
    for part in ("scales", "qzeros"):
        def short(t, part=part):
            name = next(n for n in t if n.endswith(part))
            t[name] = np.ascontiguousarray(t[name][:-1])
        shutil.rmtree(qdir)
        write_checkpoints(src, qdir, str(tmp_path / f"ref-{part}"), method)
        _edit_tensors(qdir, short)
        with pytest.raises(QuantError, match=f"{part} has shape"):
            engine(qdir)


def test_other_quant_methods_are_refused(src, tmp_path):
    d = str(tmp_path / "m")
    shutil.copytree(src, d)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(UnsupportedModelError, match="quant_method 'bitsandbytes' are not supported"):
        engine(d)


def test_partial_last_group_is_refused_on_one_rank(tmp_path):
    """K not a multiple of group_size (GPTQ stores a partial last group): a sentence saying so,
    not a hint at rank counts (there is one rank)."""
    from numa_runtime.quant.formats import QuantError
    src = str(tmp_path / "src")
    build_model(src, arch="qwen2", **{**SHAPE, "intermediate_size": 480})
    qdir, ref_dir = str(tmp_path / "q"), str(tmp_path / "ref")
    write_checkpoints(src, qdir, ref_dir, "gptq")
    with pytest.raises(QuantError, match=r": model\.layers\.0\.mlp\.down_proj\.weight has 480 input features, not "
                                         r"a multiple of its group_size 64 \(a partial last group\); such "
                                         r"checkpoints are not supported\.$"):
        engine(qdir)


def _greedy_tokens(model, greedy):
    """The tokens the checkpoint at `model` gives PROMPT as stored (no quantization asked)."""
    e = engine(model)
    try:
        return e.generate([PROMPT], greedy)[0].token_ids
    finally:
        e.close()


def _assert_runs_as_stored(model, quantization, greedy, want):
    """The checkpoint's int4 weights run as stored under `quantization` and give the tokens `want`."""
    e = Engine(model, dtype="float32", kv_cache_memory=1 << 23, max_model_len=128, quantization=quantization)
    try:
        assert e.runner.model.layers[0].gate_up_proj.dtype == "int4"
        assert e.generate([PROMPT], greedy)[0].token_ids == want
    finally:
        e.close()


def test_vllm_method_names_check_the_checkpoint(src, tmp_path):
    """quantization='awq' / 'gptq' / 'awq_marlin' / 'gguf' (vLLM's names) runs an AWQ file as
    stored, and refuses in one sentence a file of another format or a dense one (it was refused
    as an unknown quantization)."""
    qdir, ref_dir = str(tmp_path / "q"), str(tmp_path / "ref")
    write_checkpoints(src, qdir, ref_dir, "awq", "gemm")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = _greedy_tokens(qdir, greedy)
    for name in ("awq", "AWQ", "awq_marlin"):
        _assert_runs_as_stored(qdir, name, greedy, want)
    for model, name, held in ((qdir, "gptq", "holds AWQ weights"), (qdir, "gguf", "holds AWQ weights"),
                              (src, "awq", "is a dense checkpoint")):
        article = "an" if name == "awq" else "a"
        with pytest.raises(ValueError, match=f"names the format of {article} {CHECKPOINT_METHODS[name].upper()} "
                                             f"checkpoint, but .* {held}; drop it"):
            Engine(model, dtype="float32", kv_cache_memory=1 << 23, max_model_len=128, quantization=name)


@pytest.mark.parametrize("method,filename,quant", [
    ("gptq", "quantize_config.json", {"bits": 4, "group_size": G, "desc_act": False, "sym": False,
                                      "static_groups": False, "model_file_base_name": "model"}),
    ("awq", "quant_config.json", {"zero_point": True, "q_group_size": G, "w_bit": 4, "version": "GEMM"})])
def test_older_quantization_config_files_are_read(src, tmp_path, method, filename, quant):
    """AutoGPTQ's quantize_config.json and AutoAWQ's quant_config.json beside a config.json without
    quantization_config (older checkpoints), as vLLM reads them: the same model as when config.json
    holds it (quantization='gptq'/'awq' called such a file dense, and without it the q_proj weights
    were missing)."""
    qdir, ref_dir = str(tmp_path / "q"), str(tmp_path / "ref")
    write_checkpoints(src, qdir, ref_dir, method, "gemm" if method == "awq" else "gptq")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = _greedy_tokens(qdir, greedy)
    with open(os.path.join(qdir, "config.json")) as f:
        cfg = json.load(f)
    del cfg["quantization_config"]
    with open(os.path.join(qdir, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(qdir, filename), "w") as f:
        json.dump(quant, f)
    for name in (None, method):
        _assert_runs_as_stored(qdir, name, greedy, want)
    with open(os.path.join(qdir, filename), "w") as f:
        json.dump({**quant, **({"w_bit": 8} if method == "awq" else {"bits": 8})}, f)
    with pytest.raises(ValueError, match=f"{method.upper()} checkpoints with bits 8 are not supported"):
        engine(qdir)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_a_mixtral_checkpoint_runs_its_experts_as_stored(tmp_path, method):
    """AutoAWQ / GPTQ Mixtral files quantize every expert's w1/w3/w2 (block_sparse_moe.experts.N),
    the router stays dense: each expert's qweight/qzeros/scales read under Qwen-MoE's names, equal
    to the dense model of the same integers."""
    src, qdir, ref_dir = str(tmp_path / "src"), str(tmp_path / "q"), str(tmp_path / "ref")
    build_model(src, arch="mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None, **SHAPE)
    write_checkpoints(src, qdir, ref_dir, method, "gemm" if method == "awq" else "gptq",
                      linears=LINEARS + ("w1", "w2", "w3"))
    _assert_equals_dense(qdir, ref_dir, lambda m: tuple(x.dtype for x in m.layers[0].moe.experts[3]), ("int4", "int4"))


def test_quantization_configs_as_vllm_reads_them(src, tmp_path):
    """quant_method in upper case is the method (vLLM lower-cases it; it was refused); AutoGPTQ's
    is_marlin_format is the Marlin repack, refused as such (it failed for a 'missing' q_proj);
    quantizing at load a file that is quantized but for some modules is refused as for a wholly
    quantized one (it re-quantized the modules the quantizer had kept dense)."""
    qdir, ref_dir = str(tmp_path / "q"), str(tmp_path / "ref")
    write_checkpoints(src, qdir, ref_dir, "gptq", "gptq")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = _greedy_tokens(qdir, greedy)
    _edit_config(qdir, quant_method="GPTQ")
    assert _greedy_tokens(qdir, greedy) == want
    _edit_config(qdir, quant_method="gptq", is_marlin_format=True)
    with pytest.raises(UnsupportedModelError, match=r"GPTQ checkpoint_format 'marlin' is not supported"):
        engine(qdir)
    part, part_ref = str(tmp_path / "part"), str(tmp_path / "part_ref")
    write_checkpoints(src, part, part_ref, "awq", "gemm", linears=("gate_proj", "up_proj", "down_proj"))
    with pytest.raises(ValueError, match="holds quantized weights already; quantization='int4'"):
        Engine(part, dtype="float32", kv_cache_memory=1 << 23, max_model_len=128, quantization="int4")


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="SKIPPED: mpirun is not installed")
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_moe_experts_of_fewer_groups_than_an_even_split_take_uneven_group_splits(tmp_path, method):
    """Qwen3-MoE experts of 192 columns (3 groups of 64) on 2 ranks: the shares fall on groups,
    2 and 1 (the loader cut them at 32 columns as it may a GGUF super-block, inside an AWQ/GPTQ
    group, and refused the rank count: Qwen3-30B-A3B's 768 = 6 groups of 128 on 4 ranks)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src, qdir, ref_dir = str(tmp_path / "src"), str(tmp_path / "q"), str(tmp_path / "ref")
    build_model(src, arch="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=192, **SHAPE)
    write_checkpoints(src, qdir, ref_dir, method, "gemm" if method == "awq" else "gptq")
    env = dict(os.environ, MPI4PY_RC_THREAD_LEVEL="funneled", OMP_NUM_THREADS="1",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    runs = {}
    for model in (qdir, ref_dir):
        for ranks in (1, 2):
            p = subprocess.run(["mpirun", "-np", str(ranks), sys.executable,
                                os.path.join(root, "tests", "mpi", "engine_generate.py"), model, "float32", "12",
                                json.dumps([PROMPT])], capture_output=True, text=True, timeout=300, env=env, cwd=root)
            assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            runs[model, ranks] = json.loads(line[0][7:])["tokens"]
    assert runs[qdir, 2] == runs[qdir, 1] == runs[ref_dir, 1] == runs[ref_dir, 2]


def test_formats_beside_autogptq_s_are_refused_naming_them():
    """GPTQModel's per-module 'dynamic' overrides and int16 packing, and an MLX-quantized
    checkpoint, were refused for a tensor's shape or dtype, naming no format; each says what it
    is now. 'dynamic' rules that only leave modules dense ("-:") run."""
    from numa_runtime.config import ModelConfig
    from numa_runtime.quant.hf_quant import check_quantization_config
    base = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
    check_quantization_config({**base, "dynamic": {r"-:.*\.0\..*mlp.*": {}}})
    check_quantization_config({**base, "pack_dtype": "int32"})
    with pytest.raises(UnsupportedModelError, match=r"^GPTQ quantization_config's 'dynamic' overrides per module "
                                                    r"\('\+:\.\*mlp\.\*': \.\.\.\) are not supported"):
        check_quantization_config({**base, "dynamic": {"+:.*mlp.*": {"group_size": 32}}})
    with pytest.raises(UnsupportedModelError, match=r"^GPTQ pack_dtype 'int16' is not supported"):
        check_quantization_config({**base, "pack_dtype": "int16"})
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 1, "num_attention_heads": 4}
    assert ModelConfig.from_dict(cfg).hidden_size == 64
    with pytest.raises(UnsupportedModelError, match=r"is an MLX-quantized checkpoint \(4 bits, config.json's "
                                                    r"'quantization'\), which numa_runtime does not read"):
        ModelConfig.from_dict({**cfg, "quantization": {"group_size": 64, "bits": 4}})
