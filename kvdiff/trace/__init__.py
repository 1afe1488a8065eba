"""HDF5 traces: the writer, the reader and the typed records they exchange (one import place).

The exports load on first use (h5py, torch), so that a light submodule (points, ranges, paths) can
be imported to check a user's input before the heavy stages load.
"""

from kvdiff.exports import lazy_exports

_EXPORTS = {
    "SCHEMA_VERSION": "kvdiff.trace.format", "ChunkRecord": "kvdiff.trace.format", "ModelDims": "kvdiff.trace.format",
    "ProvenanceRecords": "kvdiff.trace.format", "StepRecords": "kvdiff.trace.format",
    "TraceMeta": "kvdiff.trace.format", "DatasetInfo": "kvdiff.trace.reader", "TraceReader": "kvdiff.trace.reader",
    "open_trace": "kvdiff.trace.reader", "TraceWriter": "kvdiff.trace.writer",
}

__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
