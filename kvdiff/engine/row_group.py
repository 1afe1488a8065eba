"""RowGroup: a run of rows of one request computed in one forward.

Its tokens, global and encoded positions, the slots their K/V are written to and read from,
the key segments they attend to, and the sink that records them (with where their K/V came
from).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvdiff.engine.kv_cache import Segment
from kvdiff.trace.sink import ProbeSink, Provenance


@dataclass
class RowGroup:
    """Rows of one request computed in one forward."""

    token_ids: list[int]
    positions: list[int]          # global sequence positions (causal masking, probes)
    encoded: list[int]            # positions RoPE encodes them at
    write_slots: torch.Tensor     # (T,) slots for their K/V (-1 where `writes` is False)
    read_slots: torch.Tensor      # (T,) slots attention reads at these positions
    segments: list[Segment]       # keys they may attend to, in sequence order
    lo: int = 0                   # lowest sequence position they may attend to
    logits: bool = False          # return the logits of the last row
    sink: ProbeSink | None = None
    provenance: list[tuple[list[int], Provenance]] = field(default_factory=list)
    key_slots: np.ndarray | None = None   # a decode row: the slots of all its keys, its own last, on the host
    writes: bool = True           # False: every row's K/V is cached already (write_slots all -1)
