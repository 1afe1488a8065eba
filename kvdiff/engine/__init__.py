"""The chunked-generation engine and the reference continuous path."""

from kvdiff.engine.engine import Engine
from kvdiff.engine.outputs import RequestOutput, RequestStats
from kvdiff.trace.format import ChunkRecord

__all__ = ["Engine", "RequestOutput", "RequestStats", "ChunkRecord"]
