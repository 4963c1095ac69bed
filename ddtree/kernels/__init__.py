"""Triton kernels for DDTree (installed as ddtree.kernels)."""
from .tree_attention import (
    TreeAttentionConfig,
    pack_ancestor_bits,
    select_config,
    tree_attention,
    tree_attention_reference,
    unpack_ancestor_bits,
)

__all__ = [
    "TreeAttentionConfig",
    "pack_ancestor_bits",
    "select_config",
    "tree_attention",
    "tree_attention_reference",
    "unpack_ancestor_bits",
]
