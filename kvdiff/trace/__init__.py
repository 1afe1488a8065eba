"""HDF5 traces: the writer, the reader and the typed records they exchange (one import place)."""

from kvdiff.trace.format import (
    SCHEMA_VERSION, ChunkRecord, ModelDims, ProvenanceRecords, StepRecords, TraceMeta,
)
from kvdiff.trace.reader import DatasetInfo, TraceReader, open_trace
from kvdiff.trace.writer import TraceWriter

__all__ = [
    "SCHEMA_VERSION", "ChunkRecord", "DatasetInfo", "ModelDims", "ProvenanceRecords", "StepRecords", "TraceMeta",
    "TraceReader", "TraceWriter", "open_trace",
]
