"""CUDA backend: a stub. No open issue asks for it yet; `Engine(backend="cuda")` raises a clear
error (numa_runtime.backend.get_backend). The plan: the same op set as
numa_runtime/backend/reference.py over torch CUDA tensors, imported only when asked for."""
