"""The routed MoE's plan: which rows each slot multiplies, its tiles, the f16 K steps; weight
formats and the tile step both kernels share.

``MoEPlan`` is one frozen object that drives both kernels of ``moe_decode_routed`` (it is a
static argument): built by ``moe_plan(experts_format, shared_format, M)`` from the H200
measurements below, or by the decode step (``DecodePlan.moe``). The measured choices, Flint sizes:

| experts | M | slot_rows | shared_rows | prerouted / shared_first | f16 | gate_up K slices |
|---|---|---|---|---|---|---|
| BF16 | 1 | all | all | no | -- | 2 with the layer end in the next QKV kernel, else 1 |
| BF16 | 2-4 | token | all | yes | -- | 1 |
| BF16 | 5-16 | all | all | no | -- | 1 |
| NVFP4 | 1 | token | token | no | gate_up and down | 1 |
| NVFP4 | 2-16 | token | token | yes | gate_up and down | 1 |

- ``slot_rows``: "all" = every routed slot (token t's j-th expert, slot t * top_k + j) times all
  M tokens on tensor-core tiles; "token" = each slot times its own token only, an M = 1 GEMV
  (NVFP4: the CUDA-core ``blocks`` tiles; BF16: ``dot``). ``default_slot_rows``.
- ``shared_rows``: the shared expert on one program per row block for all rows, or one per
  (token, row block) on the M = 1 tiles. ``default_shared_rows``.
- ``prerouted``: the top-k once per token in its own kernel (``routing.moe_topk_route_pallas``)
  instead of in every gate_up program; ``shared_first``: the shared expert's programs take the
  first program ids of both kernels (at M > 1 they are the longest and would end last).
- ``gate_up_f16`` / ``down_f16`` (NVFP4 experts on per-token slots): the kernels multiply in
  f16x2 against x (and h) scaled per row (per 16 values) into f16 (``nvfp4_gemv.blocks_fma_f16``):
  H200 runs 154-160.
- ``gate_up_split_k`` (BF16): the gate_up kernel's K in that many slices, the last slice of each
  tile finishing h on the cache's counters (``MoEPlan`` users pass ``gate_up_counter``).
- tiles: ``default_moe_tiling``.
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from flint_jax.pallas import _common as C
from flint_jax.pallas import nvfp4_gemv as NV

__all__ = ["MoEPlan", "moe_plan", "default_slot_rows", "default_shared_rows",
           "default_moe_tiling", "expert_format", "MAX_ROWS"]

MAX_ROWS = 16


@dataclasses.dataclass(frozen=True)
class MoEPlan:
  """The routed MoE kernels' choices for one (experts format, shared format, M): see the module
  docstring. Build it with ``moe_plan``; fields are validated there."""
  experts: str                 # "bf16" | "nvfp4": the routed experts' format
  shared: str                  # the shared expert's format
  rows: int                    # M, the tokens
  slot_rows: str               # "all" | "token"
  shared_rows: str             # "all" | "token"
  prerouted: bool
  shared_first: bool
  gate_up_split_k: int
  gate_up_f16: bool
  down_f16: bool
  method: str                  # tile method of the all-rows operands (gate_up; the shared expert)
  method_down: str
  token_method: str | None     # the one-token slots' M = 1 tile method (per-token slots)
  block_n: int
  block_k: int
  num_warps: int
  num_stages: int
  block_n_down: int
  block_k_down: int
  num_warps_down: int
  num_stages_down: int

  @property
  def token(self) -> bool:
    """Whether the routed slots each multiply their own token only."""
    return self.slot_rows == "token"

  @property
  def shared_token(self) -> bool:
    """Whether the shared expert runs per token."""
    return self.shared_rows == "token"


def moe_plan(experts: str, shared: str, m: int, *, gate_up_split_k: int = 1,
             f16: bool | None = None, **tiles) -> MoEPlan:
  """The ``MoEPlan`` for expert / shared-expert formats ("bf16" / "nvfp4") at M tokens.
  ``gate_up_split_k``: BF16 only (the gate_up kernel's K slices). ``f16``: the f16 K steps of the
  NVFP4 kernels on per-token slots (None: on for NVFP4 experts, which it puts on per-token slots
  at every M). ``tiles``: overrides of ``default_moe_tiling``'s keys (for measurements)."""
  fe, fs, sk = experts, shared, gate_up_split_k
  C.check(fe in ("bf16", "nvfp4") and fs in ("bf16", "nvfp4"),
          f"formats must be 'bf16' or 'nvfp4', got {experts=} {shared=}")
  C.check(1 <= m <= MAX_ROWS, f"the MoE kernels take 1..{MAX_ROWS} rows, got {m=}")
  C.check(sk >= 1 and C.is_pow2(sk), f"gate_up_split_k must be a power of two, got {sk}")
  C.check(sk == 1 or fe == fs == "bf16",
          "gate_up_split_k > 1 needs bf16 experts and shared expert")
  if f16 is None:
    f16 = fe == "nvfp4" and sk == 1
  C.check(not f16 or fe == "nvfp4", "f16 needs NVFP4 experts")
  token = f16 or (m > 1 and default_slot_rows(fe, m, sk) == "token")
  shared_token = default_shared_rows(fe, fs, token) == "token"
  tiling = default_moe_tiling(fe, m, token=token, shared_token=shared_token, f16=f16)
  tiling.update(tiles)
  # NVFP4 M = 1: per-block sums (run 84: gate_up 8.77 / down 8.69 us in the step against 9.44 /
  # 8.87 for a row sum per K step); NVFP4 token mode: the shared expert's rows on CUDA-core rows
  # tiles (tensor-core tiles at the NVFP4 M = 1 tiling made the call 4x slower at M = 2, run 25)
  base = "blocks" if fe == "nvfp4" and m == 1 else "rows" if token and fe == "nvfp4" else "dot"
  return MoEPlan(
      experts=fe, shared=fs, rows=m, slot_rows="token" if token else "all",
      shared_rows="token" if shared_token else "all", prerouted=token and m > 1,
      shared_first=token and m > 1, gate_up_split_k=sk, gate_up_f16=f16,
      down_f16=f16 and shared_token, method=tiling.get("method", base),
      method_down=tiling.get("method_down", base),
      token_method=("blocks" if fe == "nvfp4" else "dot") if token else None,
      **{k: tiling[k] for k in _TILE_KEYS})


_TILE_KEYS = ("block_n", "block_k", "num_warps", "num_stages", "block_n_down", "block_k_down",
              "num_warps_down", "num_stages_down")


def default_slot_rows(fe: str, m: int, gate_up_split_k: int | None = None) -> str:
  """``slot_rows`` of the routed MoE for expert format ``fe`` at M tokens: "token" for NVFP4
  experts at M >= 2 and BF16 experts at M = 2..4, "all" otherwise (always with the gate_up in K
  slices, ``gate_up_split_k`` > 1, which needs "all"). H200, Flint sizes, gate_up + down (runs
  28-29, 99): NVFP4 "token" 37.8 / 52.7 / 74.9 us at M = 2 / 3 / 4 against 59.5 / 78.9 / 87.7
  for "all"; at M = 8 "token" lost (192 against 133.5) until the routing moved out of its
  programs and the shared expert's programs went first (``MoEPlan.prerouted`` / ``shared_first``,
  on with it): 114.5 against 163; in the step (run 100) NVFP4 8x1K 7.20 against 8.16 ms, 4x1K
  4.98 against 5.84. BF16 (run 109, with the same two options; equal at M = 8 without them, run
  29): 103.1 / 67.9 / 38.7 us at M = 8 / 4 / 2 against 113.3 / 81.7 / 40.5 for "all"; in the
  step (run 110, kernel busy time, the top-k kernel included) 4x1K 4048 against 4207 us, 2x1K
  3130 against 3184, but 8x1K 5900 against 5875 (in-loop 6.264 against 6.102 ms): "all" at
  M >= 5."""
  token = m >= 2 and (fe == "nvfp4" or m <= 4)
  return "token" if token and (gate_up_split_k or 1) == 1 else "all"


def default_shared_rows(fe: str, fs: str, token: bool) -> str:
  """``shared_rows`` of the routed MoE: "token" with per-token slots (``token``) when the
  experts and the shared expert are both NVFP4, "all" otherwise. H200 run 102, both
  kernels at M = 8 / 4 / 2: 77.4 / 45.3 / 23.6 us against 107.7 / 58.0 / 33.1 with "all"; in the
  step NVFP4 8x1K 5.661 against 7.240 ms, 4x1K 4.384 against 4.942, 2x1K 3.166 against 3.425
  (the ``rows`` tile's [M, BN, BK] products gave the gate_up a 6.6 KB stack frame per thread).
  BF16 per-token slots (run 109): the shared expert per token on BF16's M = 1 tiles needs
  smaller K steps to fit the shared memory and is slower then (114.7 against 103.1 us at M = 8
  with the shared expert's rows on one ``dot`` program): "all"."""
  return "token" if token and fe == fs == "nvfp4" else "all"


def default_moe_tiling(fe: str, m: int, token: bool = False, shared_token: bool = False,
                       f16: bool = False) -> dict:
  """Tile sizes of the two MoE kernels for expert format ``fe`` and M tokens on an H200;
  ``token``: the per-token slots (``MoEPlan.slot_rows`` "token": M = 1 tiles, except the NVFP4
  gate_up at M >= 5: bn16 bk512 with 4 warps; H200 runs 96 and 99, both kernels at M = 8: 288 us
  on the M = 1 tile (bn16 bk1024, 16 warps), 180 with 8 warps; with the routing given and the
  shared expert first 231 / 123, and **114.5** on bn16 bk512 w4; and the NVFP4 down kernel at
  M >= 4 on 32-row blocks, measured in the step, runs 148-149: 20.9 -> 18.9 us per layer at
  8x1K, 11.9 -> 11.1 at 4x1K, equal at 2x1K; bn64 w8 19.2-19.5, bn16 w2 19.2, bn32 w8 20.8,
  bn32 bk256 19.4; the gate_up's w8 / w2 / bn32 / bk256 / bk1024 / 3 stages no faster).
  ``f16`` (NVFP4 per-token slots with ``MoEPlan.gate_up_f16``): the f16 gate_up has 72 registers
  instead of 126, and other tiles win: bn32 at M >= 5 (8x1K: 33.9 us per layer against 34.3 on
  bn16, 37.3 for the default decode), 8 warps below (4x1K: 18.4 against 23.1 on 4 warps, and
  21.7 for the default decode on 8 warps; 2x1K: 10.5 against 12.4); the down kernel as without.
  With the block sums (runs 162-163, in the step): at M = 4 bk512 on 4 warps, 16.7 against
  17.5 us per layer (4x1K 3.254 / 3.270 against 3.301 / 3.290 ms); at M = 2 it is slower (11.7
  against 9.8); at M = 8 bn16, bk256 and a K step loaded ahead (``codes_ahead``) are slower.
  ``shared_token``: the shared expert per token too (``shared_rows="token"``): BF16's gate_up
  then on bk128 with 4 stages (its M = 1 tile, bn64 bk256 3 stages, asks for 288 KB of shared
  memory, the H200 has 227 KB; run 109).

  From the H200 sweep of runs 9-11 (docs/kernels.md at 35c0874; Flint sizes, device us of gate_up + down):
  - BF16 M=1: gate_up bn64 bk256 w4 (13.0); down bn64 bk128 (7.7, against 10.8 with the old
    single 512-wide K step: a one-iteration loop cannot pipeline its loads).
  - BF16 M=8: bn64 bk128 w4 4 stages for both (54.8 + 34.2, against 59.7 + 62.2).
  - NVFP4 M=1 (CUDA-core ``reduce``): gate_up bn16 bk512 w8 (11.0, against 19.9 at bn32 bk256
    w4: the decode needs many warps per SM); down bn16 bk512 w4 (6.1, against 8.4). Round 2:
    gate_up bk1024 w16 2 stages, down 2 stages: 16.2 us for both (17.3 with round 1's).
  - NVFP4 M=8: gate_up bn64 bk256 w4 (98); down bn64 bk128 w4 (37.6, against 43.0).
  - BF16 M=8, round 2: 64-wide K steps, 5 / 4 stages: 84.5 us for both (89.5 at bk128).
  - NVFP4 M=8 (pre-scaled scales, the ``mul`` decode; kernels.py --groups moetune /
    m8swap at 35c0874, runs 79-80): gate_up on swap-AB tiles (the decoded weights as wgmma's register A
    operand) bn128 bk256 w8: 144.5 / 144.7 us for both kernels against 160.3 / 160.2 (dot
    bn64 bk256 w4); the down kernel's swap tiles gain under 4 us: it stays ``dot``. ``method`` /
    ``method_down`` keys: the tile methods where they differ from the format's default.
  """
  methods = {}
  if token and fe == "nvfp4" and f16:       # gate_up_f16 (H200 runs 154-155, in the step)
    tiles = default_moe_tiling(fe, m, token, shared_token)
    return {**tiles, **(dict(block_n=32) if m >= 5 else
                        dict(block_k=512, num_warps=4) if m == 4 else dict(num_warps=8))}
  if token and fe == "nvfp4" and m >= 5:
    gu, dn = (16, 512, 4, 2), (32, 512, 4, 2)
  elif token and shared_token and fe == "bf16":
    gu, dn = (64, 128, 4, 4), (64, 128, 4, 3)
  elif token and fe == "nvfp4" and m >= 4:
    return {**default_moe_tiling(fe, 1), "block_n_down": 32}
  elif token:
    return default_moe_tiling(fe, 1)
  elif fe == "nvfp4" and m == 1:
    gu, dn = (16, 1024, 16, 2), (16, 512, 4, 2)
  elif fe == "nvfp4":
    gu, dn = (128, 256, 8, 3), (64, 128, 4, 3)
    methods = dict(method="swap", method_down="dot")
  elif m == 1:
    gu, dn = (64, 256, 4, 3), (64, 128, 4, 3)
  else:
    gu, dn = (64, 64, 4, 5), (64, 64, 4, 4)
  return dict(zip(("block_n", "block_k", "num_warps", "num_stages", "block_n_down",
                   "block_k_down", "num_warps_down", "num_stages_down"), gu + dn), **methods)

# ------------------------------------------------------------------------------------------
# Weight formats and the K step both kernels share


def expert_format(experts) -> str:
  if "gate_up_proj" in experts:
    return "bf16"
  if "gate_up_qweight" in experts:
    return "nvfp4"
  raise ValueError(f"unknown expert weights: keys {sorted(experts)}")


def _lin_format(w) -> str:
  if isinstance(w, (tuple, list)) and len(w) == 3:
    return "nvfp4"
  if isinstance(w, dict):
    raise ValueError("pass an NVFP4 linear as NVFP4Weight(qweight, weight_scale, weight_scale_2)")
  return "bf16"


def moe_shapes(x, experts, shared):
  """(experts format, shared format, M, D, E, I, I_s) of the MoE's inputs, checked."""
  fe = expert_format(experts)
  fs = _lin_format(shared["gate_proj"])
  C.check(_lin_format(shared["up_proj"]) == fs == _lin_format(shared["down_proj"]),
          "shared gate/up/down must share a format")
  C.check(x.ndim == 2 and 1 <= x.shape[0] <= MAX_ROWS,
          f"x must be [M <= {MAX_ROWS}, D], got {x.shape=}")
  m, d = x.shape
  if fe == "bf16":
    e, i2, dd = experts["gate_up_proj"].shape
    C.check(experts["down_proj"].shape == (e, d, i2 // 2),
            f"down_proj must be [E, D, I], got {experts['down_proj'].shape}")
  else:
    e, i2, dh = experts["gate_up_qweight"].shape
    dd = dh * 2
    C.check(experts["down_qweight"].shape == (e, d, i2 // 4),
            f"down_qweight must be [E, D, I/2], got {experts['down_qweight'].shape}")
    C.check(experts["gate_up_weight_scale_2"].shape == (e, 2),
            "gate_up_weight_scale_2 must be [E, 2]")
    C.check(experts["down_weight_scale_2"].shape == (e,), "down_weight_scale_2 must be [E]")
  C.check(dd == d, f"expert input dim {dd} != D={d}")
  sg = shared["gate_proj"] if fs == "bf16" else shared["gate_proj"][0]
  inter_s = sg.shape[0]
  return fe, fs, m, d, e, i2 // 2, inter_s


def weight_args(fmt, w):
  """Kernel inputs for one weight: bf16 -> [w]; nvfp4 -> [codes view, scales view]."""
  if fmt == "bf16":
    return [w]
  q4, s4 = NV.nvfp4_views(w[0], w[1])
  return [q4, s4]


def tile_dot(fmt, xs, x_idx, m, mp, ws, w_idx, n0, bn, i, bk, acc, decode, method,
             x_scale=None, f16_sums="block"):
  """acc + one K step (index i) of x[.., :m] . W[.., n0:n0+bn]^T, fp32 in the
  ``acc_zeros(fmt, mp, bn, bk, method)`` layout (decode factor included for NVFP4; an f16 x
  selects the f16 K step, ``x_scale`` its per-block factors, ``f16_sums`` its sums)."""
  if fmt == "bf16":
    x_ref, _ = xs
    (w_ref,) = ws
    k0 = pl.multiple_of(i * bk, bk)
    x = C.load_x(x_ref, x_idx, m, mp, pl.ds(k0, bk))                     # [Mp, BK]
    w = w_ref[(*w_idx, pl.ds(n0, bn), pl.ds(k0, bk))]                   # [BN, BK]
    return acc + C.mm_tile(x, w, method)
  _, x5_ref = xs
  q_ref, s_ref = ws
  nb = bk // 64
  return NV.nvfp4_tile_dot(x5_ref, x_idx, m, mp, q_ref, s_ref, w_idx, n0, bn, _block0(i, nb),
                           nb, decode=decode, method=method, acc=acc, x_scale_ref=x_scale,
                           f16_sums=f16_sums)


def _block0(i, nb):
  """The first 64-value block of K step i (nb blocks per step); a Python int stays one (Triton
  takes no alignment hint on a constant)."""
  return i * nb if isinstance(i, int) else pl.multiple_of(i * nb, nb)


def acc_zeros(fmt, mp, bn, bk, method):
  return C.acc_zeros(mp, bn, method, (bk,) if fmt == "bf16" else NV.lanes_shape(bk))
