"""GGUF files as models: `Engine("x.gguf")`, `serve --model x.gguf`.

`gguf_model_dir(path)` writes, once per file, a small Hugging Face style directory in the cache
(config.json from the GGUF metadata, tokenizer.json + tokenizer_config.json with the chat
template, and `model.gguf`, a symlink to the file): no weights are copied. The weights are read
from the GGUF itself by gguf_checkpoint.GGUFCheckpoint, per rank, quantized blocks as they are.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile

import numpy as np

from . import env
from .config import UnsupportedModelError
from .gguf_checkpoint import LONGROPE_FACTORS, ROPE_FREQS

log = logging.getLogger("numa_runtime")

GGUF_LINK = "model.gguf"
INDEX = "gguf_tensors.json"
# NOTE: part of the cache key: a change to what _describe writes makes files describe again
DESCRIBE_VERSION = 14  # NOTE: 14 (13 held aliases of a string at two ids for a while): the vocabulary as llama.cpp takes it (empty tokens named, end-of-turn texts control, a string twice refused), byte-level added tokens decode as their text; 12: DeepSeek's user-defined byte-alphabet tokens decode as their text; 11: Phi-3 user-defined tokens (</s>) take the whitespace after them; 10: a phi3 file's rope scaling keys and lone factor tensors; 9: llama.cpp's "default" BPE split, block_count and special ids checked; 8: mixture of experts; 7: named chat templates, Phi-3 control tokens rstrip; 6: phi3
ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
         "qwen3moe": "Qwen3MoeForCausalLM"}
# NOTE: llama.cpp rotates these as transformers does (NEOX: halves within the first rot_dim
# dimensions), so a partial rotary dimension count is transformers' partial_rotary_factor
_NEOX_ARCHS = ("qwen2", "qwen3", "phi3", "qwen2moe", "qwen3moe")


def is_gguf_dir(model_dir: str) -> bool:
    """One of our GGUF cache folders (its link and tensor index), not a model folder that happens
    to hold a file named model.gguf (that crashed on the missing index)."""
    # NOTE: lexists: a link whose GGUF was deleted is still ours (open_checkpoint says the file is gone)
    return os.path.lexists(os.path.join(model_dir, GGUF_LINK)) and os.path.exists(os.path.join(model_dir, INDEX))


def model_dir_of(path: str) -> str:
    """A model directory as given, or for a .gguf file the directory describing it (gguf_model_dir);
    a Hugging Face Hub id (ORG/NAME, or ORG/NAME/FILE.gguf) is fetched first (hub.local_path)."""
    from .hub import local_path
    path = local_path(str(path))
    return gguf_model_dir(path) if str(path).lower().endswith(".gguf") else path


def gguf_model_dir(path: str, name: str | None = None) -> str:
    """The cache directory describing the GGUF at `path` (made on first use; one writer at a
    time, renamed into place when complete). Its base name, which the server reports as the
    model name, is `name` or the file's stem. A model split by llama.cpp's gguf-split
    (STEM-00001-of-0000N.gguf ...) is given by any of its files and described as one."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} is a directory, not a GGUF file.")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist.")
    files = gguf_shards(path)
    # NOTE: and a digest of each file's first and last bytes (its metadata, its last tensor): a file replaced
    # in place at its size with its mtime kept (cp -p, rsync -a, tar x) ran on the old file's description.
    # Not the inode or ctime: a cache made in a container image's build is read on other hosts.
    stamp = ":".join(f"{f}:{st.st_size}:{st.st_mtime_ns}:{_ends_digest(f, st.st_size)}"
                     for f, st in ((f, os.stat(f)) for f in files))
    key = hashlib.sha1(f"{stamp}:{DESCRIBE_VERSION}".encode()).hexdigest()[:16]
    shard = _SHARD.match(os.path.basename(path))
    stem = name or (shard["stem"] if shard else os.path.splitext(os.path.basename(path))[0])
    parent = os.path.join(env.cache_dir(), "gguf", key)
    target = os.path.join(parent, stem)
    if folder_complete(target):
        return target
    try:
        os.makedirs(parent, exist_ok=True)
        lock = open(os.path.join(parent, ".lock"), "w")
    except OSError as e:
        raise OSError(f"the GGUF file's tokenizer and config are written to the cache directory {env.cache_dir()} "
                      f"(NUMA_RUNTIME_CACHE), which cannot be written ({e.strerror or e}); point "
                      "NUMA_RUNTIME_CACHE at a writable directory.") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not folder_complete(target):
            sweep_temporaries(parent, ".tmp-")
            tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
            try:
                with cache_full_said("the GGUF file's tokenizer and config"):
                    _describe(files, tmp)
                    write_manifest(tmp)
                os.chmod(tmp, 0o755)
                if os.path.lexists(target):  # NOTE: damaged (a file truncated or deleted): described again
                    log.warning("the cached description %s of %s was damaged; describing the file again", target,
                                path)
                    if os.path.islink(target):  # NOTE: a folder moved away and linked back: the link goes
                        os.unlink(target)
                    else:
                        shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            with contextlib.suppress(OSError), open(os.path.join(parent, _HOST), "w") as f:
                f.write(socket.gethostname())
            sweep_stale_descriptions(os.path.dirname(parent), key)
    return target


_HOST = ".host"  # a description's folder: the host that made it (its GGUF's path is that host's)


def sweep_stale_descriptions(root: str, keep: str) -> None:
    """Remove the cached descriptions under `root` (NUMA_RUNTIME_CACHE/gguf) made on this host of GGUF
    files that no longer exist: each file and path made a folder (3.5 MB with a Llama 3 tokenizer)
    and none was ever removed (6022 folders, 594 MB, from temporary files). Only this host's: a cache
    shared between hosts or containers holds descriptions of paths that exist elsewhere. Not the
    earlier descriptions of a file replaced in place: a server of several models loads from the one
    it chose at start. A folder being written (its lock held) is left alone."""
    try:
        keys = os.listdir(root)
    except OSError:
        return
    host = socket.gethostname()
    for key in keys:
        folder = os.path.join(root, key)
        if key == keep:
            continue
        try:
            with open(os.path.join(folder, _HOST)) as f:
                if f.read() != host:
                    continue
            subs = [n for n in os.listdir(folder) if not n.startswith(".")]
        except (OSError, UnicodeDecodeError):
            continue
        targets = []
        for n in subs:
            try:
                targets.append(os.readlink(os.path.join(folder, n, GGUF_LINK)))
            except OSError:
                targets.append(None)
        if not targets or None in targets or any(os.path.exists(t) for t in targets):
            continue  # NOTE: not ours to judge, or it describes a file that is still there
        try:
            lock = open(os.path.join(folder, ".lock"), "a")
        except OSError:
            continue
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def cache_full_said(what: str):
    """A full disk under the cache, said as such (the OS's words, or the tokenizers library's, named
    no cache)."""
    try:
        yield
    except Exception as e:
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            full = OSError(f"{what} are written to the cache directory {env.cache_dir()} (NUMA_RUNTIME_CACHE), "
                           "which is full; free space there, or point NUMA_RUNTIME_CACHE at another directory.")
            full.errno = errno.ENOSPC
            raise full from None
        raise


_MANIFEST = ".complete.json"
_ENDS = 4 << 20  # bytes read at each end of a GGUF for its description's key
_DIGESTED = 64 << 20  # cache files up to this size are listed with a digest of their content


def _ends_digest(path: str, size: int) -> str:
    """A digest of the file's first and last _ENDS bytes (all of a smaller one)."""
    h = hashlib.sha1()
    try:
        with open(path, "rb") as f:
            h.update(f.read(_ENDS))
            if size > 2 * _ENDS:
                f.seek(size - _ENDS)
                h.update(f.read(_ENDS))
            elif size > _ENDS:
                h.update(f.read())
    except OSError as e:
        raise OSError(f"cannot read the GGUF file {path!r} ({e.strerror or e}).") from None
    return h.hexdigest()[:16]


def _content(path: str) -> list | int:
    """A cache file as write_manifest lists it: [size, digest] up to _DIGESTED bytes (config,
    tokenizer, index: an edit or a flipped bit that kept the size ran as the file said), the size
    alone for larger ones (weights)."""
    size = os.path.getsize(path)
    if size > _DIGESTED:
        return size
    with open(path, "rb") as f:
        return [size, hashlib.sha1(f.read()).hexdigest()[:16]]


def write_manifest(folder: str) -> None:
    """Last of a cache folder's writes: every file in it as _content lists it (a link: its target)."""
    files = {}
    for root, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(root, n)
            rel = os.path.relpath(p, folder)
            if not rel.startswith(_MANIFEST):  # NOTE: nor another process's list being written
                files[rel] = os.readlink(p) if os.path.islink(p) else _content(p)
    # NOTE: whole or not at all: default_model lists a folder made before manifests outside its lock, while
    # another process may read it (a half-written list read as damaged, and the folder was made again)
    tmp = os.path.join(folder, f"{_MANIFEST}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(files, f)
    os.replace(tmp, os.path.join(folder, _MANIFEST))


def folder_complete(folder: str) -> bool:
    """Whether a cache folder holds every file write_manifest listed, each as written. NOTE: one that
    lost or cut a file (by hand, a full disk, a kill) was trusted for ever (it only needed config.json),
    and every later run failed on it."""
    try:
        with open(os.path.join(folder, _MANIFEST)) as f:
            files = json.load(f)
        for rel, want in files.items():
            p = os.path.join(folder, rel)
            got = (os.readlink(p) if isinstance(want, str) else _content(p) if isinstance(want, list) else
                   os.path.getsize(p))  # NOTE: a size alone: a large file, or a list written before digests
            if got != want:
                return False
    except (OSError, ValueError, AttributeError):
        return False
    return True


def sweep_temporaries(folder: str, prefix: str) -> None:
    """Remove the temporary folders `prefix`* of writers that died (SIGKILL: their cleanup never ran). The
    caller holds the lock every writer holds while its temporary folder exists."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for n in names:
        if n.startswith(prefix):
            shutil.rmtree(os.path.join(folder, n), ignore_errors=True)


# llama.cpp's names for the files of a split model (gguf-split, llama_split_path)
_SHARD = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_names(path: str) -> list[str]:
    """The paths of the files of the GGUF model at `path` (a local path or a repository's), in
    order: the file itself, or every file of a split model that `path` is one of."""
    m = _SHARD.match(os.path.basename(path))
    if not m or int(m["count"]) < 1:
        return [path]
    n = int(m["count"])
    return [os.path.join(os.path.dirname(path), f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def gguf_shards(path: str) -> list[str]:
    """shard_names(path), each of which must exist: FileNotFoundError names the first missing one."""
    files = shard_names(path)
    if len(files) == 1:
        return files
    m, n = _SHARD.match(os.path.basename(path)), len(files)
    if not 1 <= int(m["no"]) <= n:  # NOTE: part 4 of 3 ran parts 1-3, other files than the one named
        raise FileNotFoundError(f"{path} names part {int(m['no'])} of a GGUF model split into {n} files, which has "
                                f"no such part; name its first file, {os.path.basename(files[0])}.")
    missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise FileNotFoundError(f"{path} is part {int(m['no'])} of a GGUF model split into {n} files, and "
                                f"{missing[0]}{more} is missing from {os.path.dirname(path)}.")
    return files


class _Truncated(ValueError):
    """A GGUF file that ends before the data of a tensor its header lists."""


def _checked_reader(gguf, path: str):
    """gguf.GGUFReader that first checks each tensor's data lies within the file (the reader
    fails on a truncated file with whatever numpy says of the views it builds)."""
    class Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            for field in fields:
                try:
                    _, name, _, dims, dtype, offset = field.parts
                    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(dtype[0]))]
                    end = int(start_offs + offset[0]) + int(np.prod(dims)) * type_size // block
                    tensor = bytes(name).decode("utf-8", "replace")
                except Exception:  # noqa: BLE001 - a field the reader's own checks name
                    continue
                if end > size:
                    raise _Truncated(f"{path} is truncated: tensor {tensor} ends at byte {end}, the file has "
                                     f"{size}; download it again.")
            super()._build_tensors(start_offs, fields)
    return Reader


def _describe(files: list[str], out_dir: str) -> None:
    import gguf

    from .gguf_tokenizer import stop_token_ids, write_tokenizer
    path = files[0]
    readers = []
    for f in files:
        try:
            readers.append(_checked_reader(gguf, f)(f))
        except _Truncated as e:
            raise UnsupportedModelError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - the gguf package raises many kinds
            kind = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(e))
            # NOTE: a type llama.cpp retired (the file is fine, the type is refused), or one newer than the package
            if kind and (int(kind[1]) in _RETIRED_TYPES or int(kind[1]) < _known_types()):
                raise UnsupportedModelError(
                    f"{f} holds tensors of GGML type {kind[1]}{_retired_name(int(kind[1]))}, a type llama.cpp "
                    "no longer writes and numa_runtime does not read; quantize the model again to a current type "
                    "(Q4_0, Q4_K_M, Q8_0, ...).") from None
            if kind:  # NOTE: newer than the gguf package (llama.cpp's Q2_0 is 42): not one numa_runtime computes
                raise UnsupportedModelError(
                    f"{f} holds tensors of GGML type {kind[1]}, newer than the installed gguf package "
                    f"({_gguf_version()}) knows and not one numa_runtime reads; quantize the model to one it "
                    "reads (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K-Q6_K, IQ4_NL, IQ4_XS).") from None
            raise UnsupportedModelError(f"{f} is not a readable GGUF file; it may be truncated or corrupt "
                                        f"({e}).") from None
        endian = getattr(readers[-1], "endianess", None)
        if endian is not None and getattr(endian, "name", "LITTLE") != "LITTLE":
            raise UnsupportedModelError(f"{f} is a big-endian GGUF file, whose tensors numa_runtime does not read; "
                                        "convert the model again without --bigendian.")
    meta = {}
    for name, field in readers[0].fields.items():
        try:
            meta[name] = field.contents()
        except UnicodeDecodeError:
            raise UnsupportedModelError(f"{path}: the GGUF metadata {name} holds text that is not valid UTF-8, "
                                        "which numa_runtime's tokenizer cannot hold; convert the model again.") from None
    from .gguf_tokenizer import normalize_vocab
    normalize_vocab(meta, f"{path}: ")
    _check_split(files, readers, meta)
    _special_ids(meta, path)
    tensors = [(i, t) for i, r in enumerate(readers) for t in r.tensors]
    rope = {t.name: gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).ravel()
            for _, t in tensors if t.name in (ROPE_FREQS, *LONGROPE_FACTORS)}
    config = hf_config(meta, {t.name for _, t in tensors}, path, rope.get(ROPE_FREQS),
                       [rope[n] for n in LONGROPE_FACTORS] if all(n in rope for n in LONGROPE_FACTORS) else None,
                       {t.name: [int(d) for d in t.shape] for _, t in tensors})
    # NOTE: generation stops at EOS and at the file's end-of-turn / end-of-message tokens
    for name, obj in (("config.json", config), ("generation_config.json", {
            "bos_token_id": config["bos_token_id"], "eos_token_id": stop_token_ids(meta)})):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(obj, f, indent=2)
    write_tokenizer(meta, out_dir, config["model_type"] + ".", source=path)
    # NOTE: the tensor index, so that loading maps the file without re-parsing its metadata
    # (the gguf reader takes seconds to a minute on a 49K-token vocabulary)
    links = [GGUF_LINK] + [f"model-{i + 1:05d}.gguf" for i in range(1, len(files))]
    index = {"architecture": meta["general.architecture"], "files": links, "tensors": [
        {"name": t.name, "type": t.tensor_type.name, "shape": [int(d) for d in t.shape],
         "offset": int(t.data_offset), "nbytes": int(t.n_bytes), "file": i} for i, t in tensors]}
    with open(os.path.join(out_dir, INDEX), "w") as f:
        json.dump(index, f)
    for link, f in zip(links, files):
        os.symlink(f, os.path.join(out_dir, link))


# NOTE: an EOS by its text, in this order, for a file that names none (llama.cpp then takes its
# per-vocabulary default id; these are the texts those defaults stand for)
_EOS_TEXTS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>", "<eos>")


def _special_ids(meta: dict, path: str) -> None:
    """The file's EOS and BOS ids as llama.cpp takes them, in `meta` itself: one outside the
    vocabulary is unset, with a warning (a BOS then is the EOS, as one the file does not name).
    A file without an EOS (older converters) ends at the first token whose text is an end of
    text (_EOS_TEXTS; control tokens first), with a warning; none: hf_config refuses the file."""
    key = "tokenizer.ggml.eos_token_id"
    tokens = list(meta.get("tokenizer.ggml.tokens") or ())
    for name, unset in ((key, "taken as unset"), ("tokenizer.ggml.bos_token_id", "ignored")):
        if name in meta and not 0 <= int(meta[name]) < len(tokens):
            log.warning("%s: %s is %d, not one of the file's %d tokens; it is %s.", path, name, int(meta[name]),
                        len(tokens), unset)
            del meta[name]
    from .gguf_tokenizer import spm_defaults
    spm_defaults(meta, f"{path}: ")
    if key in meta:
        return
    types = list(meta.get("tokenizer.ggml.token_type") or ())
    found = [(types[i] != 3 if len(types) == len(tokens) else False, rank, i)
             for rank, text in enumerate(_EOS_TEXTS) if text in tokens for i in [tokens.index(text)]]
    if found:
        i = min(found)[2]
        meta[key] = i
        log.warning("%s names no EOS (%s); generation ends at %r (token %d), the end-of-text token of its "
                    "vocabulary.", path, key, tokens[i], i)


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return "gguf " + version("gguf")
    except PackageNotFoundError:
        return "gguf"


# GGML types the gguf package reads no more: llama.cpp's early Q4_2/Q4_3 (removed 2023), its ARM
# repacks of Q4_0 and IQ4_NL (removed late 2024)
_RETIRED_TYPES = {4: "Q4_2", 5: "Q4_3", 31: "Q4_0_4_4", 32: "Q4_0_4_8", 33: "Q4_0_8_8", 36: "IQ4_NL_4_4",
                  37: "IQ4_NL_4_8", 38: "IQ4_NL_8_8"}


def _known_types() -> int:
    """One past the highest GGML type number the installed gguf package knows: an unknown number
    below it was retired, one above it is newer than the package."""
    import gguf
    return max(int(t) for t in gguf.GGMLQuantizationType) + 1


def _retired_name(kind: int) -> str:
    return f" ({_RETIRED_TYPES[kind]})" if kind in _RETIRED_TYPES else ""


def _meta_int(meta: dict, key: str, default=None, path: str = "") -> int:
    """An integer metadata value; a per-layer array (llama.cpp reads head_count_kv and
    feed_forward_length so) of one value is that value; KeyError if absent without a default."""
    value = meta[key] if default is None else meta.get(key, default)
    if isinstance(value, (list, tuple)):
        if not value or any(v != value[0] for v in value):
            raise UnsupportedModelError(f"{path}: the GGUF metadata's {key} differs between layers "
                                        f"({list(value)[:8]}...), which numa_runtime does not run.")
        value = value[0]
    return int(value)


def _check_split(files: list[str], readers: list, meta: dict) -> None:
    """The split.* keys of the files agree with their names (llama.cpp's gguf-split)."""
    count = int(meta.get("split.count", 1) or 1)
    if count != len(files):
        raise UnsupportedModelError(
            f"{files[0]} is part of a GGUF model split into {count} files, but its name does not say "
            f"so; keep gguf-split's names (NAME-00001-of-{count:05d}.gguf ...)." if len(files) == 1 else
            f"{files[0]} says the model is split into {count} files, but its name says {len(files)}.")
    for i, r in enumerate(readers):
        no = r.fields.get("split.no")
        if len(files) > 1 and (no is None or int(no.contents()) != i):
            raise UnsupportedModelError(f"{files[i]} is not part {i + 1} of the split model its name says.")
    want = meta.get("split.tensors.count")
    have = sum(len(r.tensors) for r in readers)
    if want is not None and int(want) != have:
        raise UnsupportedModelError(f"{files[0]}: the split model's files hold {have} tensors, not the "
                                    f"{int(want)} its metadata lists.")


def hf_config(meta: dict, tensor_names: set, path: str = "", rope_freqs=None, longrope=None,
              shapes: dict | None = None) -> dict:
    """A Hugging Face config.json for a llama/mistral/qwen2/qwen3/phi3 GGUF, or a qwen2moe/qwen3moe
    one or a llama/mistral one with experts (Mixtral). rope_freqs: the file's `rope_freqs.weight`
    (float32 [rot_dim/2]) where it has one; longrope: Phi-3's (rope_factors_short,
    rope_factors_long) where it has them; shapes: {tensor name: GGUF shape}, for the sizes an older
    MoE file's metadata lacks."""
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported; "
                                    f"numa_runtime runs {', '.join(sorted(ARCHS))}.")
    a = arch + "."
    moe = _moe_keys(meta, a, arch, tensor_names, path, shapes)
    # NOTE: as llama.cpp's graphs: phi3 reads the longrope factors and not rope_freqs.weight, the
    # others the reverse (llama.cpp refuses a file with a tensor its graph does not take)
    rope_tensors = sorted(n for n in tensor_names if "rope" in n and not (
        n in LONGROPE_FACTORS if arch == "phi3" else n == ROPE_FREQS))
    if rope_tensors:
        raise UnsupportedModelError(f"{path} holds rope tensors numa_runtime does not apply "
                                    f"({', '.join(rope_tensors[:4])}).")
    lone = [n for n in LONGROPE_FACTORS if n in tensor_names]
    if arch == "phi3" and len(lone) == 1:
        other = next(n for n in LONGROPE_FACTORS if n not in tensor_names)
        raise UnsupportedModelError(f"{path} holds {lone[0]} without {other}; a longrope GGUF holds both.")
    try:
        hidden, n_head = int(meta[a + "embedding_length"]), int(meta[a + "attention.head_count"])
        head_dim = int(meta.get(a + "attention.key_length", hidden // n_head))
        rot_dim = int(meta.get(a + "rope.dimension_count", head_dim))
        if rot_dim != head_dim and (arch not in _NEOX_ARCHS or not 0 < rot_dim < head_dim or rot_dim % 2):
            raise UnsupportedModelError(f"{path}: partial rotary (rope over {rot_dim} of {head_dim} head "
                                        f"dimensions) in a {arch} GGUF is not supported.")
        if rope_freqs is not None and len(rope_freqs) != rot_dim // 2:
            raise UnsupportedModelError(f"{path}: {ROPE_FREQS} holds {len(rope_freqs)} factors where the "
                                        f"rope has {rot_dim // 2} frequencies.")
        v_dim = int(meta.get(a + "attention.value_length", head_dim))
        if v_dim != head_dim:
            raise UnsupportedModelError(f"{path}: value heads of {v_dim} dimensions beside key heads of {head_dim} "
                                        f"({a}attention.value_length) are not supported.")
        n_layers = int(meta[a + "block_count"])
        _check_blocks(tensor_names, n_layers, a, path)
        tokens = meta["tokenizer.ggml.tokens"]
        eos = int(meta["tokenizer.ggml.eos_token_id"])  # NOTE: in the vocabulary: _special_ids
        bos = int(meta.get("tokenizer.ggml.bos_token_id", eos))
        return {
            "architectures": [ARCHS[arch] if not moe or arch.startswith("qwen") else "MixtralForCausalLM"],
            "model_type": arch, "hidden_size": hidden, **moe,
            "intermediate_size": (_meta_int(meta, a + "feed_forward_length", path=path) if not moe or arch in
                                  ("llama", "mistral") else
                                  _meta_int(meta, a + "feed_forward_length", moe["moe_intermediate_size"], path)),
            "num_hidden_layers": n_layers,
            "num_attention_heads": n_head,
            "num_key_value_heads": _meta_int(meta, a + "attention.head_count_kv", n_head, path),
            "head_dim": head_dim, "hidden_act": "silu",
            "max_position_embeddings": int(meta.get(a + "context_length", 2048)),
            "rms_norm_eps": _f32(meta[a + "attention.layer_norm_rms_epsilon"]),
            "rope_theta": _f32(meta.get(a + "rope.freq_base", 10000.0)),
            **({"partial_rotary_factor": rot_dim / head_dim} if rot_dim != head_dim else {}),
            **(_longrope_keys(meta, a, path, rot_dim, longrope) if arch == "phi3" else
               _rope_keys(meta, a, path, rope_freqs)),
            **_window_keys(meta, a, n_layers, path),
            **_pooling_keys(meta, a, path),
            "attention_bias": "blk.0.attn_q.bias" in tensor_names and arch not in ("qwen2", "qwen2moe"),
            **({"qkv_bias": "blk.0.attn_q.bias" in tensor_names} if arch == "qwen2moe" else {}),
            "vocab_size": int(meta.get(a + "vocab_size", len(tokens))),
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "bos_token_id": bos, "eos_token_id": eos,
            "torch_dtype": "bfloat16",
        }
    except KeyError as e:
        raise UnsupportedModelError(f"{path}: the GGUF metadata lacks {e.args[0]!r}.") from None


def _check_blocks(tensor_names: set, n_layers: int, a: str, path: str) -> None:
    """Every layer of block_count has tensors (blk.N.*), and none beyond it (llama.cpp refuses
    such a file; its extra layers would go unused without a word)."""
    blocks = {int(n.split(".")[1]) for n in tensor_names if n.startswith("blk.") and n.split(".")[1].isdigit()}
    extra = sorted(b for b in blocks if b >= n_layers)
    if extra:
        raise UnsupportedModelError(f"{path}: {a}block_count is {n_layers}, but the file holds tensors of "
                                    f"layer {extra[0]} (blk.{extra[0]}.*); the file is inconsistent.")
    missing = [b for b in range(n_layers) if b not in blocks]
    if missing:
        raise UnsupportedModelError(f"{path}: {a}block_count is {n_layers}, but the file holds no tensors of "
                                    f"layer {missing[0]} (blk.{missing[0]}.*).")


def _moe_keys(meta: dict, a: str, arch: str, tensor_names: set, path: str, shapes: dict | None = None) -> dict:
    """config.json's mixture-of-experts keys of a qwen2moe/qwen3moe GGUF, or of a llama/mistral one
    with experts (Mixtral), as llama.cpp runs them: softmax routing, the top expert_used_count
    renormalized but for qwen2moe (whose shared expert sits under a sigmoid gate); a layer
    without ffn_gate_inp has a dense MLP. {} for a dense file."""
    experts = int(meta.get(a + "expert_count", 0) or 0)
    stored = any("_exps." in n or "ffn_gate_inp." in n for n in tensor_names)
    if not experts and not stored:
        if arch.endswith("moe"):
            raise UnsupportedModelError(f"{path}: a {arch} GGUF without {a}expert_count.")
        return {}
    if arch not in ("llama", "mistral", "qwen2moe", "qwen3moe"):
        raise UnsupportedModelError(f"{path} is a {arch} mixture-of-experts GGUF, which numa_runtime does not "
                                    "run (it runs llama/mistral (Mixtral), qwen2moe and qwen3moe ones).")
    routers = [n for n in tensor_names if n.endswith("ffn_gate_inp.weight")]
    stacks = sorted(n for n in tensor_names if n.startswith("blk.") and n.split(".", 2)[-1] in _EXPERT_STACKS)
    if not experts or not routers or not stacks:
        raise UnsupportedModelError(f"{path}: its experts are not stored as llama.cpp stores them today "
                                    f"({a}expert_count and blk.N.ffn_gate_exps/ffn_up_exps/ffn_down_exps); "
                                    "convert it again with a recent llama.cpp.")
    layers = {n.split(".")[1] for n in routers} | {n.split(".")[1] for n in stacks}
    for i in sorted(layers, key=int):
        missing = [f"blk.{i}.{t}" for t in ("ffn_gate_inp.weight",) + _EXPERT_STACKS
                   if f"blk.{i}.{t}" not in tensor_names]
        if missing:
            raise UnsupportedModelError(f"{path}: layer {i} has experts but lacks {', '.join(missing)}.")
    for n in stacks:  # NOTE: GGUF shapes are innermost first: [in, out, experts]
        shape = (shapes or {}).get(n)
        if shape is not None and (len(shape) != 3 or shape[2] != experts):
            raise UnsupportedModelError(f"{path}: {n} has shape {list(shape)}, not the {experts} stacked experts "
                                        f"of {a}expert_count.")
    used = int(meta.get(a + "expert_used_count", 0) or 0)
    if not 1 <= used <= experts:
        raise UnsupportedModelError(f"{path}: {a}expert_used_count is {meta.get(a + 'expert_used_count')}, where "
                                    f"1 to {a}expert_count ({experts}) experts a token are needed.")
    n = int(meta[a + "block_count"])
    out = {"num_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": arch != "qwen2moe",
           "mlp_only_layers": [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]}
    if arch.startswith("qwen"):
        # NOTE: older qwen2moe files lack the size keys (llama.cpp then guesses); the tensors have them
        out["moe_intermediate_size"] = _size_key(meta, a + "expert_feed_forward_length", shapes, "ffn_down_exps", path)
    else:
        out["num_local_experts"] = experts
    if arch == "qwen2moe":
        shared = any("ffn_gate_shexp." in t for t in tensor_names)
        out["shared_expert_intermediate_size"] = _size_key(
            meta, a + "expert_shared_feed_forward_length", shapes, "ffn_down_shexp", path) if shared else 0
    return out


_EXPERT_STACKS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def _size_key(meta: dict, key: str, shapes: dict | None, tensor: str, path: str) -> int:
    """A metadata size, or, where the file lacks the key, the input width of the first layer's
    `tensor` (GGUF shapes are innermost first)."""
    if meta.get(key):
        return int(meta[key])
    shape = next((s for name, s in sorted((shapes or {}).items()) if name.endswith(f".{tensor}.weight")), None)
    if not shape:
        raise UnsupportedModelError(f"{path}: the GGUF metadata lacks {key!r} and holds no {tensor} tensor to read "
                                    "it from.")
    return int(shape[0])


def _f32(x) -> float:
    # NOTE: GGUF stores eps, theta and rope factors as float32; str() of the float32 gives back 1e-05
    return float(str(np.float32(x)))


def _rope_keys(meta: dict, a: str, path: str, rope_freqs) -> dict:
    """The rope scaling of a GGUF as config.json keys, read as llama.cpp reads it (a factor
    without a type is linear; `rope.scale_linear` is the old name of the factor):
    - rope_freqs.weight (Llama 3.1/3.2's llama3 scaling): `rope_freq_factors`, our key
      (config._rope_config), the divisors of the inverse frequencies as stored;
    - linear and yarn: transformers' `rope_scaling`, the keys llama.cpp's converter wrote them from."""
    keys = {} if rope_freqs is None else {"rope_freq_factors": [float(f) for f in rope_freqs]}
    kind = meta.get(a + "rope.scaling.type", "linear")
    factor = _f32(meta.get(a + "rope.scaling.factor", meta.get(a + "rope.scale_linear", 0.0)) or 1.0)
    attn = _f32(meta.get(a + "rope.scaling.attn_factor", 1.0))
    if attn != 1.0:
        raise UnsupportedModelError(f"{path}: a GGUF rope attention factor ({attn}) is not supported.")
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return keys
    if kind == "linear":
        return {**keys, "rope_scaling": {"rope_type": "linear", "factor": factor}}
    if kind != "yarn":
        raise UnsupportedModelError(f"{path}: GGUF rope scaling type {kind!r} is not supported; numa_runtime "
                                    "runs none, linear and yarn (and llama3 as rope_freqs.weight).")
    y = a + "rope.scaling.yarn_"
    ext, log_mul = _f32(meta.get(y + "ext_factor", -1.0)), _f32(meta.get(y + "log_multiplier", 0.0))
    if ext not in (-1.0, 1.0) or log_mul != 0.0:  # NOTE: -1 is llama.cpp's "unset" (1 for yarn)
        raise UnsupportedModelError(f"{path}: yarn rope with extrapolation factor {ext} or log multiplier "
                                    f"{log_mul} is not supported (transformers' yarn has 1 and 0).")
    scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(meta.get(
        a + "rope.scaling.original_context_length", meta.get(a + "context_length", 2048)))}
    # NOTE: yarn_attn_factor is transformers' attention_factor (llama.cpp's converter writes it
    # from there; this llama.cpp does not read it and scales by 0.1 ln(factor) + 1, as
    # transformers does without attention_factor)
    for key, hf in (("beta_fast", "beta_fast"), ("beta_slow", "beta_slow"), ("attn_factor", "attention_factor")):
        if y + key in meta:
            scaling[hf] = _f32(meta[y + key])
    return {**keys, "rope_scaling": scaling}


# llama.cpp's LLAMA_POOLING_TYPE -> ours (its converter writes it from a sentence-transformers
# checkpoint's 1_Pooling, as Qwen3-Embedding's GGUFs carry it)
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}


def _pooling_keys(meta: dict, a: str, path: str) -> dict:
    """`{arch}.pooling_type` of an embedding GGUF as our config key `gguf_pooling` (it makes the
    model an embedding model, as a sentence-transformers checkpoint's 1_Pooling does)."""
    kind = int(meta.get(a + "pooling_type", 0) or 0)
    if kind == 0:
        return {}
    if kind not in _GGUF_POOLING:
        raise UnsupportedModelError(f"{path}: GGUF pooling type {kind} (a reranker's) is not supported; "
                                    "numa_runtime pools embeddings by mean (1), CLS (2) or last token (3).")
    return {"gguf_pooling": _GGUF_POOLING[kind]}


def _longrope_keys(meta: dict, a: str, path: str, rot_dim: int, factors) -> dict:
    """A Phi-3 GGUF's rope: none, or LongRoPE as llama.cpp's converter writes it (the short and
    long factor tensors, the original context, the attention factor it computed)."""
    kind = meta.get(a + "rope.scaling.type")
    if factors is None:
        if a + "rope.scaling.attn_factor" in meta:
            raise UnsupportedModelError(f"{path}: a phi3 GGUF with a rope attention factor needs both "
                                        f"{' and '.join(LONGROPE_FACTORS)}.")
        if kind == "longrope":
            raise UnsupportedModelError(f"{path}: a phi3 GGUF with longrope scaling needs both "
                                        f"{' and '.join(LONGROPE_FACTORS)}.")
    # NOTE: llama.cpp reads any architecture's scaling keys; transformers' Phi-3 runs longrope only
    # (it reads "yarn" as longrope), so any other scaling of a phi3 file is refused, not ignored
    factor = _f32(meta.get(a + "rope.scaling.factor", meta.get(a + "rope.scale_linear", 0.0)) or 1.0)
    if kind not in (None, "none", "longrope") or factor != 1.0:
        longrope = factors is not None or kind == "longrope"
        what = (f"rope scaling {kind}" if kind not in (None, "none", "longrope") else
                f"a rope scaling factor of {factor:g} beside longrope" if longrope else
                "rope scaling linear")  # NOTE: a factor without a type is linear, as llama.cpp reads it
        raise UnsupportedModelError(f"{path}: {what} ({a}rope.scaling.*) in a phi3 GGUF is not supported; Phi-3 "
                                    "models scale their rope by longrope only.")
    if factors is None:
        return {}
    short, long = ([float(f) for f in x] for x in factors)
    if len(short) != rot_dim // 2 or len(long) != rot_dim // 2:
        raise UnsupportedModelError(f"{path}: the longrope factor tensors hold {len(short)} and {len(long)} "
                                    f"factors where the rope has {rot_dim // 2} frequencies.")
    original = int(meta.get(a + "rope.scaling.original_context_length", meta.get(a + "context_length", 4096)))
    return {"original_max_position_embeddings": original,
            "rope_scaling": {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                             "original_max_position_embeddings": original,
                             "attention_factor": _f32(meta.get(a + "rope.scaling.attn_factor", 1.0))}}


def _window_keys(meta: dict, a: str, n_layers: int, path: str) -> dict:
    """`{arch}.attention.sliding_window` (Mistral v0.1) as config.json keys: every layer slides,
    or those a per-layer `sliding_window_pattern` marks. config._sliding_window reads them for
    every family (`use_sliding_window` is what Qwen2/Qwen3 configs need)."""
    window = int(meta.get(a + "attention.sliding_window", 0) or 0)
    if not window:  # NOTE: explicit: a Mistral config without the key takes transformers' 4096
        return {"sliding_window": None}
    pattern = meta.get(a + "attention.sliding_window_pattern")
    if pattern is not None and (not isinstance(pattern, list) or len(pattern) != n_layers):
        raise UnsupportedModelError(f"{path}: sliding_window_pattern {pattern!r} does not list the {n_layers} "
                                    "layers, so numa_runtime cannot tell which layers slide.")
    base = a + "rope.freq_base"
    if _f32(meta.get(base + "_swa", meta.get(base, 10000.0))) != _f32(meta.get(base, 10000.0)):
        raise UnsupportedModelError(f"{path}: a separate rope base for sliding-window layers is not supported.")
    slides = pattern if pattern is not None else [True] * n_layers
    return {"sliding_window": window, "use_sliding_window": True,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in slides]}


def open_checkpoint(cfg):
    """The weights of a model directory: the GGUF it points at, or its safetensors."""
    from .weights import Checkpoint
    if is_gguf_dir(cfg.model_dir):
        from .gguf_checkpoint import GGUFCheckpoint
        with open(os.path.join(cfg.model_dir, INDEX)) as f:
            index = json.load(f)
        files = [os.path.realpath(os.path.join(cfg.model_dir, f)) for f in index.get("files", [GGUF_LINK])]
        gone = next((f for f in files if not os.path.isfile(f)), None)
        if gone is not None:  # NOTE: it said "No *.safetensors in" the folder
            raise FileNotFoundError(f"{cfg.model_dir} describes the GGUF file {gone}, which no longer exists; "
                                    "pass the GGUF file itself.")
        return GGUFCheckpoint(files[0], index, cfg.num_heads, cfg.num_kv_heads, files=files)
    from .quant.hf_quant import read_quantization_config
    with open(os.path.join(cfg.model_dir, "config.json")) as f:
        qcfg = read_quantization_config(cfg.model_dir, json.load(f))
    fused = cfg.architecture == "Phi3ForCausalLM"
    ckpt = Checkpoint(cfg.model_dir)
    if cfg.architecture == "MixtralForCausalLM":
        ckpt.rename_mixtral()
    if cfg.num_experts:
        ckpt.split_experts()
    if qcfg:
        if fused:
            raise UnsupportedModelError(f"{cfg.model_dir}: AWQ/GPTQ Phi-3 checkpoints (fused qkv_proj and "
                                        "gate_up_proj) are not supported; load the bf16 checkpoint with "
                                        "--quantization int4 or int8 instead.")
        from .quant.hf_quant import HFQuantCheckpoint
        return HFQuantCheckpoint(ckpt, qcfg)
    if fused:  # NOTE: Phi-3 stores q/k/v and gate/up fused: read as Llama's separate tensors
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            ckpt.split_rows(p + "self_attn.qkv_proj.weight", [(p + "self_attn.q_proj.weight", cfg.q_size),
                                                            (p + "self_attn.k_proj.weight", cfg.kv_size),
                                                            (p + "self_attn.v_proj.weight", cfg.kv_size)])
            ckpt.split_rows(p + "mlp.gate_up_proj.weight", [(p + "mlp.gate_proj.weight", cfg.intermediate_size),
                                                          (p + "mlp.up_proj.weight", cfg.intermediate_size)])
    return ckpt
