"""Tuning of the INT8 decode kernels as one explicit, frozen object (:class:`Int8KernelConfig`).

Every launch parameter and compile-time switch of :mod:`kvlib.kernels.int8.w24`, :mod:`kvlib.kernels.int8.h10`
and :mod:`kvlib.kernels.int8.gluon` is a field here; :func:`kvlib.kernels.int8.decode.decode_int8` and
``decode_stage1`` take one (``config=``), probes pass variants (``DEFAULT_CONFIG.replace(...)``), and no kernel
module holds a flag anyone flips. The defaults are the H200-validated ones (dev/results/README.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

_PRECISIONS_K = ("ieee", "tf32", "tf32x3")
_PRECISIONS_V = ("ieee", "tf32", "tf32x3", "fp16")


@dataclass(frozen=True)
class Int8KernelConfig:
    """Launch parameters and switches of the INT8 stage-1 kernels (each field says which kernel reads it).

    - ``block_n``: positions per loop step (Triton kernels; the Gluon kernel's tile is fixed at 16).
    - ``num_warps`` / ``num_stages``: ``None`` takes the H200 sweeps' best (dev/int8_sweep, dev/h10_launch_sweep,
      dev/h10_tile_shape): warps 2 for h10 (two warps per 64-position tile), 4 otherwise; stages 3 for tc, 2 otherwise.
    - ``k_precision`` / ``v_precision``, ``join``: the fp32 ``fma`` kernel's dot precisions and its one joined
      ``[BLOCK_N, D]`` tile instead of four word-strided ones.
    - ``var_dot``: the radius's variance from one dot per tile (fma: ``q^2 . s^2``; h10: one 16-deep tf32
      dot of exact pieces, 2.0% certificate cost at B=8, S=32k against 4.2% for the FMA sum,
      dev/results/h10_probe8.json) instead of per-group FMAs.
    - ``pv_terms``: exact PV pieces kept (tc: 3 = ``p_hi v_hi + p_hi v_lo + p_lo v_hi``, 2, 1; h10 uses at
      most 2: ``1024 p s_v`` as hi + lo).
    - ``xi_split``: tc adds the dither's fp16 remainder as a third dot.
    - ``tile_sums``: h10 keeps the softmax/certificate sums per (position, head) and reduces once after the
      loop (a per-tile sum crosses warps).
    - ``wide_mul``: h10's Philox products from one ``mul.wide.u32`` each (9% fewer loop instructions, 5-6%
      faster under CUDA graphs, dev/results/h10_probe2.json; bit-identical Philox).
    - ``maxnreg``: h10's register cap per thread (``None``: the compiler's choice).
    - ``pv_dequant``: h10's PV over the whole tile in one fp16 dot of dequantised values (not exact: outputs
      move by the two fp16 roundings, softmax and certificate do not).
    - ``ahead``: the Gluon kernel computes each tile's Philox words at the end of the tile before, beside its
      PV (bit-identical; 3.8% faster at GQA 4, dev/results/gluon_probe5.json).
    - ``programs_per_sm``: one-warp Gluon programs resident per SM; the default split plan fills one wave.
    - ``generator``: the key dither's counter-based generator (:data:`kvlib.core.philox.GENERATORS`), which must be
      the one the pool was written with; read by the h10 and Gluon kernels (the w24 kernels refuse any but the
      default). Philox4x32-10 (the paper's) is the default; :data:`kvlib.core.philox.GENERATOR_OPTIONS` are the
      ones a pool may be written with, the other names are timing probes of the issue-28 study.
    - Timing only, never a result: ``skip_philox`` (tc, h10, gluon: the key dither replaced by garbage), which the
      performance grid and the SASS count price the Philox dither with. It stays here rather than in ``dev/``
      because the book's grid rows ``int8_nophilox`` and ``int8_h10_nophilox`` time it through ``decode_int8``
      (:mod:`kvlib.bench.decode_grid`, which may not import ``dev/``), while as a compile-time branch it leaves the
      default kernels' SASS unchanged. (The h10 kernel's ``ablate`` switches, which
      dropped its QK or PV path or computed the slots, located where its time went, ``dev/results/h10_probe4.json``;
      their code is gone since.)
    """

    block_n: int = 64
    num_warps: int | None = None
    num_stages: int | None = None
    k_precision: str = "ieee"
    v_precision: str = "ieee"
    join: bool = False
    var_dot: bool = True
    pv_terms: int = 3
    xi_split: bool = True
    tile_sums: bool = True
    wide_mul: bool = True
    maxnreg: int | None = None
    pv_dequant: bool = False
    ahead: bool = True
    programs_per_sm: int = 8
    skip_philox: bool = False
    generator: str = "philox4x32-10"

    def __post_init__(self) -> None:
        if not isinstance(self.block_n, int) or self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n!r}")
        for name in ("num_warps", "num_stages", "maxnreg"):
            val = getattr(self, name)
            if val is not None and (not isinstance(val, int) or val < 1):
                raise ValueError(f"{name} must be a positive int or None, got {val!r}")
        if self.k_precision not in _PRECISIONS_K or self.v_precision not in _PRECISIONS_V:
            raise ValueError(f"k_precision/v_precision not supported: {self.k_precision!r}, {self.v_precision!r} "
                             f"(k in {_PRECISIONS_K}, v in {_PRECISIONS_V})")
        if self.pv_terms not in (1, 2, 3):
            raise ValueError(f"pv_terms must be 1, 2 or 3, got {self.pv_terms!r}")
        if not isinstance(self.programs_per_sm, int) or self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm must be a positive int, got {self.programs_per_sm!r}")
        from kvlib.core.philox import check_generator

        check_generator(self.generator)

    def replace(self, **changes) -> Int8KernelConfig:
        """A copy with ``changes`` (unknown names raise TypeError)."""
        return dataclasses.replace(self, **changes)

    def warps(self, impl: str) -> int:
        return self.num_warps if self.num_warps is not None else (2 if impl == "h10" else 4)

    def stages(self, impl: str) -> int:
        return self.num_stages if self.num_stages is not None else (3 if impl == "tc" else 2)


DEFAULT_CONFIG = Int8KernelConfig()


def check_config(config: Int8KernelConfig | None) -> Int8KernelConfig:
    """``config`` or :data:`DEFAULT_CONFIG`; anything else is a TypeError naming the argument."""
    if config is None:
        return DEFAULT_CONFIG
    if not isinstance(config, Int8KernelConfig):
        raise TypeError(f"config must be an Int8KernelConfig, got {type(config).__name__}")
    return config


CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(Int8KernelConfig))


def config_call(kw: dict, base: Int8KernelConfig | None = None) -> dict:
    """Keywords for ``decode_int8``/``decode_stage1`` from a plain dict that mixes request arguments with tuning
    names (as benchmarks record their modes in JSON): the tuning names become one ``config`` on top of ``base``
    (or ``kw["config"]``, or :data:`DEFAULT_CONFIG`); the rest pass through."""
    kw = dict(kw)
    start = check_config(kw.pop("config", None) or base)
    tune = {k: kw.pop(k) for k in list(kw) if k in CONFIG_FIELDS}
    return kw | {"config": start.replace(**tune) if tune else start}
