"""GGUF files as models: every supported tensor type, written with the gguf package's writer
from a random model, must give the logits and greedy tokens of the same model dequantized by
the gguf package (its block math, not ours) and run from f32 safetensors. Plus clear errors."""
import json
import os

import numpy as np
import pytest

from gguf_helpers import write_gguf, write_reference
from models import build_model
from quant_helpers import prefill_logits

from numa_runtime import Engine, SamplingParams
from numa_runtime.config import UnsupportedModelError
from numa_runtime.gguf_model import gguf_model_dir
from numa_runtime.weights import CheckpointError

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=384, tie_word_embeddings=False)
PROMPT = [1, 17, 42, 99, 5, 200, 13, 7, 300, 64, 3, 250, 11]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def engine(model, **kw):
    return Engine(model, dtype="float32", kv_cache_memory=1 << 23, max_model_len=128, **kw)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    out = {}
    for arch in ("llama", "qwen2", "qwen3"):
        d = str(tmp_path_factory.mktemp(arch))
        build_model(d, arch=arch, **SHAPE)
        out[arch] = d
    return out


CASES = [("llama", t) for t in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K",
                                 "Q5_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")] + [
    ("qwen2", "Q4_1"), ("qwen3", "Q8_0")]


@pytest.mark.parametrize("arch,qtype", CASES)
def test_gguf_equals_dequantized_reference(hf_models, tmp_path, arch, qtype):
    path = str(tmp_path / f"m.{qtype}.gguf")
    write_gguf(hf_models[arch], path, qtype, arch=arch)
    ref_dir = str(tmp_path / "ref")
    write_reference(hf_models[arch], path, ref_dir)
    g, r = engine(path, lm_head_quantization=None), engine(ref_dir)  # the head as stored
    try:
        lg, lr = prefill_logits(g, PROMPT), prefill_logits(r, PROMPT)
        # NOTE: every type maps without loss (the K-quants with super-block scales): the sums
        # only run in another order
        assert np.abs(lg - lr).max() <= 1e-4 * np.abs(lr).max()
        assert g.generate([PROMPT], GREEDY)[0].token_ids == r.generate([PROMPT], GREEDY)[0].token_ids
        native = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4", "Q5_0": "int5", "Q5_1": "int5",
                  "Q4_K": "int4", "Q5_K": "int5", "Q6_K": "int6", "Q3_K": "int3", "Q2_K": "int2",
                  "IQ4_NL": "int4", "IQ4_XS": "int4"}.get(qtype)
        lin = g.runner.model.layers[0].qkv_proj
        assert getattr(lin, "dtype", None) == (native or "float32")
    finally:
        g.close()
        r.close()


@pytest.mark.parametrize("qtype,dtype", [("Q6_K", "int6"), ("Q5_K", "int5"), ("Q5_0", "int5"), ("Q8_0", "int8"),
                                         ("IQ4_NL", "int4"), ("Q3_K", "int3")])
def test_k_quant_head_keeps_its_width(hf_models, tmp_path, qtype, dtype):
    """llama-quantize's usual output type Q6_K (and Q5_K, Q5_0, Q8_0, and the heads of IQ4 and
    Q3_K files) keeps its bit width as the head under the default lm_head_quantization="auto":
    6.5-7 bits a weight where int8 took 8.5."""
    path = str(tmp_path / f"m.{qtype}.gguf")
    write_gguf(hf_models["llama"], path, qtype)
    g = engine(path)
    try:
        assert g.runner.model.lm_head.dtype == dtype
    finally:
        g.close()


def test_q4_k_blocks_map_to_int4_with_f16_scales():
    """Off a super-block boundary (a rank's columns that start inside one), Q4_K super-blocks
    as int4 groups of 32 with "min" offsets: the codes as stored, each
    sub-block's scale d sc and min dmin m rounded once to f16, so every weight is within 2^-11
    of (|s q| + |m|) of the gguf package's dequantization; column slices on 32-element
    boundaries (what a rank reads) are the same groups."""
    import gguf
    from numa_runtime.gguf_checkpoint import decode_q4k
    from numa_runtime.quant.formats import dequantize
    from gguf_helpers import encode
    rng = np.random.default_rng(3)
    data, _ = encode(np.zeros((7, 768), np.float32), "Q4_K", rng)
    ref = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q4_K).reshape(7, 768)
    w = decode_q4k(data.reshape(7, 3, 144))
    assert w.fmt.bits == 4 and w.fmt.kind == "min" and w.fmt.group_size == 32
    ours = dequantize(w)
    bound = 2.0 ** -11 * (np.abs(w.scales.astype(np.float32)).repeat(32, 1) * w.q + np.abs(w.offsets.astype(np.float32)).repeat(32, 1))
    assert (np.abs(ours - ref) <= bound * 1.001 + 1e-9).all()
    assert np.abs(ours - ref).max() > 0  # the rounding is real: this is not the lossless path


@pytest.mark.parametrize("qtype,bits,group,kind,width", [
    ("Q4_K", 4, 32, "min", 4.625), ("Q5_K", 5, 32, "min", 5.625), ("Q6_K", 6, 16, "sym", 6.5625),
    ("Q3_K", 3, 16, "sym", 3.5625), ("Q2_K", 2, 16, "min", 2.625), ("IQ4_XS", 4, 32, "nl", 4.3125)])
def test_k_quants_map_exactly_onto_super_block_scales(qtype, bits, group, kind, width):
    """Q4_K/Q5_K as int4/int5 groups of 32 with mins, Q6_K as int6 groups of 16, Q3_K and Q2_K
    as int3/int2 groups of 16 (Q3_K's 3-bit codes + 4, Q2_K's 2-bit ones with mins), IQ4_XS as int4
    "nl" groups of 32 (codes of the 16 non-linear levels, sub-scales ls - 32), each with its
    super-blocks' f16 d (and dmin) and its int8 sub-scales (and mins) as stored: the very
    weights of the gguf package's dequantization, and packed in fewer bytes than f16 group
    scales would take (Q4_K: 4.625 bits a weight; Q6_K: 6.5625, the file's own; Q3_K 3.5625
    and Q2_K 2.625 against the file's 3.4375 and 2.625)."""
    import gguf
    from numa_runtime.gguf_checkpoint import NEAR_LOSSLESS, decode_kquant
    from numa_runtime.quant.formats import dequantize
    from numa_runtime.quant.packing import pack
    from gguf_helpers import encode
    rng = np.random.default_rng(7)
    data, _ = encode(np.zeros((16, 768), np.float32), qtype, rng)
    ref = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype]).reshape(16, 768)
    w = decode_kquant(qtype, data.reshape(16, 3, NEAR_LOSSLESS[qtype][1]), exact=True)
    assert (w.fmt.bits, w.fmt.group_size, w.fmt.kind, w.fmt.ks) == (bits, group, kind, 256)
    np.testing.assert_array_equal(dequantize(w), ref)
    assert pack(w).nbytes * 8 / (16 * 768) == width


@pytest.mark.parametrize("qtype,bits,group,kind", [("Q5_K", 5, 32, "min"), ("Q6_K", 6, 16, "sym"),
                                                  ("Q3_K", 3, 16, "sym"), ("Q2_K", 2, 16, "min"),
                                                  ("IQ4_XS", 4, 32, "nl")])
def test_k_quant_blocks_keep_their_codes(qtype, bits, group, kind):
    """Off a super-block boundary (a rank's columns that start inside one): Q5_K as int5 groups
    of 32 with "min" offsets, Q6_K as int6 groups of 16 (w = s (q - 32)), Q3_K/Q2_K as int3/int2
    groups of 16 (sym / with mins), IQ4_XS as int4 "nl": the codes as stored, each sub-block's
    scale (and min) rounded once to f16, so every weight is within 2^-11 of (|s q| + |offset|),
    or of |s NL[q]|, of the gguf package's dequantization."""
    import gguf
    from numa_runtime.gguf_checkpoint import NEAR_LOSSLESS, decode_kquant
    from numa_runtime.quant.formats import NL_VALUES, dequantize
    from gguf_helpers import encode
    rng = np.random.default_rng(5)
    data, _ = encode(np.zeros((7, 768), np.float32), qtype, rng)
    ref = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype]).reshape(7, 768)
    w = decode_kquant(qtype, data.reshape(7, 3, NEAR_LOSSLESS[qtype][1]))
    assert (w.fmt.bits, w.fmt.group_size, w.fmt.kind) == (bits, group, kind)
    # every code of the type is read (random blocks use them all): the high bits, Q3_K's hmask
    codes = {"Q5_K": (0, 31), "Q6_K": (0, 63), "Q3_K": (0, 7), "Q2_K": (0, 3), "IQ4_XS": (0, 15)}[qtype]
    assert (w.q.min(), w.q.max()) == codes
    ours = dequantize(w)
    s = np.abs(w.scales.astype(np.float32)).repeat(group, 1)
    off = (np.abs(w.offsets.astype(np.float32)).repeat(group, 1) if w.offsets is not None
           else s * (1 << (bits - 1)))
    bound = 2.0 ** -11 * (s * np.abs(NL_VALUES[w.q].astype(np.float32)) if kind == "nl" else s * w.q + off)
    assert (np.abs(ours - ref) <= bound * 1.001 + 1e-9).all()
    assert np.abs(ours - ref).max() > 0


def test_unknown_tensor_type_is_named(hf_models, tmp_path):
    path = str(tmp_path / "m.gguf")
    write_gguf(hf_models["llama"], path, "IQ2_XXS")
    with pytest.raises(CheckpointError, match="has GGUF type IQ2_XXS, which numa_runtime does not read"):
        engine(path)


@pytest.mark.parametrize("with_default", [True, False])
def test_named_chat_templates_of_a_gguf_are_kept(hf_models, tmp_path, with_default):
    """gguf-py writes a tool_use template as tokenizer.chat_template.tool_use (listed in
    tokenizer.chat_templates); it was dropped, and tools never reached the prompt. With tools it is
    the template (as llama.cpp, transformers and vLLM pick it); without, the default one (or the
    only one)."""
    from numa_runtime.gguf_model import gguf_model_dir
    from numa_runtime.tokenizer import Tokenizer

    def extra(w):
        w.add_string("tokenizer.chat_template.tool_use",
                     "TOOLS:{{ tools | tojson }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
        w.add_array("tokenizer.chat_templates", ["tool_use"])
    path = str(tmp_path / "m.gguf")
    kw = {} if with_default else {"chat_template": None}
    write_gguf(hf_models["llama"], path, "F32", extra=extra, **kw)
    tok = Tokenizer.from_dir(gguf_model_dir(path))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(msgs, tools=tools).startswith('TOOLS:[{"type": "function"')
    assert tok.render_chat(msgs) == ("hi" if with_default else "TOOLS:null" + "hi")


def test_a_damaged_or_replaced_description_is_made_again(hf_models, tmp_path):
    """The cached description of a GGUF: one with a file cut or deleted (by hand, a full disk) was
    trusted for ever and every run failed on it, one edited at its size ran as edited; a file replaced in place at its size with its
    mtime kept (cp -p) ran on the old description; a killed writer's temporary folder stayed."""
    import shutil
    from numa_runtime.gguf_model import folder_complete, gguf_model_dir
    from numa_runtime.tokenizer import Tokenizer
    path = str(tmp_path / "m.gguf")
    write_gguf(hf_models["llama"], path, "F32")
    first = gguf_model_dir(path)
    ids = Tokenizer.from_dir(first).encode("Hello world")
    with open(os.path.join(first, "config.json")) as f:
        theta = json.load(f)["rope_theta"]
    for damage in ("tokenizer.json", "gguf_tensors.json", "model.gguf", "config.json", "edited"):
        target = os.path.join(first, "config.json" if damage == "edited" else damage)
        if damage == "tokenizer.json":
            with open(target, "r+b") as f:
                f.truncate(100)
        elif damage == "edited":  # NOTE: its size kept: it was trusted, and ran another rope than the file's
            with open(target) as f:
                text = f.read()
            with open(target, "w") as f:
                f.write(text.replace(f'"rope_theta": {theta}', f'"rope_theta": {str(theta).replace("1", "9", 1)}'))
            assert os.path.getsize(target) == len(text.encode()) and json.load(open(target))["rope_theta"] != theta
        else:
            os.remove(target)
        assert not folder_complete(first)
        os.makedirs(os.path.join(os.path.dirname(first), ".tmp-dead"))  # NOTE: a writer killed in its work
        assert gguf_model_dir(path) == first and folder_complete(first), damage
        assert Tokenizer.from_dir(first).encode("Hello world") == ids
        assert sorted(os.listdir(os.path.dirname(first))) == [".host", ".lock", os.path.basename(first)]
    gone = str(tmp_path / "gone.gguf")  # NOTE: its folder given after the file was deleted: it said "No *.safetensors"
    shutil.copyfile(path, gone)
    gone_dir = gguf_model_dir(gone)
    os.remove(gone)
    with pytest.raises(FileNotFoundError, match=rf"^{gone_dir} describes the GGUF file {gone}, which no longer "
                                                r"exists; pass the GGUF file itself\.$"):
        Engine(gone_dir, dtype="float32", kv_cache_memory=1 << 22)
    moved = str(tmp_path / "moved")  # NOTE: a folder moved away and linked back, then damaged: the link goes
    shutil.move(first, moved)
    os.symlink(moved, first)
    os.remove(os.path.join(moved, "tokenizer.json"))
    assert gguf_model_dir(path) == first and folder_complete(first) and not os.path.islink(first)
    other = str(tmp_path / "other.gguf")
    write_gguf(hf_models["llama"], other, "F32", extra=lambda w: w.add_string("tokenizer.chat_template", "OTHER"))
    stat = os.stat(path)
    shutil.copyfile(other, path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # NOTE: cp -p keeps the mtime
    again = gguf_model_dir(path)
    assert again != first and Tokenizer.from_dir(again).render_chat([{"role": "user", "content": "x"}]) == "OTHER"


def test_descriptions_of_files_gone_are_removed(hf_models, tmp_path, monkeypatch):
    """Every GGUF path made a cached description (3.5 MB with a Llama 3 tokenizer) that stayed for
    ever: the test suite alone left thousands. A new description removes this host's of files that
    are gone; those of files still there (an earlier one of a file replaced in place too: a server
    of several models loads from the one it chose at start), of another host's paths (a shared
    cache), and one being written, stay."""
    import fcntl
    import shutil
    from numa_runtime.gguf_model import gguf_model_dir
    monkeypatch.setenv("NUMA_RUNTIME_CACHE", str(tmp_path / "cache"))
    paths = {n: str(tmp_path / f"{n}.gguf") for n in ("kept", "gone", "changed", "busy", "elsewhere")}
    write_gguf(hf_models["llama"], paths["kept"], "F32")
    for n in ("gone", "changed", "busy", "elsewhere"):
        shutil.copyfile(paths["kept"], paths[n])
    dirs = {n: gguf_model_dir(p) for n, p in paths.items()}
    assert all(os.path.isdir(d) for d in dirs.values())
    for n in ("gone", "busy", "elsewhere"):
        os.remove(paths[n])
    with open(os.path.join(os.path.dirname(dirs["elsewhere"]), ".host"), "w") as f:
        f.write("another-host")  # NOTE: as if made on another host sharing the cache, where the path exists
    busy = open(os.path.join(os.path.dirname(dirs["busy"]), ".lock"), "w")
    fcntl.flock(busy, fcntl.LOCK_EX)  # NOTE: as a writer holds it
    write_gguf(hf_models["llama"], paths["changed"], "F32",
               extra=lambda w: w.add_string("tokenizer.chat_template", "OTHER"))
    again = gguf_model_dir(paths["changed"])
    assert again != dirs["changed"] and os.path.isdir(again)
    assert not os.path.exists(os.path.dirname(dirs["gone"]))
    for n in ("kept", "changed", "busy", "elsewhere"):
        assert os.path.isdir(dirs[n]), n
    busy.close()
    assert gguf_model_dir(paths["kept"]) == dirs["kept"]  # NOTE: found complete: nothing is described or swept
    assert os.path.isdir(dirs["busy"])
    shutil.copyfile(paths["kept"], paths["gone"])
    back = gguf_model_dir(paths["gone"])
    assert not os.path.exists(dirs["busy"])
    assert sorted(os.listdir(tmp_path / "cache" / "gguf")) == sorted(
        os.path.basename(os.path.dirname(d)) for d in (dirs["kept"], dirs["changed"], again, back, dirs["elsewhere"]))


def test_a_full_cache_is_said_to_be_full(hf_models, tmp_path, monkeypatch):
    """A full disk under the cache, in the OS's or the tokenizers library's words, named no cache."""
    from numa_runtime import gguf_model
    path = str(tmp_path / "m.gguf")
    write_gguf(hf_models["llama"], path, "F32")
    monkeypatch.setenv("NUMA_RUNTIME_CACHE", str(tmp_path / "cache"))
    for error in (OSError(28, "No space left on device"), Exception("No space left on device (os error 28)")):
        def full(files, out, error=error):
            raise error
        monkeypatch.setattr(gguf_model, "_describe", full)
        with pytest.raises(OSError, match=r"^the GGUF file's tokenizer and config are written to the cache directory "
                           r".*cache \(NUMA_RUNTIME_CACHE\), which is full; free space there"):
            gguf_model.gguf_model_dir(path)
        assert [n for n in os.listdir(next((tmp_path / "cache" / "gguf").iterdir())) if n != ".lock"] == []


def test_unknown_architecture_is_a_clear_error(hf_models, tmp_path):
    path = str(tmp_path / "m.gguf")
    write_gguf(hf_models["llama"], path, "F32", arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gpt2' is not supported"):
        engine(path)


@pytest.mark.parametrize("meta,match", [
    ({"llama.block_count": 1}, r"block_count is 1, but the file holds tensors of layer 1 \(blk\.1\.\*\)"),
    ({"llama.block_count": 3}, r"block_count is 3, but the file holds no tensors of layer 2 \(blk\.2\.\*\)"),
    ({"llama.attention.value_length": 32}, r"value heads of 32 dimensions beside key heads of 64 \(llama\.attention\.value_length\)"),
    ({"llama.feed_forward_length": 128}, r"blk\.0\.ffn_\w+\.weight has shape .* but the GGUF metadata implies")])
def test_gguf_metadata_that_disagrees_with_the_file_is_refused_in_its_words(hf_models, tmp_path, meta, match):
    """A block_count under the layers stored ran a shorter model without a word (llama.cpp
    refuses the file); a value_length was ignored; an EOS outside the vocabulary left no EOS
    stop; a size the tensors do not have named config.json and Hugging Face tensor names."""
    path = str(tmp_path / "m.gguf")
    extra = (lambda w: w.add_uint32("llama.attention.value_length", 32)) if "llama.attention.value_length" in meta \
        else None
    write_gguf(hf_models["llama"], path, "F32", meta=meta, extra=extra)
    with pytest.raises(UnsupportedModelError, match=match):
        engine(path)


def test_a_gguf_without_an_eos_id_ends_at_its_end_of_text_token(hf_models, tmp_path, caplog):
    """Older converters wrote no tokenizer.ggml.eos_token_id (llama.cpp then takes a default id),
    and an id outside the vocabulary is as good as none (llama.cpp: "bad special token"): the file
    was refused. Its end-of-text token by its text now serves, with a warning; a file with no such
    token is still refused in one sentence."""
    import gguf
    path = str(tmp_path / "m.gguf")
    write_gguf(hf_models["llama"], str(tmp_path / "far.gguf"), "F32", meta={"tokenizer.ggml.eos_token_id": 9999})
    engine(str(tmp_path / "far.gguf")).close()
    assert "eos_token_id is 9999, not one of the file's 384 tokens; it is taken as unset" in caplog.text
    write_gguf(hf_models["llama"], path, "F32", meta={"tokenizer.ggml.eos_token_id": None})
    e = engine(path)
    try:
        assert "names no EOS (tokenizer.ggml.eos_token_id); generation ends at '</s>' (token 2)" in caplog.text
        assert e.tokenizer.eos_token_id == 2
        out = e.generate([[1, 17, 42]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 4
    finally:
        e.close()
    tokens = ["<end>" if t == "</s>" else t for t in gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].contents()]
    bare = str(tmp_path / "bare.gguf")
    write_gguf(hf_models["llama"], bare, "F32", meta={"tokenizer.ggml.eos_token_id": None,
                                                      "tokenizer.ggml.tokens": tokens})
    with pytest.raises(UnsupportedModelError, match=r"lacks 'tokenizer\.ggml\.eos_token_id'"):
        engine(bare)


def test_a_bos_outside_the_vocabulary_is_ignored_with_a_warning(hf_models, tmp_path, caplog):
    """As llama.cpp: a special token id outside the vocabulary is taken as unset (the file has
    add_bos_token false, so nothing needs it); an end-of-turn id outside it is no stop token."""
    path = str(tmp_path / "m.gguf")
    write_gguf(hf_models["llama"], path, "F32", meta={"tokenizer.ggml.bos_token_id": 9999},
               extra=lambda w: (w.add_bool("tokenizer.ggml.add_bos_token", False),
                                w.add_uint32("tokenizer.ggml.eot_token_id", 7777)))
    e = engine(path)
    try:
        assert "bos_token_id is 9999, not one of the file's 384 tokens; it is ignored" in caplog.text
        with open(os.path.join(gguf_model_dir(path), "generation_config.json")) as f:
            stops = json.load(f)["eos_token_id"]
        assert 7777 not in stops and stops[0] == e.tokenizer.eos_token_id
        out = e.generate([[1, 17, 42]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 4
    finally:
        e.close()


def test_truncated_file_is_a_clear_error(hf_models, tmp_path):
    """A file cut anywhere in its tensor data says it is truncated and names the tensor that
    ends past it (the middle of the first tensor gave numpy's 'cannot reshape array')."""
    import gguf
    whole = str(tmp_path / "whole.gguf")
    write_gguf(hf_models["llama"], whole, "Q8_0")
    size, reader = os.path.getsize(whole), gguf.GGUFReader(whole)
    first = min(int(t.data_offset) for t in reader.tensors)
    for cut in (first + 7, first + (size - first) // 2, size - 1000, size - 1):
        path = str(tmp_path / f"m{cut}.gguf")
        with open(whole, "rb") as f, open(path, "wb") as g:
            g.write(f.read(cut))
        with pytest.raises(UnsupportedModelError, match=rf"m{cut}.gguf is truncated: tensor \S+ ends at byte \d+, "
                                                        rf"the file has {cut}; download it again"):
            engine(path)


def test_two_ranks_equal_reference(hf_models, tmp_path):
    """Each rank maps only its rows/columns of the Q4_0 blocks (column splits on 32-element
    block boundaries); tokens equal the dequantized model run in one process."""
    from test_quant_model import result, run_mpi
    path = str(tmp_path / "m.Q4_0.gguf")
    write_gguf(hf_models["llama"], path, "Q4_0")
    ref_dir = str(tmp_path / "ref")
    write_reference(hf_models["llama"], path, ref_dir)
    r = engine(ref_dir)
    expected = list(r.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].token_ids)
    r.close()
    out = result(run_mpi(2, path, "none"))
    assert out["world"] == 2 and out["tokens"] == [expected]


def test_a_head_split_inside_a_block_names_the_column_and_replicas(tmp_path):
    """2 heads of 80 over 2 ranks cut o_proj's Q4_0 input at column 80, inside a 32-element
    block: one sentence that names the tensor, the column and the way out (model replicas,
    as the MLP's refusal says), not a rank count, which cannot help here."""
    from test_quant_model import run_mpi
    hf_dir = str(tmp_path / "hf")
    build_model(hf_dir, arch="llama", hidden_size=160, num_attention_heads=2, num_key_value_heads=1, head_dim=80,
                intermediate_size=352, vocab_size=384, max_position_embeddings=256)
    path = str(tmp_path / "m.Q4_0.gguf")
    write_gguf(hf_dir, path, "Q4_0")
    p = run_mpi(2, path, "none")
    assert p.returncode != 0
    assert ("model.layers.0.self_attn.o_proj.weight (Q4_0) would be split at input column 80, inside a 32-element "
            "block; use a rank count whose split falls on block boundaries, or model replicas (data_parallel, "
            "--data-parallel or numa-launch --dp).") in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]


def test_llama_attention_biases_equal_transformers(tmp_path):
    """A Llama with attention_bias (q/k/v/o biases) as llama.cpp's converter writes it: the q/k
    biases permuted like their weights, o's as attn_output.bias. F32 on 1 and 2 ranks gives the
    greedy tokens of transformers."""
    from models import hf_greedy
    from test_quant_model import result, run_mpi
    hf_dir = str(tmp_path / "hf")
    model = build_model(hf_dir, arch="llama", attention_bias=True, **SHAPE)
    expected = hf_greedy(model, PROMPT, 16)
    path = str(tmp_path / "m.F32.gguf")
    write_gguf(hf_dir, path, "F32")
    g = engine(path, lm_head_quantization=None)
    try:
        assert g.runner.model.cfg.o_bias and g.runner.model.cfg.qkv_bias
        assert list(g.generate([PROMPT], GREEDY)[0].token_ids) == expected
    finally:
        g.close()
    out = result(run_mpi(2, path, "none", head="none"))
    assert out["world"] == 2 and out["tokens"][0][:16] == expected


@pytest.mark.parametrize("qtype,dtype", [("Q4_K", "int4"), ("Q6_K", "int6"), ("Q3_K", "int3"), ("Q2_K", "int2"),
                                         ("IQ4_XS", "int4")])
def test_two_ranks_equal_one_on_k_quants(hf_models, tmp_path, qtype, dtype):
    """A Q4_K, Q6_K, Q3_K, Q2_K or IQ4_XS file over 2 ranks: each rank decodes only its super-blocks and takes the
    32- or 16-element groups of its columns: down_proj's split falls on a super-block boundary
    (super-block scales, exact), o_proj's inside one (f16 group scales, within 2^-11): the
    tokens of one rank, where every tensor is exact."""
    from test_quant_model import result, run_mpi
    path = str(tmp_path / f"m.{qtype}.gguf")
    write_gguf(hf_models["llama"], path, qtype)
    one = engine(path)
    try:
        assert one.runner.model.layers[0].o_proj.dtype == dtype
        expected = list(one.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].token_ids)
    finally:
        one.close()
    out = result(run_mpi(2, path, "none"))
    assert out["world"] == 2 and out["tokens"] == [expected]


def test_a_dense_down_proj_splits_the_mlp_anywhere_beside_quantized_tensors(tmp_path):
    """llama-quantize leaves ffn_down dense where the MLP width is no multiple of 32 (70 here):
    only down_proj's blocks run along the MLP columns that the ranks split, so the Q8_0 gate/up
    rows split anywhere; the file was held to groups of 32 and refused 4 ranks. 4 ranks give 1
    rank's tokens."""
    from test_quant_model import result, run_mpi
    from numa_runtime.gguf_model import open_checkpoint
    from numa_runtime.quant.loader import LinearFactory
    hf = str(tmp_path / "hf")
    build_model(hf, arch="llama", hidden_size=128, intermediate_size=70, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=384, tie_word_embeddings=True)
    path = str(tmp_path / "m.Q8_0.gguf")
    write_gguf(hf, path, "Q8_0", types={"down_proj": "F16"})
    one = engine(path)
    try:
        ckpt = open_checkpoint(one.runner.model.cfg)
        assert ckpt.split_align == 1 and ckpt.quantized("model.layers.0.mlp.up_proj.weight", None, None) is not None
        assert LinearFactory(None, ckpt, "float32").split_align(70, 4) == 1
        expected = list(one.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
                        .token_ids)
    finally:
        one.close()
    out = result(run_mpi(4, path, "none"))
    assert out["world"] == 4 and out["tokens"] == [expected]


def test_k_quant_mlp_splits_on_super_blocks(tmp_path):
    """A K-quant down_proj of 768 columns (3 super-blocks) over 2 ranks: 512 + 256 columns, on the
    super-blocks' boundary, where 32-column groups gave 384 + 384 and both ranks f16 group scales
    (within 2^-11 of the file's); with head_dim 128 o_proj's halves fall on a boundary too, so
    each rank holds the file's own numbers and 2 ranks give 1 rank's tokens. Fewer super-blocks
    than ranks (4 here) fall back to 32-column groups."""
    from test_quant_model import result, run_mpi
    from numa_runtime.gguf_model import open_checkpoint
    from numa_runtime.quant.loader import LinearFactory
    hf = str(tmp_path / "hf")
    build_model(hf, arch="llama", hidden_size=512, intermediate_size=768, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=384, tie_word_embeddings=False)
    path = str(tmp_path / "m.Q4_K.gguf")
    write_gguf(hf, path, "Q4_K")
    one = engine(path)
    try:
        linear = LinearFactory(None, open_checkpoint(one.runner.model.cfg), "float32")
        assert [linear.split_align(768, w) for w in (1, 2, 3, 4)] == [256, 256, 256, 32]
        assert one.runner.model.layers[0].down_proj.ks == 256
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        expected = list(one.generate([PROMPT], greedy)[0].token_ids)
    finally:
        one.close()
    out = result(run_mpi(2, path, "none"))
    assert out["world"] == 2 and out["tokens"] == [expected]
    assert out["mlp_columns"] == [0, 512] and out["down_ks"] == 256


def test_k_quant_columns_off_a_super_block_take_f16_group_scales(hf_models, tmp_path):
    """What a rank reads of a Q4_K tensor: whole super-blocks keep their super-block scales
    (exact); columns that start inside a super-block (o_proj's half on 2 ranks here) take f16
    group scales, within 2^-11 of each scale and min of the exact weights."""
    from numa_runtime.gguf_model import open_checkpoint
    from numa_runtime.quant.formats import dequantize
    path = str(tmp_path / "m.Q4_K.gguf")
    write_gguf(hf_models["llama"], path, "Q4_K")
    g = engine(path)
    try:
        ckpt = open_checkpoint(g.runner.model.cfg)
        name = "model.layers.0.self_attn.o_proj.weight"
        whole = ckpt.quantized(name, None, None)
        part = ckpt.quantized(name, None, slice(128, 256))
        aligned = ckpt.quantized(name, slice(0, 64), slice(0, 256))
    finally:
        g.close()
    assert whole.fmt.ks == 256 and aligned.fmt.ks == 256 and part.fmt.ks == 0
    exact = dequantize(whole)
    np.testing.assert_array_equal(dequantize(aligned), exact[:64])
    s = np.abs(part.scales.astype(np.float32)).repeat(32, 1)
    bound = 2.0 ** -11 * (s * part.q + np.abs(part.offsets.astype(np.float32)).repeat(32, 1))
    assert (np.abs(dequantize(part) - exact[:, 128:256]) <= bound * 1.001 + 1e-9).all()


@pytest.mark.parametrize("tied", [False, True])
def test_a_named_lm_head_format_for_a_quantized_head_is_refused(tmp_path, tied):
    """lm_head_quantization='int8-channel' on a file whose lm_head (or tied embedding) is stored
    quantized was accepted and did nothing; 'auto' keeps the file's head."""
    hf = str(tmp_path / "hf")
    build_model(hf, arch="llama", tie_word_embeddings=tied)
    path = str(tmp_path / "m.gguf")
    write_gguf(hf, path, "Q4_0")
    with pytest.raises(ValueError, match="stores its lm_head quantized already"):
        Engine(path, dtype="float32", kv_cache_memory=1 << 22, lm_head_quantization="int8-channel")
    Engine(path, dtype="float32", kv_cache_memory=1 << 22).close()


def test_an_embedding_gguf_pools_as_its_pooling_type_says(hf_models, tmp_path):
    """llama.cpp's converter writes `{arch}.pooling_type` for an embedding checkpoint (Qwen3-Embedding's
    GGUFs say 3, the last token): such a file is an embedding model pooled so (it ran as a causal LM);
    a reranker's type (4) is refused by name."""
    path, ref_dir = str(tmp_path / "emb.gguf"), str(tmp_path / "ref")
    write_gguf(hf_models["qwen3"], path, "Q8_0", arch="qwen3", extra=lambda w: w.add_uint32("qwen3.pooling_type", 3))
    write_reference(hf_models["qwen3"], path, ref_dir)
    g, r = engine(path), engine(ref_dir)
    try:
        assert g.model_config.is_embedding_model and g.model_config.pooling == "last"
        np.testing.assert_allclose(g.embed([PROMPT, PROMPT[:5]]), r.embed([PROMPT, PROMPT[:5]], pooling="last"),
                                   atol=1e-5)
        with pytest.raises(ValueError, match="does not generate text"):
            g.generate([PROMPT], GREEDY)
    finally:
        g.close()
        r.close()
    bad = str(tmp_path / "rank.gguf")
    write_gguf(hf_models["qwen3"], bad, "Q8_0", arch="qwen3", extra=lambda w: w.add_uint32("qwen3.pooling_type", 4))
    with pytest.raises(UnsupportedModelError, match="GGUF pooling type 4 .a reranker's. is not supported"):
        engine(bad)


PHI3_LONGROPE = dict(max_position_embeddings=4096, original_max_position_embeddings=64, rope_scaling={
    "rope_type": "longrope", "short_factor": [1.0 + 0.25 * i for i in range(24)],
    "long_factor": [2.0 + i for i in range(24)]})


@pytest.mark.parametrize("qtype,longrope", [("Q8_0", False), ("Q4_K", True)])
def test_a_phi3_gguf_equals_its_dequantized_reference(tmp_path, qtype, longrope):
    """llama.cpp's phi3 layout: attn_qkv and ffn_up (gate and up) fused, split at load; a partial
    rotary dimension count; LongRoPE as its converter writes it (rope_factors_short/long tensors,
    the original context, the attention factor it computes) runs as transformers' longrope."""
    import math
    hf_dir, path, ref_dir = str(tmp_path / "hf"), str(tmp_path / "m.gguf"), str(tmp_path / "ref")
    build_model(hf_dir, arch="phi3", partial_rotary_factor=0.75, **SHAPE, **(PHI3_LONGROPE if longrope else {}))

    def factors(w):
        s = PHI3_LONGROPE["max_position_embeddings"] / PHI3_LONGROPE["original_max_position_embeddings"]
        w.add_uint32("phi3.rope.scaling.original_context_length", PHI3_LONGROPE["original_max_position_embeddings"])
        w.add_float32("phi3.rope.scaling.attn_factor", math.sqrt(1 + math.log(s) / math.log(64)))
        for kind in ("short", "long"):
            w.add_tensor(f"rope_factors_{kind}.weight", np.array(PHI3_LONGROPE["rope_scaling"][kind + "_factor"],
                                                                 np.float32))
    write_gguf(hf_dir, path, qtype, arch="phi3", extra=factors if longrope else None)
    write_reference(hf_dir, path, ref_dir)
    kw = dict(dtype="float32", kv_cache_memory=1 << 23, max_model_len=64)
    g, r = Engine(path, **kw), Engine(ref_dir, **kw)
    try:
        assert g.model_config.rope.rope_type == ("longrope" if longrope else "default")
        assert g.model_config.rope.partial_rotary_factor == 0.75
        lg, lr = prefill_logits(g, PROMPT), prefill_logits(r, PROMPT)
        assert np.abs(lg - lr).max() <= 1e-4 * np.abs(lr).max()
        assert g.generate([PROMPT], GREEDY)[0].token_ids == r.generate([PROMPT], GREEDY)[0].token_ids
        assert g.runner.model.layers[0].qkv_proj.dtype == ("int8" if qtype == "Q8_0" else "int4")
    finally:
        g.close()
        r.close()


def test_quantization_gguf_runs_the_file_as_stored(hf_models, tmp_path):
    """quantization='gguf' (vLLM's name) runs a GGUF as stored; 'int4' on a GGUF and 'gguf' on
    a dense directory are each one sentence."""
    path = str(tmp_path / "m.gguf")
    write_gguf(hf_models["llama"], path, "Q4_0")
    a, b = engine(path), engine(path, quantization="gguf")
    try:
        assert b.runner.model.layers[0].qkv_proj.dtype == "int4"
        assert a.generate([PROMPT], GREEDY)[0].token_ids == b.generate([PROMPT], GREEDY)[0].token_ids
    finally:
        a.close()
        b.close()
    with pytest.raises(ValueError, match="holds quantized weights already"):
        engine(path, quantization="int4")
    with pytest.raises(ValueError, match="names the format of a GGUF checkpoint, but .* is a dense checkpoint"):
        engine(hf_models["llama"], quantization="gguf")


def test_a_dense_gguf_quantized_at_load_and_tables_read_in_chunks(hf_models, tmp_path, monkeypatch):
    """An F16 GGUF quantized at load takes the int8 lm_head that 'auto' gives any dense checkpoint
    (it kept a bf16 head: a GGUF read as one that brings its own quantization); and an embedding
    table or dense head stored otherwise than the engine computes is converted ROW_CHUNK rows at a
    time into one array (the whole block of rows at once took about 8x its size in temporaries)."""
    import numa_runtime.weights as W
    from numa_runtime.gguf_checkpoint import GGUFCheckpoint
    f16, q4 = str(tmp_path / "m.F16.gguf"), str(tmp_path / "m.Q4_0.gguf")
    write_gguf(hf_models["llama"], f16, "F16")
    write_gguf(hf_models["llama"], q4, "Q4_0")
    e = Engine(f16, dtype="bfloat16", quantization="int4", kv_cache_memory=1 << 22, max_model_len=128)
    try:
        assert e.runner.model.layers[0].qkv_proj.dtype == "int4" and e.runner.model.lm_head.dtype == "int8"
    finally:
        e.close()
    want = {}
    for path in (f16, q4):
        e = engine(path)
        try:
            want[path] = (e.generate([PROMPT], GREEDY)[0].token_ids, e.runner.model.embed_tokens(np.arange(384)))
        finally:
            e.close()
    calls, load = [], GGUFCheckpoint.load

    def spy(self, name, dtype, rows=None, cols=None):
        calls.append((name, rows))
        return load(self, name, dtype, rows, cols)
    monkeypatch.setattr(GGUFCheckpoint, "load", spy)
    monkeypatch.setattr(W, "ROW_CHUNK", 100)
    for path, table in ((f16, "model.embed_tokens.weight"), (f16, "lm_head.weight")):
        calls.clear()
        e = engine(path)
        try:
            assert e.generate([PROMPT], GREEDY)[0].token_ids == want[path][0]
            assert np.array_equal(e.runner.model.embed_tokens(np.arange(384)), want[path][1])
        finally:
            e.close()
        sizes = [r.stop - r.start for name, r in calls if name == table]
        assert sizes == [100, 100, 100, 84], (path, table, calls)  # NOTE: the vocabulary of 384 rows


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_a_quantized_embedding_table_stays_in_the_file(hf_models, tmp_path, qtype):
    """A GGUF's quantized token_embd is not copied out dense: a lookup dequantizes the rows it
    reads (f32, as llama.cpp's get_rows), the same rows the gguf package's dequantization gives,
    on 1 rank and on 2 (vocabulary halves; a 2-rank run's tokens are 1 rank's)."""
    import gguf
    from test_quant_model import result, run_mpi
    from numa_runtime.models.llama import StoredRows
    path = str(tmp_path / f"m.{qtype}.gguf")
    write_gguf(hf_models["llama"], path, qtype)
    table = [t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight"][0]
    ref = gguf.quants.dequantize(np.asarray(table.data), table.tensor_type).reshape(384, 256)
    e = engine(path)
    try:
        model = e.runner.model
        assert isinstance(model.embed, StoredRows)
        ids = np.array([5, 383, 0, 5, 17, 200], np.int64)
        np.testing.assert_array_equal(model.embed_tokens(ids), ref[ids])
        with pytest.raises(IndexError, match="token id 384 is outside the vocabulary of 384"):
            model.embed_tokens(np.array([1, 384], np.int64))
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)  # NOTE: as quant_generate's
        expected = list(e.generate([PROMPT], greedy)[0].token_ids)
    finally:
        e.close()
    assert result(run_mpi(2, path, "none"))["tokens"] == [expected]


MOE_CASES = {
    # Qwen3-MoE (qk norms, renormalized top-k) with a dense layer narrower than its experts;
    # Qwen2-MoE's shared expert and q/k/v biases; Mixtral, a llama GGUF with experts (q/k rows permuted)
    "qwen3moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=1024,
                                   norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1])),
    "qwen2moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=512,
                                   shared_expert_intermediate_size=256, num_hidden_layers=2)),
    "llama": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2)),
}


@pytest.mark.parametrize("arch,qtype", [("qwen3moe", "Q4_K"), ("qwen2moe", "Q8_0"), ("llama", "Q4_0")])
def test_a_moe_gguf_equals_its_dequantized_reference(tmp_path, arch, qtype):
    """llama.cpp's stacked experts (blk.N.ffn_*_exps [E, N, K]) read one expert at a time as
    stored, the router f32: the logits and tokens of the model dequantized by the gguf package,
    and on 2 ranks (every expert's columns split, on super-block boundaries for Q4_K) the
    tokens of one."""
    from test_quant_model import result, run_mpi
    hf_arch, kw = MOE_CASES[arch]
    hf_dir, path, ref_dir = str(tmp_path / "hf"), str(tmp_path / f"m.{qtype}.gguf"), str(tmp_path / "ref")
    build_model(hf_dir, arch=hf_arch, **{**SHAPE, **kw})
    write_gguf(hf_dir, path, qtype, arch=arch)
    write_reference(hf_dir, path, ref_dir)
    g, r = engine(path, lm_head_quantization=None), engine(ref_dir)
    try:
        cfg = g.runner.model.cfg
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (4, 2, arch != "qwen2moe")
        assert cfg.moe_layers == (True, False, True) if arch == "qwen3moe" else (True, True)
        assert cfg.shared_expert_intermediate_size == (256 if arch == "qwen2moe" else 0)
        gate_up, down = g.runner.model.layers[0].moe.experts[3]
        assert down.dtype == {"Q4_K": "int4", "Q8_0": "int8", "Q4_0": "int4"}[qtype]
        lg, lr = prefill_logits(g, PROMPT), prefill_logits(r, PROMPT)
        assert np.abs(lg - lr).max() <= 1e-4 * np.abs(lr).max()
        expected = list(r.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24,
                                                            ignore_eos=True))[0].token_ids)
        assert list(g.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24,
                                                        ignore_eos=True))[0].token_ids) == expected
    finally:
        g.close()
        r.close()
    out = result(run_mpi(2, path, "none", head="none"))
    assert out["world"] == 2 and out["tokens"] == [expected]


def test_an_older_moe_gguf_without_its_size_keys_and_a_bad_expert_count(tmp_path):
    """A qwen2moe file without expert_feed_forward_length / expert_shared_feed_forward_length
    (converted before llama.cpp wrote them) takes the sizes from its stacked tensors; an
    expert_used_count of 0 is one sentence naming the key."""
    hf_arch, kw = MOE_CASES["qwen2moe"]
    hf_dir, path, ref_dir = str(tmp_path / "hf"), str(tmp_path / "m.Q8_0.gguf"), str(tmp_path / "ref")
    build_model(hf_dir, arch=hf_arch, **{**SHAPE, **kw})
    write_gguf(hf_dir, path, "Q8_0", arch="qwen2moe", expert_sizes=False)
    write_reference(hf_dir, path, ref_dir)
    g, r = engine(path, lm_head_quantization=None), engine(ref_dir)
    try:
        cfg = g.runner.model.cfg
        assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (512, 256)
        assert g.generate([PROMPT], GREEDY)[0].token_ids == r.generate([PROMPT], GREEDY)[0].token_ids
    finally:
        g.close()
        r.close()
    import json
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_experts_per_tok"] = 0
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    bad = str(tmp_path / "bad.gguf")
    write_gguf(hf_dir, bad, "Q8_0", arch="qwen2moe")
    with pytest.raises(UnsupportedModelError, match=r"bad.gguf: qwen2moe.expert_used_count is 0, where 1 to "
                                                    r"qwen2moe.expert_count \(4\) experts a token are needed"):
        engine(bad)


def test_a_moe_gguf_whose_tensors_disagree_with_its_metadata_is_refused_naming_them(tmp_path):
    """Stacks of more or fewer experts than {arch}.expert_count, a layer with experts but no router
    or without one of its stacks, and a shared expert of another width than the metadata's: one
    sentence each, naming the tensor and the metadata key (never config.json, which a GGUF user
    never wrote)."""
    import gguf

    from numa_runtime.gguf_model import hf_config
    hf_arch, kw = MOE_CASES["qwen3moe"]
    hf_dir, path = str(tmp_path / "hf"), str(tmp_path / "m.gguf")
    build_model(hf_dir, arch=hf_arch, **{**SHAPE, **kw})
    write_gguf(hf_dir, path, "Q8_0", arch="qwen3moe")
    reader = gguf.GGUFReader(path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    assert hf_config(meta, set(shapes), "m.gguf", shapes=shapes)["num_experts"] == 4

    def refused(names, shapes):
        with pytest.raises(UnsupportedModelError) as e:
            hf_config(meta, set(names), "m.gguf", shapes=shapes)
        return str(e.value)

    five = {**shapes, "blk.2.ffn_up_exps.weight": shapes["blk.2.ffn_up_exps.weight"][:2] + [5]}
    assert refused(five, five) == ("m.gguf: blk.2.ffn_up_exps.weight has shape [256, 1024, 5], not the 4 stacked "
                                   "experts of qwen3moe.expert_count.")
    for gone in ("blk.2.ffn_gate_inp.weight", "blk.2.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight"):
        layer = gone.split(".")[1]
        assert refused(set(shapes) - {gone}, shapes) == f"m.gguf: layer {layer} has experts but lacks {gone}."
    # the shared expert's width: a qwen2moe file whose metadata says 512 where its tensors hold 256
    hf_arch, kw = MOE_CASES["qwen2moe"]
    q2_dir, q2 = str(tmp_path / "q2"), str(tmp_path / "q2.gguf")
    build_model(q2_dir, arch=hf_arch, **{**SHAPE, **kw})
    import json
    with open(os.path.join(q2_dir, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(q2_dir, "config.json"), "w") as f:
        json.dump({**cfg, "shared_expert_intermediate_size": 512}, f)
    write_gguf(q2_dir, q2, "Q8_0", arch="qwen2moe")
    with pytest.raises(UnsupportedModelError, match=r"blk.0.ffn_gate_shexp.weight has shape \(256, 256\), but the "
                                                    r"GGUF metadata implies \(512, 256\) \(qwen2moe.embedding_length "
                                                    r"256, qwen2moe.expert_shared_feed_forward_length 512, "
                                                    r"qwen2moe.expert_count 4\)"):
        engine(q2)


def test_gguf_files_of_other_kinds_are_refused_by_what_they_are(hf_models, tmp_path, monkeypatch):
    """A big-endian file (convert_hf_to_gguf --bigendian) loaded silently as garbage; a retired
    tensor type (Q4_0_4_4) was called a truncated or corrupt file; per-layer metadata arrays
    (llama.cpp's head_count_kv / feed_forward_length) were a bare TypeError: one of a single
    value is that value now; a gpt2 tokenizer without merges, and a cache directory that
    cannot be written, are one sentence each."""
    import struct

    import gguf
    from numa_runtime.gguf_model import hf_config
    from numa_runtime.gguf_tokenizer import write_tokenizer
    big = str(tmp_path / "big.gguf")
    w = gguf.GGUFWriter(big, "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match=r"is a big-endian GGUF file, whose tensors numa_runtime does "
                                                    r"not read; convert the model again without --bigendian\.$"):
        engine(big)
    src = str(tmp_path / "q4_0.gguf")
    write_gguf(hf_models["llama"], src, "Q4_0")
    b = bytearray(open(src, "rb").read())
    name = b"blk.0.attn_q.weight"
    at = b.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    at += 4 + 8 * struct.unpack_from("<I", b, at)[0]
    assert struct.unpack_from("<I", b, at)[0] == 2  # Q4_0
    struct.pack_into("<I", b, at, 31)  # Q4_0_4_4, llama.cpp's former ARM repack
    retired = str(tmp_path / "q4_0_4_4.gguf")
    open(retired, "wb").write(b)
    with pytest.raises(UnsupportedModelError, match=r"holds tensors of GGML type 31 \(Q4_0_4_4\), a type llama.cpp "
                                                    r"no longer writes and numa_runtime does not read; quantize"):
        engine(retired)
    # NOTE: a type newer than the gguf package (llama.cpp's Q2_0, 42) was called retired, its number said twice
    struct.pack_into("<I", b, at, 42)
    newer = str(tmp_path / "q2_0.gguf")
    open(newer, "wb").write(b)
    with pytest.raises(UnsupportedModelError, match=r"holds tensors of GGML type 42, newer than the installed gguf "
                                                    r"package \(gguf [0-9.]+\) knows and not one numa_runtime reads"):
        engine(newer)
    struct.pack_into("<I", b, at, 36)  # NOTE: IQ4_NL_4_4, retired with the Q4_0 repacks: not "newer"
    open(newer, "wb").write(b)
    with pytest.raises(UnsupportedModelError, match=r"type 36 \(IQ4_NL_4_4\), a type llama.cpp no longer writes"):
        engine(newer)
    reader = gguf.GGUFReader(src)
    meta = {k: f.contents() for k, f in reader.fields.items()}
    names = {t.name for t in reader.tensors}
    plain = hf_config(meta, names, "m.gguf")
    layers = plain["num_hidden_layers"]
    for key, field in (("llama.attention.head_count_kv", "num_key_value_heads"),
                       ("llama.feed_forward_length", "intermediate_size")):
        same = hf_config({**meta, key: [plain[field]] * layers}, names, "m.gguf")
        assert same == plain
        with pytest.raises(UnsupportedModelError, match=rf"^m.gguf: the GGUF metadata's {key} differs between layers"):
            hf_config({**meta, key: [plain[field]] * (layers - 1) + [plain[field] * 2]}, names, "m.gguf")
    with pytest.raises(UnsupportedModelError, match=r"a byte-level BPE \('gpt2'\) GGUF tokenizer without "
                                                    r"tokenizer.ggml.merges"):
        write_tokenizer({**meta, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": []}, str(tmp_path), "llama.")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("NUMA_RUNTIME_CACHE", str(blocker / "cache"))
    with pytest.raises(OSError, match=r"written to the cache directory .*a-file/cache \(NUMA_RUNTIME_CACHE\), which "
                                      r"cannot be written \(Not a directory\); point NUMA_RUNTIME_CACHE at a writable"):
        engine(src)


def test_a_split_gguf_on_the_hub_comes_with_its_other_files(hf_models, tmp_path, monkeypatch):
    """ORG/NAME/FILE-00001-of-00003.gguf: every file of the split model is fetched (the named one
    alone came, and the load missed the others)."""
    import shutil

    import huggingface_hub
    from numa_runtime import hub
    remote = tmp_path / "remote"
    remote.mkdir()
    write_gguf(hf_models["llama"], str(remote / "m.gguf"), "F32", split_max_tensors=6)
    parts = sorted(os.listdir(remote))
    assert len(parts) >= 3 and parts[0].endswith("-00001-of-%05d.gguf" % len(parts)), parts
    fetched = []

    def download(repo, filename, **kw):  # NOTE: the Hub's cache: one snapshot folder per revision
        fetched.append(filename)
        dst = tmp_path / "snapshot" / filename
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(remote / filename, dst)
        return str(dst)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    path = hub.local_path(f"org/m-GGUF/{parts[1]}")
    assert sorted(fetched) == parts and os.path.basename(path) == parts[1]
    want = engine(str(remote / parts[0])).generate("Hello", SamplingParams(temperature=0, max_tokens=5,
                                                                          ignore_eos=True))[0].token_ids
    got = engine(path).generate("Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].token_ids
    assert got == want
