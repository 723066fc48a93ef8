"""Disk tier: prefix-cache blocks evicted from DRAM live on in files, across restarts.

Two halves:
- `DiskTier` (rank 0, plain Python): the index of hashes on disk in LRU order, the size cap,
  and the decisions. The block manager calls `offload` on eviction and `lookup`/`load` on a
  DRAM miss; the queued ops travel to every rank in the next StepPlan (kv_cache/tier.py).
- `DiskStore` (every rank): the files of this rank's KV shard. `apply_ops` carries out a
  plan's ops against the rank's KV arrays before the step runs.

Layout: `<dir>/<fingerprint>/<hash:032x>.r<rank>`, one file per block per rank. The
fingerprint hashes the model's config.json, the weights' identity (safetensors headers, sizes
and sampled bytes of safetensors and GGUF files), the KV dtype, weight quantization, block size
and rank count, so another model, dtype or TP
layout never reads these files. A file is a header (magic, version, hash, payload length,
CRC32 of the payload, the rank's write sequence number) and the payload: every layer's K then V rows of the block. Writes go to a
temporary file renamed into place; at start-up every rank verifies its files (bad, truncated
or stray temporary files are deleted) and rank 0 keeps the hashes valid on every rank. A load
verifies again; a file that fails is dropped, and the step is redone without it.

When reading back beats recomputing (the stated rule, `worth_loading`): reading a block costs
its bytes at disk speed, recomputing it costs 2 x parameters FLOPs per token. Assuming at least
1 GB/s from disk and at most 1 TFLOP/s per rank, reading wins when a token's KV bytes x 1000 <
2 x parameters of the rank. Every real model passes (a 0.5B Qwen: 12 KB vs 1 GFLOP); tiny test
models do not, so `load_policy="always"` skips the rule.
"""
from __future__ import annotations

import errno
import fcntl
import glob
import hashlib
import json
import logging
import os
import struct
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .tier import OP_DELETE, OP_LOAD, OP_SAVE, join_hash, ops_array

log = logging.getLogger("numa_runtime")

_MAGIC, _VERSION = b"NRKV", 1
# magic, version, hash (16 bytes), payload length, crc32, write sequence (0 in files of before it)
_HEADER = struct.Struct("<4sI16sQII")
DISK_FLOPS_PER_BYTE = 1000  # the rule's ratio: 1 TFLOP/s of compute per 1 GB/s of disk
LOAD_POLICIES = ("auto", "always")


@dataclass(frozen=True)
class DiskTierConfig:
    path: str
    capacity_bytes: int = 8 << 30      # per rank
    load_policy: str = "auto"          # "auto": the rule above; "always": load every hit

    def __post_init__(self):
        if not self.path:
            raise ValueError("kv_cache_dir must name a directory.")
        if isinstance(self.capacity_bytes, bool) or not isinstance(self.capacity_bytes, int) or self.capacity_bytes < 1:
            # NOTE: 0 held nothing and deleted every file already there (read as "no limit", it lost the cache)
            raise ValueError(f"kv_cache_disk_bytes must be a positive number of bytes (to run without the disk tier, "
                             f"leave kv_cache_dir unset), got {self.capacity_bytes!r}.")
        if self.load_policy not in LOAD_POLICIES:
            raise ValueError(f"kv_cache_disk_load must be one of {LOAD_POLICIES}, got {self.load_policy!r}.")


def worth_loading(kv_bytes_per_token: float, params_per_rank: float) -> bool:
    """The stated rule (module docstring): reading a block back beats recomputing it."""
    return kv_bytes_per_token * DISK_FLOPS_PER_BYTE < 2 * params_per_rank


def model_fingerprint(model_dir: str, kv_dtype: str, block_size: int, world_size: int) -> str:
    """Hex id of everything that decides a block's KV bytes except its tokens."""
    h = hashlib.blake2b(digest_size=12)
    h.update(json.dumps([kv_dtype, block_size, world_size]).encode())
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        h.update(f.read())
    paths = glob.glob(os.path.join(model_dir, "*.safetensors")) + glob.glob(os.path.join(model_dir, "*.gguf"))
    for path in sorted(os.path.realpath(p) for p in paths):
        st = os.stat(path)
        size = st.st_size
        # NOTE: the modification time too: weights edited in place keep their size and header,
        # and may miss every sampled window
        h.update(f"{os.path.basename(path)}:{size}:{st.st_mtime_ns}".encode())
        with open(path, "rb") as f:
            if path.endswith(".safetensors"):
                (n,) = struct.unpack("<Q", f.read(8))
                h.update(f.read(min(n, 1 << 24)))  # the header: names, dtypes, shapes, offsets
            for i in range(16):  # NOTE: sampled data bytes: random models share headers
                f.seek(size * i // 16)
                h.update(f.read(4096))
    return h.hexdigest()


class DiskTier:
    """Rank 0's index of the blocks on disk (oldest use first) and the ops to send."""

    def __init__(self, capacity_blocks: int, load_enabled: bool, entries: list[int] = (),
                 stale: list[int] = ()):
        self.capacity_blocks = capacity_blocks
        self.load_enabled = load_enabled
        self.index: OrderedDict[int, None] = OrderedDict((h, None) for h in entries)
        self._ops: list[tuple[int, int, int]] = [(OP_DELETE, -1, h) for h in stale]
        while len(self.index) > capacity_blocks:
            self._ops.append((OP_DELETE, -1, self.index.popitem(last=False)[0]))
        # NOTE: ops queued, not done: a load whose block fails its check on a rank is also a drop
        # (the prefix-cache metrics count only loads that held: BlockManager.tier_hit_blocks)
        self.num_saved = self.num_loaded = self.num_dropped = 0

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.index

    def offload(self, block_id: int, block_hash: int) -> None:
        if block_hash in self.index:  # already on disk, same bytes
            self.index.move_to_end(block_hash)
            return
        if self.capacity_blocks == 0:
            return
        while len(self.index) >= self.capacity_blocks:
            self._ops.append((OP_DELETE, -1, self.index.popitem(last=False)[0]))
        self.index[block_hash] = None
        self._ops.append((OP_SAVE, block_id, block_hash))
        self.num_saved += 1

    def lookup(self, block_hash: int) -> bool:
        return self.load_enabled and block_hash in self.index

    def load(self, block_hash: int, block_id: int) -> None:
        self.index.move_to_end(block_hash)
        self._ops.append((OP_LOAD, block_id, block_hash))
        self.num_loaded += 1

    def drop(self, block_hash: int) -> None:
        self.index.pop(block_hash, None)
        self._ops.append((OP_DELETE, -1, block_hash))  # NOTE: also on the ranks whose copy was fine
        self.num_dropped += 1

    def take_ops(self) -> np.ndarray:
        ops, self._ops = self._ops, []
        return ops_array(ops)


class DiskStore:
    """One rank's block files under `<root>/<fingerprint>/`."""

    def __init__(self, root: str, fingerprint: str, rank: int, block_bytes: int):
        self.dir = os.path.join(os.path.abspath(os.path.expanduser(root)), fingerprint)
        self.rank, self.block_bytes = rank, block_bytes
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as e:
            raise ValueError(f"Cannot create the KV cache directory {self.dir!r} ({e}); "
                             "pass a writable --kv-cache-dir.") from None
        probe = os.path.join(self.dir, f"probe.r{rank}.tmp")  # NOTE: scan() removes a stray one
        try:  # NOTE: one left by an earlier run may now be read-only (a remount, other owner)
            with open(probe, "wb"):
                pass
            os.remove(probe)
        except OSError as e:  # NOTE: a full disk is not refused: it may free up (saves are skipped meanwhile)
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise ValueError(f"Cannot write to the KV cache directory {self.dir!r} ({e}); "
                                 "pass a writable --kv-cache-dir.") from None
        self._lock = self._take_lock(root)
        self.num_bad = 0
        self._seq = 1  # NOTE: the next file's; scan() continues after the highest on disk

    def _take_lock(self, root: str) -> int | None:
        """This rank's files belong to one engine at a time: an flock on `.lock.r<rank>`, held
        until close() (or the process ends). NOTE: two engines on one folder each kept their own
        index and cap (the folder held twice its cap) and deleted each other's files in flight."""
        path = os.path.join(self.dir, f".lock.r{self.rank}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # NOTE: a full disk: the probe above let it through
            log.warning("KV disk tier: cannot open %s (%s); the folder is not locked", path, e)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._lock_pid = os.getpid()
        except OSError:
            os.close(fd)
            raise ValueError(f"The KV cache directory {root!r} is in use by another engine or server of "
                             f"this model (rank {self.rank}'s files); give each its own --kv-cache-dir.") from None
        return fd

    def close(self) -> None:
        """Give up this rank's files (the lock); the store is not used after. Idempotent."""
        fd, self._lock = getattr(self, "_lock", None), None
        if fd is not None:
            # NOTE: unlocked first, by the process that locked: an flock belongs to the open file, which a forked
            # child (a multiprocessing pool) shares; closing our descriptor alone left the folder locked until
            # every child ended, and a child that unlocks (its copy's close or __del__) freed the parent's lock
            try:
                if getattr(self, "_lock_pid", None) == os.getpid():
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    __del__ = close  # NOTE: a worker of the model router drops its engine without closing it

    @property
    def file_bytes(self) -> int:
        return _HEADER.size + self.block_bytes

    def path(self, block_hash: int) -> str:
        return os.path.join(self.dir, f"{block_hash:032x}.r{self.rank}")

    def scan(self) -> list[int]:
        """Hashes of this rank's valid files, least recently written first; deletes the rest."""
        found = []
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            if name.endswith(f".r{self.rank}.tmp"):
                _remove(path)
                continue
            stem, _, suffix = name.partition(".")
            if suffix != f"r{self.rank}":
                continue
            try:
                h = int(stem, 16)
            except ValueError:
                continue
            got = self._read(h)
            if got is not None:
                found.append((got[1], os.stat(path).st_mtime_ns, h))
        # NOTE: by write sequence, then mtime (files of before it): mtimes alone tie for files written
        # within one clock tick (ext4 before Linux 6.13), and the cap then kept chain tails by hash order
        self._seq = max((q for q, _, _ in found), default=0) + 1
        return [h for _, _, h in sorted(found)]

    def save(self, block_hash: int, payload: np.ndarray) -> bool:
        """payload: [block_bytes] uint8. False when the file could not be written."""
        head = _HEADER.pack(_MAGIC, _VERSION, block_hash.to_bytes(16, "little"), payload.nbytes,
                            zlib.crc32(payload), self._seq % (1 << 32))
        self._seq += 1
        path = self.path(block_hash)
        tmp = path + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:  # a full disk loses a cache entry, never a request
            log.warning("KV disk tier: cannot write %s (%s)", path, e)
            _remove(tmp)
            return False
        return True

    def read(self, block_hash: int) -> np.ndarray | None:
        """The payload [block_bytes] uint8, or None (the file is missing, or it was corrupt or
        truncated and is now deleted)."""
        got = self._read(block_hash)
        return None if got is None else got[0]

    def _read(self, block_hash: int) -> tuple[np.ndarray, int] | None:
        """read's payload and the file's write sequence number."""
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                data = f.read(self.file_bytes + 1)
        except OSError as e:
            log.warning("KV disk tier: cannot read %s (%s)", path, e)
            return None
        if len(data) == self.file_bytes:
            magic, version, h, n, crc, seq = _HEADER.unpack_from(data)
            payload = np.frombuffer(data, np.uint8, offset=_HEADER.size)
            if (magic, version, h, n) == (_MAGIC, _VERSION, block_hash.to_bytes(16, "little"),
                                          self.block_bytes) and zlib.crc32(payload) == crc:
                return payload, seq
        log.warning("KV disk tier: dropped %s (truncated or failed its checksum)", path)
        self.num_bad += 1
        _remove(path)
        return None

    def delete(self, block_hash: int) -> None:
        _remove(self.path(block_hash))


last_op_at = 0.0  # time.monotonic() when this process last began a tier op (the server's shutdown watchdog)


def apply_ops(store: DiskStore, ops: np.ndarray, kv_cache: list) -> np.ndarray:
    """Carry out a plan's tier ops, in order, on this rank's KV arrays.

    ops: [K, 4] int64; kv_cache: per layer (k, v), each [num_blocks, block_size, heads, D].
    Returns failed: [K] float32, 1.0 where a LOAD found no valid file (the block is untouched)
    or a SAVE could not write its file (a full disk: the tier must forget the block).
    """
    global last_op_at
    failed = np.zeros(len(ops), np.float32)  # [K]
    for i, (op, block_id, lo, hi) in enumerate(ops.tolist()):
        last_op_at = time.monotonic()
        h = join_hash(lo, hi)
        if op == OP_SAVE:
            if not store.save(h, np.concatenate([a[block_id].reshape(-1).view(np.uint8)
                                                 for kv in kv_cache for a in kv])):
                failed[i] = 1.0
        elif op == OP_LOAD:
            payload = store.read(h)
            if payload is None:
                failed[i] = 1.0
                continue
            off = 0
            for kv in kv_cache:
                for a in kv:
                    dst = a[block_id].reshape(-1).view(np.uint8)  # [bytes of one block of a layer]
                    dst[:] = payload[off:off + dst.nbytes]
                    off += dst.nbytes
        elif op == OP_DELETE:
            store.delete(h)
        else:
            raise ValueError(f"Unknown KV tier op {op}.")
    return failed


def _remove(path: str) -> None:
    """A file of the tier gone, as far as the disk lets it: a failure loses a cache entry's
    space, never a request."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # NOTE: EROFS, EACCES: the directory became read-only under the server
        log.warning("KV disk tier: cannot remove %s (%s)", path, e)
