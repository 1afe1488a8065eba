"""Small HDF5 datasets and attributes made with h5py's low-level calls, as its high-level ones
make them (the same types, layout and no time stamps), for a third (datasets) to a half
(attributes) of their host time: a trace's creation and closing make a few dozen of each, and
on a slow host h5py's Python layer costs 0.1-0.5 ms a call, which a short request's trace pays
in full."""

from __future__ import annotations

import functools

import h5py
import numpy as np

_STRING = h5py.string_dtype()


@functools.lru_cache(maxsize=None)
def _hdf5_type(dtype: np.dtype) -> h5py.h5t.TypeID:
    """The HDF5 type h5py makes for `dtype` (numeric, bool or `_STRING`), made once: ~15 us a call
    in Python, and a trace's closing makes a few dozen attributes and datasets of a handful of dtypes."""
    return h5py.h5t.py_create(dtype, logical=True)


@functools.lru_cache(maxsize=1)
def _scalar_space() -> h5py.h5s.SpaceID:
    """A scalar dataspace, made once (a dataspace belongs to no file)."""
    return h5py.h5s.create(h5py.h5s.SCALAR)


@functools.lru_cache(maxsize=1)
def _contiguous_layout() -> h5py.h5p.PropDCID:
    """create_dataset's creation properties for data given in full: contiguous, no time stamps."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_obj_track_times(False)
    return dcpl


def write_array(group: h5py.Group, name: str, data: np.ndarray) -> None:
    """group[name] = data: a new contiguous dataset of a numeric or bool array, as
    `group.create_dataset(name, data=data)` makes it."""
    data = np.ascontiguousarray(data)
    space = h5py.h5s.create_simple(data.shape)
    dataset = h5py.h5d.create(group.id, name.encode(), _hdf5_type(data.dtype), space,
                              dcpl=_contiguous_layout())
    if data.size:
        dataset.write(h5py.h5s.ALL, h5py.h5s.ALL, data)


def set_attributes(obj: h5py.HLObject, values: dict[str, str | int | float | np.ndarray]) -> None:
    """obj.attrs[name] = value for each: a str as a variable-length UTF-8 scalar, an int or float
    as a 64-bit scalar, a numeric array as it is; an existing attribute of the name is replaced."""
    for name, value in values.items():
        key = name.encode()
        if h5py.h5a.exists(obj.id, key):
            h5py.h5a.delete(obj.id, key)
        if isinstance(value, str):
            data, dtype = np.array(value, dtype=_STRING), _hdf5_type(_STRING)
        else:
            data = np.asarray(value)
            dtype = _hdf5_type(data.dtype)
        space = _scalar_space() if data.ndim == 0 else h5py.h5s.create_simple(data.shape)
        h5py.h5a.create(obj.id, key, dtype, space).write(data)


def utf8_strings(values: list[str]) -> np.ndarray:
    """`values` as fixed-length UTF-8 strings (an HDF5 string each, read back as bytes as a
    variable-length one is): written in one call, where variable-length strings cost a heap
    object each, ~1 us a row for a prompt's positions."""
    encoded = [v.encode("utf-8") for v in values]
    return np.array(encoded, dtype=h5py.string_dtype("utf-8", max(1, max(map(len, encoded), default=1))))


def stored_text(value) -> str:
    """HDF5 strings cannot hold NUL (a model may generate one): it is stored as U+2400."""
    return str(value).replace("\0", "\u2400")
