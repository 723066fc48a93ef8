"""Engine(device="cuda"): the same engine with the model on a GPU (cuda_backend/).

Greedy tokens equal transformers' in float32; decode steps replayed from CUDA graphs give the
same tokens as eager ones; the host KV tier brings evicted prefixes back without changing a
token. Every test skips loudly without a GPU (or runs under TRITON_INTERPRET=1 on CPU).
"""
import numpy as np
import pytest

from cuda_device import SKIP_REASON, on_gpu, requires_cuda
from models import build_model, hf_greedy

from numa_runtime import Engine, SamplingParams

PROMPTS = [[1, 17, 42, 99, 5], [1, 300, 7], list(range(3, 40)), [1, 200]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
CASES = {
    "llama-gqa": dict(arch="llama"),
    "llama-mqa-headdim24": dict(arch="llama", num_key_value_heads=1, head_dim=24),
    "qwen2-bias-tied": dict(arch="qwen2", tie_word_embeddings=True),
    "qwen3-qknorm": dict(arch="qwen3", head_dim=32),
    "mistral-sliding": dict(arch="mistral", sliding_window=7),
    # Phi-3: fused qkv/gate_up split at load, partial rotary with longrope's short factors
    "phi3-longrope-partial": dict(arch="phi3", partial_rotary_factor=0.75, max_position_embeddings=4096,
                                  original_max_position_embeddings=256, rope_scaling={
                                      "rope_type": "longrope", "short_factor": [1.0, 1.3, 2.0, 3.5, 6.0, 9.0],
                                      "long_factor": [1.5, 2.0, 4.0, 8.0, 16.0, 30.0]}),
}


def cuda_engine(path, **kw):
    args = dict(dtype="float32", kv_cache_memory=1 << 22, max_model_len=256, device="cuda", max_num_seqs=8)
    args.update(kw)
    return Engine(str(path), **args)


@requires_cuda
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_transformers_f32(tmp_path, case):
    ref = build_model(str(tmp_path), **CASES[case])
    expected = [hf_greedy(ref, p, GREEDY.max_tokens) for p in PROMPTS]
    eng = cuda_engine(tmp_path)
    outs = eng.generate(PROMPTS, GREEDY)
    for p, o, e in zip(PROMPTS, outs, expected):
        assert o.token_ids == e, f"{case}: prompt {p} diverged"
    if on_gpu():
        assert eng.runner.graphs.num_replays > 0, "decode steps should replay CUDA graphs"


@requires_cuda
def test_graphs_and_eager_give_the_same_tokens_in_bf16(tmp_path):
    """Batches of 1..5 sequences (several buckets, padded rows) and a chunked prefill beside decodes."""
    build_model(str(tmp_path), arch="llama")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = PROMPTS + [list(range(5, 120))]
    outs = {}
    for graphs in (True, False):
        eng = cuda_engine(tmp_path, dtype="bfloat16", cuda_graphs=graphs, max_num_batched_tokens=32)
        outs[graphs] = [o.token_ids for o in eng.generate(prompts, params)]
        if graphs and on_gpu():
            assert len(eng.runner.graphs.graphs) >= 2 and eng.runner.graphs.num_replays > 0
    assert outs[True] == outs[False]


@requires_cuda
def test_bf16_first_logits_close_to_f32_reference(tmp_path):
    import torch
    ref = build_model(str(tmp_path), arch="qwen2")
    prompt = PROMPTS[2]
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0, -1].numpy()
    eng = cuda_engine(tmp_path, dtype="bfloat16")
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    lp = want - want.max() - np.log(np.exp(want - want.max()).sum())
    # NOTE: bf16 weights, activations and KV over 2 layers: within 0.25 nats (the CPU path,
    # which keeps activations in f32, is held to 0.15)
    for tok, val in out.outputs[0].logprob_pairs[0][1].items():
        assert abs(val - lp[tok]) < 0.25, (tok, val, lp[tok])


@requires_cuda
def test_host_tier_restores_evicted_prefixes_without_changing_tokens(tmp_path):
    """A GPU pool of 4 blocks and three conversations (3 blocks each) that return: their prefixes are evicted to the
    host pool and copied back (hits counted), and every token equals a run without the tier."""
    build_model(str(tmp_path), arch="llama")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    convs = [list(range(10 + 40 * i, 10 + 40 * i + 33)) for i in range(3)]  # 33 tokens: 2 full blocks of 16
    runs = {}
    for host in (0, 1 << 20):
        eng = cuda_engine(tmp_path, kv_cache_memory=4 * _block_bytes(tmp_path), host_kv_cache_memory=host,
                          max_num_seqs=1, max_model_len=64)
        toks = []
        for turn in range(2):
            for c in convs:
                toks.append(eng.generate([c], params)[0].token_ids)
        runs[host] = (toks, eng.block_manager.hit_tokens, eng.runner.host_tier)
    assert runs[1 << 20][0] == runs[0][0]
    tier = runs[1 << 20][2]
    assert tier.num_stored > 0 and tier.num_restored > 0
    assert runs[1 << 20][1] > runs[0][1], "the host tier should add prefix-cache hits"


def _block_bytes(path):
    """Bytes of one f32 KV block of 16 tokens of the model in `path`."""
    from numa_runtime.config import ModelConfig
    c = ModelConfig.from_dir(str(path))
    return 2 * c.num_layers * 16 * c.num_kv_heads * c.head_dim * 4


@requires_cuda
def test_embeddings_equal_the_cpu_engines(tmp_path):
    """EMBED plans return the final normed hidden states; the CUDA runner applied the lm_head and
    embed() failed on a vocabulary-sized row."""
    build_model(str(tmp_path), arch="llama")
    ids = [[1, 17, 42, 99, 5], list(range(3, 40))]
    kw = dict(dtype="float32", kv_cache_memory=1 << 22, max_model_len=256)
    cpu = Engine(str(tmp_path), **kw)
    want = cpu.embed(ids, pooling="mean")
    cpu.close()
    eng = cuda_engine(tmp_path)
    for pooling in ("mean", "last"):
        got = eng.embed(ids, pooling=pooling)
        assert got.shape == (2, eng.model_config.hidden_size)
        if pooling == "mean":
            np.testing.assert_allclose(got, want, atol=2e-4)
    eng.close()


@requires_cuda
@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_1"])
def test_gguf_files_run_dequantized_with_the_cpu_engines_tokens(tmp_path, qtype):
    """A GGUF file (the default model is a Q4_1 one) on the GPU: its blocks are dequantized at load
    and the greedy tokens equal the CPU engine's on the same file in float32 (which equal the
    dequantized model's). It failed with "No *.safetensors in <cache dir>"."""
    from gguf_helpers import write_gguf
    hf = tmp_path / "hf"
    hf.mkdir()
    build_model(str(hf), arch="llama")
    path = str(tmp_path / f"m-{qtype}.gguf")
    write_gguf(str(hf), path, qtype)
    kw = dict(dtype="float32", kv_cache_memory=1 << 22, max_model_len=256)
    cpu = Engine(path, **kw)
    want = [o.token_ids for o in cpu.generate(PROMPTS, GREEDY)]
    cpu.close()
    eng = cuda_engine(path)
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == want
    eng.close()


@requires_cuda
def test_a_closed_engine_gives_its_gpu_memory_back(tmp_path):
    """The next engine in the process (the model router's next model) sizes its KV cache from the
    free GPU memory: a closed engine's weights, KV cache and graphs stayed in torch's cache, and
    the second engine got a fraction of the first one's pool."""
    if not on_gpu():
        pytest.skip("needs a real GPU (device memory)")
    import gc
    import torch
    build_model(str(tmp_path), arch="llama", max_position_embeddings=512)
    kw = dict(dtype="float32", max_model_len=512, block_size=256, max_num_seqs=1 << 20, cuda_graphs=False,
              device="cuda", enable_prefix_caching=False)
    sizes = []
    for _ in range(2):
        eng = Engine(str(tmp_path), **kw)  # NOTE: the pool takes about 90% of the free memory
        sizes.append(eng.runner.kv_cache_bytes)
        eng.close()
        del eng
        gc.collect()
    torch.cuda.empty_cache()
    assert sizes[1] >= 0.9 * sizes[0], sizes


def test_several_models_on_the_cuda_backend_need_one_rank(tmp_path):
    """Each model would open its own NCCL group (and switching models closed it): refused."""
    from numa_runtime.serve.router import ModelRouter, ModelSpec, RouterConfig
    build_model(str(tmp_path), arch="llama")
    with pytest.raises(ValueError, match="run on one rank"):
        ModelRouter(RouterConfig((ModelSpec("a", str(tmp_path)),), 1 << 30, {"device": "cuda"}), comm_world=2)


@pytest.mark.skipif(SKIP_REASON is None, reason="this machine can run the CUDA backend")
def test_cuda_without_a_gpu_says_so(tmp_path):
    from numa_runtime.cuda_backend import CudaUnavailableError
    build_model(str(tmp_path), arch="llama")
    with pytest.raises(CudaUnavailableError, match="device='cpu'"):
        cuda_engine(tmp_path)


def test_device_options_are_checked_on_any_machine():
    from numa_runtime.config import EngineConfig
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device="gpu")
    with pytest.raises(ValueError, match="needs device='cuda'"):
        EngineConfig(host_kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match="no CUDA kernel"):
        EngineConfig(device="cuda", quantization="int8")
    with pytest.raises(ValueError, match="non-negative"):
        EngineConfig(device="cuda", host_kv_cache_memory=-1)
    assert EngineConfig(device="cuda", host_kv_cache_memory=1 << 20).host_kv_cache_memory == 1 << 20
