"""AWQ and GPTQ int4 checkpoints (Hugging Face `quantization_config`) as our int4 "zero" format.

Both store, per linear `X`: `X.qweight` (int32 words of eight 4-bit values), `X.qzeros` (the same
for zero points), `X.scales` (f16 [K / group, N]); the weight is w[n, k] = s (q - z) over groups
of `group_size` consecutive k. They differ in packing:
- GPTQ: qweight [K / 8, N], word i of column n holds k = 8i..8i+7 (nibble j = k 8i + j);
  qzeros [K / G, N / 8] packs along N (nibble j = column 8i + j); format "gptq" (v1) stores
  z - 1, "gptq_v2" z itself; `g_idx` [K] gives each k's group: anything but k // G
  (act-order, desc_act) is refused.
- AWQ ("gemm" version): qweight [K, N / 8] and qzeros [K / G, N / 8] both pack along N, nibble
  i of word c holding column 8c + ORDER[i] with ORDER = 0, 2, 4, 6, 1, 3, 5, 7.
s (q - z) = q s - s z exactly in f32, so the mapping is lossless.
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np

from .formats import QuantError, QuantFormat, QuantizedWeight, dequantize
from ..gguf_checkpoint import _QuantView

log = logging.getLogger("numa_runtime")

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


# NOTE: where AutoGPTQ and AutoAWQ wrote a checkpoint's quantization before config.json held it
OLD_CONFIG_FILES = ("quantize_config.json", "quant_config.json")


def read_quantization_config(model_dir: str, config: dict) -> dict | None:
    """config.json's quantization_config, else the quantize_config.json (AutoGPTQ) or
    quant_config.json (AutoAWQ) beside it, as vLLM reads them (a file without quant_method is
    AWQ when it has AutoAWQ's keys, else GPTQ); None for a dense checkpoint."""
    q = config.get("quantization_config")
    if q or not model_dir:
        return _lower_method(q) if q else None
    for name in OLD_CONFIG_FILES:
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            from ..config import UnsupportedModelError
            try:
                with open(path) as f:
                    q = json.load(f)
            except ValueError as e:
                raise UnsupportedModelError(f"{path} is not valid JSON ({e}).") from None
            if not isinstance(q, dict):
                raise UnsupportedModelError(f"{path} must hold a JSON object.")
            awq = any(k in q for k in ("w_bit", "q_group_size", "zero_point"))
            return _lower_method({"quant_method": "awq" if awq else "gptq", **q})
    return None


def _lower_method(q):
    """quant_method as vLLM reads it (lower case: "GPTQ" is gptq)."""
    if isinstance(q, dict) and isinstance(q.get("quant_method"), str):
        return {**q, "quant_method": q["quant_method"].lower()}
    return q


def check_quantization_config(q: dict) -> None:
    """Raise one sentence (UnsupportedModelError) for a quantization_config we cannot run."""
    from ..config import UnsupportedModelError
    method = q.get("quant_method")
    if method not in ("gptq", "awq"):
        raise UnsupportedModelError(f"Quantized checkpoints with quant_method {method!r} are not supported; "
                                    "numa_runtime reads AWQ and GPTQ int4, GGUF files, or dense checkpoints.")
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4 or isinstance(bits, bool):
        raise UnsupportedModelError(f"{method.upper()} checkpoints with bits {bits!r} are not supported; only "
                                    "4-bit ones (bits: 4).")
    group = q.get("group_size", q.get("q_group_size"))
    if group not in (32, 64, 128):
        raise UnsupportedModelError(f"{method.upper()} group_size {group} is not supported; use 32, 64 or 128.")
    if method == "awq" and str(q.get("version", "gemm")).lower() != "gemm":
        raise UnsupportedModelError(f"AWQ version {q.get('version')!r} is not supported; only 'gemm'.")
    # NOTE: GPTQModel's options beyond AutoGPTQ's: a rule of `dynamic` that sets anything ("+:" or bare
    # patterns) quantizes some modules otherwise (their tensors then disagree with group_size);
    # "-:" rules leave modules dense, which runs; packing into other than int32 words
    dynamic = q.get("dynamic") or {}
    overrides = [k for k, v in dynamic.items() if not str(k).startswith("-:") and v] if isinstance(dynamic, dict) \
        else []
    if overrides:
        raise UnsupportedModelError(f"{method.upper()} quantization_config's 'dynamic' overrides per module "
                                    f"({overrides[0]!r}: ...) are not supported; only one group_size and bits for "
                                    "every quantized module.")
    if str(q.get("pack_dtype", "int32")).replace("torch.", "") != "int32":
        raise UnsupportedModelError(f"{method.upper()} pack_dtype {q.get('pack_dtype')!r} is not supported; only "
                                    "int32 words (AutoGPTQ's and GPTQModel's default).")
    # NOTE: AutoGPTQ <= 0.7 marks its Marlin repack so (vLLM and GPTQModel read it as checkpoint_format marlin)
    fmt = "marlin" if q.get("is_marlin_format") else q.get("checkpoint_format", "gptq")
    if method == "gptq" and fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedModelError(f"GPTQ checkpoint_format {fmt!r} is not supported (only 'gptq' and 'gptq_v2': "
                                    "the Marlin repack stores other tensors); use the model's plain GPTQ files.")


def _nibbles(words: np.ndarray, axis: int) -> np.ndarray:
    """int32 words -> their 8 nibbles, expanded along `axis` (nibble j at 8 i + j)."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    nib = np.stack([(u >> (4 * j)) & 0xF for j in range(8)], axis=axis + 1)
    shape = list(words.shape)
    shape[axis] *= 8
    return nib.reshape(shape).astype(np.uint8)


class HFQuantCheckpoint:
    """A safetensors Checkpoint whose quantized linears read as QuantizedWeight slices."""

    def __init__(self, ckpt, qcfg: dict):
        check_quantization_config(qcfg)
        self.ckpt, self.method = ckpt, qcfg["quant_method"]
        self._rounded = False  # whether a tensor's scales were rounded to float16 (said once)
        self.group = int(qcfg.get("group_size", qcfg.get("q_group_size")))
        self.zero_offset = 1 if self.method == "gptq" and qcfg.get("checkpoint_format", "gptq") == "gptq" else 0
        # NOTE: act-order GPTQ is refused per layer, from its g_idx (a desc_act file whose g_idx is
        # k // group_size, as static groups give, runs as any other)
        self.desc_act = self.method == "gptq" and bool(qcfg.get("desc_act"))
        self.fmt = QuantFormat(4, self.group, "zero")

    @property
    def split_align(self) -> int:
        return self.group

    def _base(self, name: str) -> str | None:
        if name.endswith(".weight") and name[:-6] + "qweight" in self.ckpt:
            return name[:-6]
        return None

    def __contains__(self, name: str) -> bool:
        return self._base(name) is not None or name in self.ckpt

    def names(self) -> list[str]:
        return self.ckpt.names()

    def stored_name(self, name: str) -> str:
        """The file's name of the tensor read as `name` (a quantized linear: its qweight)."""
        base = self._base(name)
        return self.ckpt.stored_name(name if base is None else base + "qweight")

    def raw(self, name: str):
        base = self._base(name)
        if base is None:
            return self.ckpt.raw(name)
        s = self.ckpt.raw(base + "scales").shape                      # [ceil(K / G), N]
        qw = self.ckpt.raw(base + "qweight").shape                    # GPTQ [K / 8, N]; AWQ [K, N / 8]
        return _QuantView((s[1], qw[0] * 8 if self.method == "gptq" else qw[0]))

    def load(self, name: str, dtype: str, rows=None, cols=None) -> np.ndarray:
        if self._base(name) is None:
            return self.ckpt.load(name, dtype, rows=rows, cols=cols)
        from ..backend.reference import f32_to_bf16
        w = dequantize(self.quantized(name, rows, cols))
        return f32_to_bf16(w) if dtype == "bfloat16" else w

    def quantized(self, name: str, rows: slice | None, cols: slice | None) -> QuantizedWeight | None:
        base = self._base(name)
        if base is None:
            return None
        n, k = self.raw(name).shape
        r0, r1 = (0, n) if rows is None else (rows.start, rows.stop)
        c0, c1 = (0, k) if cols is None else (cols.start, cols.stop)
        g = self.group
        if k % g:
            raise QuantError(f"{base}weight has {k} input features, not a multiple of its group_size {g} "
                             f"(a partial last group); such checkpoints are not supported.")
        if c0 % g or c1 % g:
            raise QuantError(f"{base}weight would be split at input column {c0 if c0 % g else c1}, inside a "
                             f"group of {g}; use a rank count whose split falls on group boundaries, or model replicas "
                             "(data_parallel, --data-parallel or numa-launch --dp).")
        self._check_shapes(base, n, k)
        if self.method == "gptq":
            gidx = self.ckpt.raw(base + "g_idx") if base + "g_idx" in self.ckpt else None
            if (gidx is None and self.desc_act) or (
                    gidx is not None and not np.array_equal(np.asarray(gidx), np.arange(k) // g)):
                from ..config import UnsupportedModelError
                raise UnsupportedModelError(f"{base}g_idx is not k // group_size (act-order GPTQ, desc_act: true); "
                                            "such checkpoints are not supported: use one quantized with "
                                            "desc_act=false.")
            qw = self.ckpt.raw(base + "qweight")[c0 // 8:c1 // 8, r0:r1]            # [k'/8, n']
            q = _nibbles(qw, 0)                                                     # [k', n']
        else:
            qw = self.ckpt.raw(base + "qweight")[c0:c1, r0 // 8:-(-r1 // 8)]       # [k', n'/8]
            q = self._awq_columns(qw, r0, r1)                                       # [k', n']
        zw = self.ckpt.raw(base + "qzeros")[c0 // g:c1 // g, r0 // 8:-(-r1 // 8)]  # [k'/G, n'/8]
        z = self._awq_columns(zw, r0, r1) if self.method == "awq" else _nibbles(zw, 1)[:, r0 % 8:r0 % 8 + r1 - r0]
        z = z.astype(np.float16) + np.float16(self.zero_offset)
        # NOTE: through load(): bf16 scales are stored as their bits (f16 and f32 ones convert as numbers)
        s = self.ckpt.load(base + "scales", "float32", rows=slice(c0 // g, c1 // g), cols=slice(r0, r1))
        s16 = s.astype(np.float16)
        err = np.abs(s16.astype(np.float32) - s) / np.maximum(np.abs(s), np.float32(1e-30))
        if err.size and float(err.max()) > 0 and not self._rounded:
            # NOTE: our packed weights hold f16 scales (AutoAWQ and AutoGPTQ write f16; bf16 ones fit
            # unless tiny): say once that the weights run are not quite the file's
            self._rounded = True
            log.warning("%s: %sscales do not fit float16 (stored as %s): rounded to it, by up to %.1e of a scale "
                        "(relative), here and perhaps in other tensors.", getattr(self.ckpt, "path", "the checkpoint"),
                        base, self.ckpt.raw(base + "scales").dtype, float(err.max()))
        s = s16
        return QuantizedWeight(self.fmt, np.ascontiguousarray(q.T), np.ascontiguousarray(s.T),
                               np.ascontiguousarray(z.T), c1 - c0)

    def _check_shapes(self, base: str, n: int, k: int) -> None:
        """qweight, qzeros and scales as group_size and the method store an [n, k] weight."""
        g, n8 = self.group, -(-n // 8)
        want = {"qweight": (k // 8, n) if self.method == "gptq" else (k, n8), "qzeros": (k // g, n8),
                "scales": (k // g, n)}
        for part, shape in want.items():
            got = tuple(self.ckpt.raw(base + part).shape)
            if got != shape:
                raise QuantError(f"{base}{part} has shape {list(got)}, where {self.method.upper()} in groups of "
                                 f"{g} stores {list(shape)} for {n} outputs and {k} inputs: the "
                                 f"quantization_config does not describe this checkpoint.")
            if part != "scales" and self.ckpt.raw(base + part).dtype != np.int32:
                raise QuantError(f"{base}{part} is {self.ckpt.raw(base + part).dtype}, not the int32 words "
                                 f"{self.method.upper()} packs its 4-bit values in.")

    @staticmethod
    def _awq_columns(words: np.ndarray, r0: int, r1: int) -> np.ndarray:
        """AWQ words [rows, c] covering columns 8 (r0 // 8) ... -> values [rows, r1 - r0]."""
        nib = _nibbles(words, 1).reshape(words.shape[0], words.shape[1], 8)
        cols = np.empty_like(nib)
        cols[:, :, list(AWQ_ORDER)] = nib                                        # nibble i -> column ORDER[i]
        cols = cols.reshape(words.shape[0], -1)
        return cols[:, r0 % 8:r0 % 8 + r1 - r0]
