"""Prompt data: verl-format sources (parquet/jsonl), dataset preparation, and the grain prompt pipeline.

``PromptPipeline`` / ``PromptBatch`` are loaded lazily: grain imports jax, and the rest of this
package (``sources``, ``prepare``) is kept jax-free.
"""

from __future__ import annotations

from jaxrl.data.sources import (
    LoadedRows,
    load_rows,
    load_rows_report,
    resolve_data_path,
)

_LAZY = {"PromptPipeline", "PromptBatch", "tokenize_prompts"}

__all__ = ["LoadedRows", "load_rows", "load_rows_report", "resolve_data_path", *sorted(_LAZY)]


def __getattr__(name: str):
    if name in _LAZY:
        from jaxrl.data import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'jaxrl.data' has no attribute {name!r}")
