"""Moved: the building blocks are in engine/models/reference.py, Qwen3 in engine/models/qwen3.py.

Kept only while kernel modules still import their references from here; it re-exports
and holds no code of its own."""
from .models.reference import attention, rmsnorm, rope_neox, rope_tables, silu  # noqa: F401
