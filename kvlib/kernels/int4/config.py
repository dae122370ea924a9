"""Launch parameters of the KV4 decode kernels (:class:`KV4KernelConfig`) and the tuned default.

Layouts tried on the H200 and removed (with their timings and result files) are logged in
``dev/results/README.md``, section "INT4 kernel layouts tried".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class KV4KernelConfig:
    """Launch parameters of :func:`~kvlib.kernels.int4.launch.kv4_main_decode` and
    :func:`~kvlib.kernels.int4.paged.kv4_paged_decode`, passed in as ``config=`` (the sweep in
    :mod:`dev.kv4_sweep` tunes them).

    - ``block_n``: positions per loop step; ``num_warps``; ``num_stages``: software-pipelined
      asynchronous copies of the next blocks in flight.
    - ``num_splits``: split-KV programs per (request, kv head); ``None``: the wave model of
      :func:`~kvlib.kernels.int4.launch.default_num_splits` with ``ctas_per_sm`` programs resident per SM and
      a fixed cost per program of ``overhead_blocks`` position blocks (0: the earlier model, without it).
    - ``int_pv``: integer PV (INT8 probabilities x INT4 codes) instead of dequantised fp16 PV.
    - ``k_mode``: how QK reads the key codes: ``"bytes"`` uint8 even/odd nibbles (two INT8 dots of
      K = d/2), ``"planes"`` int16 words split into four nibble planes (four dots of K = d/4; needs
      d >= 128), ``"trans"`` bytes but transposed throughout (``s^T = codes @ q^T``,
      ``o^T += V^T @ p^T``: code tiles as A operands, query rows in N; fp16 PV only).
    - ``rows``: query rows per tile (``None``: the GQA group rounded up to a power of two, at least
      :data:`MIN_ROWS`).
    - ``tile_sums``: per-element softmax-sum tiles (one reduction after the loop instead of two per block).
    - ``block_p``: side slots per step of the KV4-RL protected region; ``maxnreg``: ptxas register cap.
    - ``tma``: read the code tiles and scales through Hopper TMA descriptors (bulk asynchronous copies, no
      per-thread addresses; k_mode "bytes"/"trans" with fp16 PV, ``N`` a multiple of 8 so every row stride is
      16-byte aligned, ``block_n`` a multiple of 64 so every pipeline stage of the fp16 scale boxes stays 128-byte
      aligned in shared memory); otherwise the pointer loads are used and the launch record says why
      (:func:`~kvlib.kernels.int4.launch.tma_refusal`).
    - ``pipe_edges``: a split's partial first and last blocks run the masked step inside the
      software-pipelined loop (one uniform branch per block), instead of as two peeled steps whose loads
      nothing prefetches. ``None``: on with a side buffer (a KV4-RL main region is unaligned at both ends),
      off without (a KV4 region starts at 0); set it for ragged KV4 batches.
    - ``fuse_merge``: the last program of each (request, kv head) to finish merges the pair's split states
      (an atomic arrival counter per pair, zeroed by :func:`~kvlib.kernels.int4.query.prepare_query` and left
      at zero by that program) instead of a second launch; taken when the pair has more than one state and its
      ``rows x states x d`` tile is at most 64 fp32 per thread
      (:func:`~kvlib.kernels.int4.launch.fuse_merge_applies`). ``None``: fused when the INT4 region has two or
      more splits.
    - ``pdl``: programmatic dependent launch (sm_90+; ignored elsewhere): the decode kernel may launch while
      the query preparation finishes, and the split merge while the decode kernel finishes; each waits
      (``griddepcontrol.wait``) before reading what the one before wrote.
    """

    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    num_splits: int | None = None
    int_pv: bool = False
    k_mode: str = "bytes"
    tile_sums: bool = True
    rows: int | None = None
    block_p: int = 32
    ctas_per_sm: int = 3
    overhead_blocks: float = 0.0
    maxnreg: int | None = None
    tma: bool = False
    pdl: bool = True
    pipe_edges: bool | None = None
    fuse_merge: bool | None = None

    def replace(self, **kw) -> KV4KernelConfig:
        """A copy with the given fields changed."""
        return dataclasses.replace(self, **kw)


_KMODES = ("planes", "bytes", "trans")
#: fewest query rows per tile when ``rows`` is None: 8 rows (218 registers) tied or beat the GQA group's 4 at
#: every shape of three H200 sweeps (B=32, S=16k: 0.161 vs 0.163 ms; ragged B=320: 0.464 vs 0.483 ms;
#: dev/results/kv4_sweep_par.json, kv4_sweep_packed.json, kv4_sweep_packed2.json)
MIN_ROWS = 8
#: block_n 256: the H200 sweep's best mean over its shapes (dev.kv4_sweep); the split plan plans for the
#: two CTAs per SM that its registers allow (218 at 8 query rows, 4 warps), with one block of fixed cost per
#: program (the "waves" sweep: one wave of programs beats more splits, and ragged batches lose with many
#: splits); the protected region as one extra program per pair (every other layout timed was slower for KV4-RL:
#: dev/results/README.md, "INT4 kernel layouts tried"), its main region's unaligned edge blocks inside the
#: pipelined loop (``pipe_edges`` None: on with a side buffer); programmatic dependent launch (``pdl``, on)
DEFAULT_CONFIG = KV4KernelConfig(block_n=256, ctas_per_sm=2, overhead_blocks=1.0)
