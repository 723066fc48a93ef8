"""Random-weight Hugging Face models built from a config, for golden tests (tests only)."""
from __future__ import annotations

import json
import os

CORPUS = ("The quick brown fox jumps over the lazy dog. Numa runtime splits a model over sockets. "
          "Hello world! Bonjour le monde, ça va? 1234567890 tokens and more tokens; café, naïve, 日本語. ") * 20

ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}

BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)


def train_tokenizer(out_dir: str, vocab_size: int = 384) -> None:
    """A byte-level BPE tokenizer trained here (no download), saved HF-style."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    path = os.path.join(out_dir, "tokenizer.json")
    tok.save(path)
    _fill_vocab(path, vocab_size)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": False,
                   "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                    "{% if add_generation_prompt %}<s>assistant:{% endif %}"}, f)


def _fill_vocab(path: str, vocab_size: int) -> None:
    """Give every id up to vocab_size a token, so anything a random model generates decodes to
    text (the trainer stops at the merges a small corpus supports). The extra tokens are
    letters only: never produced by encoding (no merges lead to them), but decodable."""
    with open(path) as f:
        tj = json.load(f)
    vocab = tj["model"]["vocab"]
    used = set(vocab) | {t["content"] for t in tj.get("added_tokens", [])}
    ids = set(vocab.values()) | {t["id"] for t in tj.get("added_tokens", [])}
    letters = "abcdefghijklmnopqrstuvwxyz"
    n = 0
    for i in range(vocab_size):
        if i in ids:
            continue
        while True:
            k, name = n, ""
            n += 1
            while True:
                name = letters[k % 26] + name
                k //= 26
                if not k:
                    break
            name = "Ġ" + name  # a leading space, in byte-level form
            if name not in used:
                break
        vocab[name] = i
        used.add(name)
    with open(path, "w") as f:
        json.dump(tj, f, ensure_ascii=False)


def build_model(out_dir: str, arch: str = "llama", dtype: str = "float32", seed: int = 0, **overrides):
    """Save a random model of `arch` with non-trivial norms and biases; return the HF model (f32)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    kw = {**BASE, **({"pad_token_id": 0} if arch == "phi3" else {}), **overrides}  # NOTE: Phi3Config's is 32000
    model_type = arch if arch != "mistral" else "mistral"
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg.architectures = [ARCHS[arch]]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.eval()
    save = model.to(getattr(torch, dtype))
    save.save_pretrained(out_dir, safe_serialization=True)
    train_tokenizer(out_dir, kw["vocab_size"])
    ref = model.to(torch.float32)
    # NOTE: the reference must see exactly the (possibly rounded) weights we load.
    if dtype != "float32":
        ref = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    return ref.eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    import torch
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
