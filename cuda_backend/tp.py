"""Tensor parallel over NCCL: one rank per GPU of one host, under the same mpirun launch
(over gloo when Triton's interpreter runs the model on CPU tensors).

The ranks and their shards are the CPU path's (ShardLayout of the MPI rank); only the
collectives move to NCCL. Rank 0 picks a free TCP port for NCCL's rendezvous and shares it
over MPI, so nothing but mpirun is needed to start the job.
"""
from __future__ import annotations

import socket
import zlib

import numpy as np
import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NcclGroup:
    def __init__(self, comm, device: torch.device):
        # NOTE: every rank of the group on this host (its rendezvous is on 127.0.0.1). A group may
        # be one of several on the host (data-parallel replicas): compare host names, not counts
        hosts = np.zeros(comm.world_size, np.float32)
        hosts[comm.rank] = 1 + zlib.crc32(socket.gethostname().encode()) % (1 << 23)  # exact in f32
        comm.all_reduce_(hosts)
        if len(set(hosts.tolist())) > 1:
            raise RuntimeError("The CUDA backend runs tensor parallel within one host only; start every "
                               "rank of a model replica on the same machine.")
        port = np.array([_free_port() if comm.rank == 0 else 0], np.float32)  # exact below 2**24
        comm.all_reduce_(port)  # NOTE: a sum with zeros elsewhere: rank 0's port on every rank
        # NOTE: gloo on CPU tensors: Triton's interpreter runs the same code without GPUs
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{int(port[0])}",
                                rank=comm.rank, world_size=comm.world_size, **kw)
        self.rank, self.world = comm.rank, comm.world_size

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """t: [R, C] on every rank -> [R, world * C] (rank r's columns r*C:(r+1)*C)."""
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=1)

    def broadcast_(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, 0)
        return t

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
