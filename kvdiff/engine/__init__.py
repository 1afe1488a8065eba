"""The chunked-generation engine and the reference continuous path."""

from kvdiff.engine.engine import Engine
from kvdiff.engine.outputs import ChunkReport, RequestOutput, RequestStats

__all__ = ["Engine", "RequestOutput", "RequestStats", "ChunkReport"]
