"""louver-sgl: exact range-search sparse attention for SGLang (Louver).

Public API: ``LouverConfig``, ``LouverIndex`` (standalone range search), the threshold policies and
the batched decode step (``louver_sgl.decode``).
"""

from .config import LouverConfig
from .index.search import LouverIndex
from .index.store import PageIndexStore

__all__ = ["LouverConfig", "LouverIndex", "PageIndexStore"]
__version__ = "0.1.0"
