"""Safetensors checkpoints read through mmap, with tensor-parallel slicing.

We parse the safetensors header ourselves (8-byte little-endian length + JSON) and map the
data with numpy, so bf16 needs no torch and a rank touches only the bytes of its slice.
Nothing is unpickled and no code from the model directory is run.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import struct

import numpy as np

from .backend.reference import bf16_to_f32, f32_to_bf16

_ST_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
              "I64": np.int64, "I32": np.int32}


# NOTE: rows converted at a time by load_rows (a conversion's temporaries are a few times its f32
# size: 16384 x 4096 x 4 B = 256 MB at most, where a 152k-row table at once took 8 GB)
ROW_CHUNK = 16384


def load_rows(ckpt, name: str, dtype: str, rows: slice, padded_rows: int | None = None) -> np.ndarray:
    """ckpt.load of a 2-D tensor's `rows` into one array in `dtype`, converted ROW_CHUNK rows at
    a time, with zero rows appended up to `padded_rows` (an embedding table or a dense lm_head)."""
    start, stop = rows.start or 0, rows.stop
    n = stop - start
    out = np.zeros((max(n, padded_rows or 0), ckpt.raw(name).shape[1]),
                   np.uint16 if dtype == "bfloat16" else np.float32)
    for a in range(start, stop, ROW_CHUNK):
        b = min(a + ROW_CHUNK, stop)
        out[a - start:b - start] = ckpt.load(name, dtype, rows=slice(a, b))
    return out


class CheckpointError(ValueError):
    """A checkpoint file is missing, malformed, or lacks a tensor."""


class _SafetensorsFile:
    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is too short to be a safetensors file.")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 << 20:
                raise CheckpointError(f"{path} has a corrupt safetensors header.")
            try:
                self.header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise CheckpointError(f"{path} has a corrupt safetensors header.") from None
        if not isinstance(self.header, dict):
            raise CheckpointError(f"{path} has a corrupt safetensors header.")
        self.header.pop("__metadata__", None)
        self.data_offset = 8 + n
        self._size = size
        self._mm = np.memmap(path, dtype=np.uint8, mode="r") if size > self.data_offset else None

    def tensor(self, name: str) -> np.ndarray:
        info = self.header.get(name)
        if info is None:
            raise CheckpointError(f"Tensor {name!r} is not in {self.path}, where the checkpoint's index puts it.")
        dt = info.get("dtype") if isinstance(info, dict) else None
        if dt not in _ST_DTYPES:
            raise CheckpointError(f"Tensor {name} in {self.path} has unsupported dtype {dt}.")
        try:
            start, end = (int(x) for x in info["data_offsets"])
            shape = [int(d) for d in info["shape"]]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"Tensor {name} in {self.path} has a corrupt header entry.") from None
        if end - start != int(np.prod(shape, dtype=np.int64)) * np.dtype(_ST_DTYPES[dt]).itemsize or start < 0:
            raise CheckpointError(f"Tensor {name} in {self.path} has a corrupt header entry: its bytes "
                                  f"({start}..{end}) do not hold a {dt} tensor of shape {shape}.")
        if self.data_offset + end > self._size:
            raise CheckpointError(f"{self.path} is truncated: it ends at byte {self._size}, but tensor {name} "
                                  f"ends at byte {self.data_offset + end}; download it again.")
        if end == start:
            return np.zeros(shape, _ST_DTYPES[dt])
        raw = self._mm[self.data_offset + start:self.data_offset + end]
        return raw.view(_ST_DTYPES[dt]).reshape(shape)

    def dtype_of(self, name: str) -> str:
        self.tensor(name)  # NOTE: checks that it is there and whole
        return self.header[name]["dtype"]

    def check_whole(self) -> None:
        """CheckpointError unless every tensor's header entry is sound and its bytes are in the
        file (a truncated download); reads no tensor data."""
        for name in self.header:
            self.tensor(name)


# Mixtral's expert projections (block_sparse_moe.experts.N.wK) -> Qwen-MoE's / Llama's names
MIXTRAL_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class Checkpoint:
    """All tensors of a model directory (single file or sharded with an index), mmapped."""

    def __init__(self, model_dir: str):
        self.path = model_dir  # NOTE: for messages, as a GGUF checkpoint's file
        index = os.path.join(model_dir, "model.safetensors.index.json")
        self._files: dict[str, _SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f).get("weight_map", {})
            except (ValueError, AttributeError) as e:
                raise CheckpointError(f"{index} is not a safetensors index (a JSON object with a weight_map): "
                                      f"{e}.") from None
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index} maps no tensor to a file (its weight_map is empty or missing).")
            for name, fname in weight_map.items():
                self._where[name] = os.path.join(model_dir, os.path.basename(fname))
        else:
            files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
            if not files:
                has_bin = any(f.endswith((".bin", ".pt", ".pth")) for f in os.listdir(model_dir))
                raise CheckpointError(
                    f"No *.safetensors in {model_dir!r}" + (
                        " (pickled .bin checkpoints are never loaded: convert them to safetensors)."
                        if has_bin else "."))
            for fname in files:
                st = self._open(os.path.join(model_dir, fname))
                for name in st.header:
                    if name in self._where:  # NOTE: the last file silently won
                        raise CheckpointError(
                            f"{model_dir!r} holds tensor {name!r} in both {os.path.basename(self._where[name])} and "
                            f"{fname}, and no model.safetensors.index.json says which is the model's; remove the "
                            "other file.")
                    self._where[name] = st.path
        self._stored = {n: n for n in self._where}  # the name we use -> the name in the file
        # a name we use -> its part of the stored tensor: rows (split_rows), or an expert and its
        # rows of a 3-D tensor (split_experts)
        self._rows: dict[str, slice | tuple] = {}
        if "model.embed_tokens.weight" not in self._where and "embed_tokens.weight" in self._where:
            # NOTE: a base model saved without its head (e.g. a Qwen3Model embedding checkpoint)
            # names its tensors without the "model." prefix; they are read under the usual names.
            self._stored = {"model." + n: n for n in self._where}
            self._where = {"model." + n: p for n, p in self._where.items()}

    def _open(self, path: str) -> _SafetensorsFile:
        if path not in self._files:
            if not os.path.isfile(path):
                raise CheckpointError(f"Checkpoint shard {path!r} is missing.")
            self._files[path] = _SafetensorsFile(path)
        return self._files[path]

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def check_whole(self) -> None:
        """CheckpointError unless every shard is present and whole (as a load finds out tensor by
        tensor, after it may have made room for the model); reads no tensor data."""
        for path in sorted(set(self._where.values())):
            self._open(path).check_whole()

    def split_rows(self, fused: str, parts: list[tuple[str, int]]) -> None:
        """Read the consecutive row blocks of tensor `fused` as tensors of their own: parts are
        (name, rows) in order (Phi-3's qkv_proj and gate_up_proj as q/k/v and gate/up, so that
        tensor parallelism slices each as it slices a Llama's). CheckpointError if the rows do not add up."""
        if fused not in self._where:
            raise CheckpointError(f"Tensor {fused!r} is missing from the checkpoint.")
        stored, path = self._stored[fused], self._where[fused]
        shape = self._open(path).tensor(stored).shape
        if shape[0] != sum(n for _, n in parts):
            raise CheckpointError(f"{fused} has {shape[0]} rows, but config.json implies "
                                  f"{' + '.join(str(n) for _, n in parts)}.")
        start = 0
        for name, n in parts:
            self._stored[name], self._where[name] = stored, path
            self._rows[name] = slice(start, start + n)
            start += n

    def rename_mixtral(self) -> None:
        """Mixtral's block_sparse_moe.{gate, experts.N.w1/w3/w2} under Qwen-MoE's names
        (mlp.gate, mlp.experts.N.gate_proj/up_proj/down_proj), every stored suffix alike
        (.weight, and an AWQ/GPTQ file's .qweight/.scales/...), as models/moe.py reads them."""
        for name in [n for n in self._where if ".block_sparse_moe." in n]:
            new = name.replace(".block_sparse_moe.", ".mlp.")
            bits = new.split(".")
            if len(bits) > 5 and bits[4] == "experts" and bits[6] in MIXTRAL_EXPERT_NAMES:  # ...experts.J.wK.*
                bits[6] = MIXTRAL_EXPERT_NAMES[bits[6]]
            new = ".".join(bits)
            self._where[new], self._stored[new] = self._where.pop(name), self._stored.pop(name)

    def split_experts(self) -> None:
        """transformers 5's fused expert tensors (mlp.experts.gate_up_proj [E, 2I, H], gate rows
        then up rows, and mlp.experts.down_proj [E, H, I]) read as the per-expert tensors of the
        checkpoints on the Hub (mlp.experts.N.gate_proj.weight, ...)."""
        for fused in [n for n in self._where if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
            stored, path = self._stored[fused], self._where[fused]
            shape = self._open(path).tensor(stored).shape
            if len(shape) != 3 or (fused.endswith("gate_up_proj") and shape[1] % 2):
                raise CheckpointError(f"{fused} has shape {tuple(shape)}, not that of fused experts.")
            stem = fused.rsplit(".", 1)[0] + "."
            for j in range(shape[0]):
                if fused.endswith("down_proj"):
                    parts = [(f"{stem}{j}.down_proj.weight", slice(0, shape[1]))]
                else:
                    half = shape[1] // 2
                    parts = [(f"{stem}{j}.gate_proj.weight", slice(0, half)),
                             (f"{stem}{j}.up_proj.weight", slice(half, shape[1]))]
                for name, rows in parts:
                    self._stored[name], self._where[name], self._rows[name] = stored, path, (j, rows)

    def names(self) -> list[str]:
        return list(self._where)

    def stored_name(self, name: str) -> str:
        """The name the file gives the tensor read as `name` (a Mixtral's block_sparse_moe
        names, a fused tensor's, the file's own without a "model." prefix), for error messages."""
        return self._stored.get(name, name)

    def raw(self, name: str) -> np.ndarray:
        """The mmapped tensor in its stored dtype (bf16 as uint16): no copy."""
        if name not in self._where:
            raise CheckpointError(f"Tensor {name!r} is missing from the checkpoint.")
        t = self._open(self._where[name]).tensor(self._stored[name])
        rows = self._rows.get(name)
        return t if rows is None else t[rows]

    def load(self, name: str, dtype: str, rows: slice | None = None, cols: slice | None = None,
             ) -> np.ndarray:
        """Copy (a row/column slice of) a tensor into fresh memory in `dtype`
        ('bfloat16' -> uint16 bits, 'float32'). Only the slice's pages are read."""
        t = self.raw(name)
        if rows is not None:
            t = t[rows]
        if cols is not None:
            t = t[:, cols]
        src = self._open(self._where[name]).dtype_of(self._stored[name])
        if dtype == "bfloat16":
            if src == "BF16":
                return np.array(t, dtype=np.uint16, order="C")
            return f32_to_bf16(np.asarray(t, dtype=np.float32))
        if src == "BF16":
            return bf16_to_f32(t)
        return np.array(t, dtype=np.float32, order="C")


def trim_heap() -> None:
    """Give the heap pages glibc keeps after frees back to the OS (malloc_trim); nothing where the
    C library is not glibc. NOTE: a load's freed f32 slices stayed resident (140 MB of RSS beside
    42 MB of int4 weights after quantizing a 287 MB model at load; 71 MB after a trim), as did an
    unloaded model's pages (~380 MiB for a 0.5B model)."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
