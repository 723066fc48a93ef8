"""GGUF models split into several files (llama.cpp's gguf-split: NAME-00001-of-0000N.gguf ...),
as large models are published: any of the files gives the model, which equals the same model
written as one file; a missing or misnamed file is a clear error."""
import os
import shutil

import numpy as np
import pytest

from gguf_helpers import write_gguf
from models import build_model
from quant_helpers import prefill_logits

from numa_runtime import Engine, SamplingParams
from numa_runtime.config import UnsupportedModelError

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=384, tie_word_embeddings=False)
PROMPT = [1, 17, 42, 99, 5, 200, 13, 7, 300, 64, 3, 250, 11]


def engine(model):
    return Engine(model, dtype="float32", kv_cache_memory=1 << 22, max_model_len=128)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("split")
    hf = str(d / "hf")
    build_model(hf, arch="llama", **SHAPE)
    one = str(d / "one" / "m.gguf")
    os.makedirs(os.path.dirname(one))
    write_gguf(hf, one, "Q4_0")
    os.makedirs(d / "parts")
    write_gguf(hf, str(d / "parts" / "m.gguf"), "Q4_0", split_max_tensors=5)
    parts = sorted(os.listdir(d / "parts"))
    return one, [str(d / "parts" / p) for p in parts]


def test_split_model_equals_one_file(files):
    one, parts = files
    assert len(parts) > 2 and all(p.endswith(f"-of-{len(parts):05d}.gguf") for p in parts)
    a, b = engine(one), engine(parts[1])  # NOTE: any part names the model
    try:
        np.testing.assert_array_equal(prefill_logits(a, PROMPT), prefill_logits(b, PROMPT))
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        assert a.generate([PROMPT], greedy)[0].token_ids == b.generate([PROMPT], greedy)[0].token_ids
        assert os.path.basename(b.model_config.model_dir) == "m"  # the model's name, not a part's
    finally:
        a.close()
        b.close()


def test_missing_part_is_named(files, tmp_path):
    _, parts = files
    for p in parts:
        if p != parts[-1]:
            shutil.copy(p, tmp_path)
    with pytest.raises(FileNotFoundError, match=f"split into {len(parts)} files, and "
                                                f"{os.path.basename(parts[-1])} is missing"):
        engine(str(tmp_path / os.path.basename(parts[0])))


def test_renamed_part_is_a_clear_error(files, tmp_path):
    _, parts = files
    renamed = str(tmp_path / "model.gguf")
    shutil.copy(parts[0], renamed)
    with pytest.raises(UnsupportedModelError, match=f"split into {len(parts)} files, but its name does not say so"):
        engine(renamed)
