"""HDF5 traces: the writer, the reader and the typed records they exchange (one import place)."""

from kvdiff.probes.trace_format import (
    SCHEMA_VERSION, ChunkRecord, ProvenanceRecords, StepRecords, TraceMeta,
)
from kvdiff.probes.trace_reader import DatasetInfo, TraceReader, open_trace
from kvdiff.probes.trace_writer import TraceWriter

__all__ = [
    "SCHEMA_VERSION", "ChunkRecord", "DatasetInfo", "ProvenanceRecords", "StepRecords", "TraceMeta",
    "TraceReader", "TraceWriter", "open_trace",
]
