"""Probe points, capture sinks, and HDF5 traces."""
