"""The batched decode step: one API (``LouverDecode``: plan, then run) over registered
implementations, the shared contract, and the reference specification."""

from .api import (
    LouverDecode, available_implementations, implementation_names, louver_decode, register_implementation,
)
from .contract import DecodeImplementation, DecodeResult, HeadShapes, RequestLayout, StepStats
from .impl_torch import dense_attention

__all__ = ["DecodeImplementation", "DecodeResult", "HeadShapes", "LouverDecode", "RequestLayout", "StepStats",
           "available_implementations", "dense_attention", "implementation_names", "louver_decode",
           "register_implementation"]
