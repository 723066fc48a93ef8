"""Paged KV cache bookkeeping: block manager, prefix-cache hashing, eviction policies."""
from .block_manager import BlockManager, hash_block
from .eviction import EvictionPolicy, LRUEviction, ReuseAwareEviction, make_eviction_policy

__all__ = ["BlockManager", "hash_block", "EvictionPolicy", "LRUEviction", "ReuseAwareEviction",
           "make_eviction_policy"]
