"""A padded decode batch's attention on MLX's CUDA backend, without a mask.

A GPU decode batch (workers/kernels/slot_batch_cache.py) left-pads its rows, and mlx-lm
hides the padding with a boolean mask. MLX's CUDA backend has no fused
kernel for one query under an array mask, so every layer of every step falls
back to separate ops (scores, mask, softmax, values): on an H100, 32 rows of
1,300 tokens of Qwen3-0.6B, 8.8 ms a step for 28 layers against 4.3 ms for
the fused kernel with no mask (docs/benchmarks-log.md, session 13). Here two kernels
of ours do what the mask says, reading each row's keys from its own first
position (the batch's `left_padding`), in float32 like MLX's vector kernel:

  * `partials`: one block per (split of the keys, KV head, row); each warp
    takes every WARPS-th key of its split for the query heads sharing that
    KV head, with a running max and sum (online softmax), and the warps
    merge theirs through shared memory;
  * `combine`: one block per (row, query head) merges the splits.

The splits depend only on the batch's rows, not on its length, so a step's
kernels keep their grid from one step to the next (MLX records a CUDA graph
per topology). Keys and values are read in place, through their strides.
"""

from __future__ import annotations

import mlx.core as mx

WARPS = 8
# Blocks the first kernel aims for (an H100 has 132 multiprocessors).
TARGET_BLOCKS = 512
MAX_SPLITS = 64

_HEADER = """
__device__ inline float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
  return x;
}
"""

# Template constants: T (dtype), D (head size), REP (query heads per KV
# head), WARPS. Lanes hold D / 32 consecutive elements of a head.
_PARTIALS = """
  constexpr int DL = D / 32;
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int splits = gridDim.x, n_kv = gridDim.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int length = k_shape[2];
  const int chunk = (length + splits - 1) / splits;
  const int lo = max(starts[b], split * chunk);
  const int hi = min(length, (split + 1) * chunk);
  const float s = scale[0];

  float qv[REP][DL], m[REP], l[REP], acc[REP][DL];
  for (int r = 0; r < REP; ++r) {
    const T* qh = q + b * q_strides[0] + (kvh * REP + r) * q_strides[1];
    for (int i = 0; i < DL; ++i) {
      qv[r][i] = static_cast<float>(qh[(lane * DL + i) * q_strides[3]]) * s;
      acc[r][i] = 0.f;
    }
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  const T* kb = k + b * k_strides[0] + kvh * k_strides[1];
  const T* vb = v + b * v_strides[0] + kvh * v_strides[1];
  for (int t = lo + warp; t < hi; t += WARPS) {
    float kx[DL], vx[DL];
    for (int i = 0; i < DL; ++i) {
      kx[i] = static_cast<float>(kb[t * k_strides[2] + (lane * DL + i) * k_strides[3]]);
      vx[i] = static_cast<float>(vb[t * v_strides[2] + (lane * DL + i) * v_strides[3]]);
    }
    for (int r = 0; r < REP; ++r) {
      float dot = 0.f;
      for (int i = 0; i < DL; ++i) dot += qv[r][i] * kx[i];
      dot = warp_sum(dot);
      const float mx_ = fmaxf(m[r], dot);
      const float keep = expf(m[r] - mx_), p = expf(dot - mx_);
      l[r] = l[r] * keep + p;
      for (int i = 0; i < DL; ++i) acc[r][i] = acc[r][i] * keep + p * vx[i];
      m[r] = mx_;
    }
  }

  // Merge the warps: shared [WARPS][REP][2 + D].
  __shared__ float sh[WARPS * REP * (2 + D)];
  for (int r = 0; r < REP; ++r) {
    float* w = sh + (warp * REP + r) * (2 + D);
    if (lane == 0) { w[0] = m[r]; w[1] = l[r]; }
    for (int i = 0; i < DL; ++i) w[2 + lane * DL + i] = acc[r][i];
  }
  __syncthreads();
  for (int j = threadIdx.x; j < REP * D; j += blockDim.x) {
    const int r = j / D, d = j % D;
    float big = -INFINITY;
    for (int w = 0; w < WARPS; ++w) big = fmaxf(big, sh[(w * REP + r) * (2 + D)]);
    float sum = 0.f, val = 0.f;
    if (big != -INFINITY) {
      for (int w = 0; w < WARPS; ++w) {
        const float* x = sh + (w * REP + r) * (2 + D);
        const float f = expf(x[0] - big);
        sum += x[1] * f;
        val += x[2 + d] * f;
      }
    }
    const int row = (b * n_kv + kvh) * REP + r;  // (row, query head)
    const int at = row * splits + split;
    if (d == 0) { part_max[at] = big; part_sum[at] = sum; }
    part_acc[at * D + d] = val;
  }
"""

# One block of D threads per (row, query head); SPLITS is the grid's.
_COMBINE = """
  const int row = blockIdx.x, d = threadIdx.x;
  const int splits = part_max_shape[2];
  const int D = part_acc_shape[3];
  const float* pm = part_max + row * splits;
  const float* ps = part_sum + row * splits;
  float big = -INFINITY;
  for (int i = 0; i < splits; ++i) big = fmaxf(big, pm[i]);
  float sum = 0.f, val = 0.f;
  if (big != -INFINITY) {
    for (int i = 0; i < splits; ++i) {
      const float f = expf(pm[i] - big);
      sum += ps[i] * f;
      val += part_acc[(row * splits + i) * D + d] * f;
    }
  }
  out[row * D + d] = static_cast<T>(sum > 0.f ? val / sum : 0.f);
"""

_KERNELS = {}
_SCALES = {}  # scale -> its one-element array (a model has one)


def _kernels():
    if not _KERNELS:
        _KERNELS["partials"] = mx.fast.cuda_kernel(
            name="tandem_decode_attention_partials",
            input_names=["q", "k", "v", "starts", "scale"],
            output_names=["part_max", "part_sum", "part_acc"],
            source=_PARTIALS, header=_HEADER, ensure_row_contiguous=False)
        _KERNELS["combine"] = mx.fast.cuda_kernel(
            name="tandem_decode_attention_combine",
            input_names=["part_max", "part_sum", "part_acc"],
            output_names=["out"], source=_COMBINE)
    return _KERNELS


def splits_for(rows: int, n_kv: int) -> int:
    """Key splits per (row, KV head): enough blocks to fill the GPU, fixed
    for a given batch size."""
    return max(1, min(MAX_SPLITS, -(-TARGET_BLOCKS // (rows * n_kv))))


def supported(queries, keys, values) -> bool:
    """One query per row, a head size of whole warps, and the first kernel's
    shared memory within the 48 KB every CUDA GPU gives a block."""
    _, n_q, length, dim = queries.shape
    n_kv = keys.shape[1]
    return (length == 1 and dim % 32 == 0 and values.shape[-1] == dim and n_q % n_kv == 0
            and WARPS * (n_q // n_kv) * (2 + dim) * 4 <= 48 * 1024
            and queries.dtype == keys.dtype == values.dtype
            and queries.dtype in (mx.float16, mx.bfloat16, mx.float32))


def attention(queries, keys, values, scale: float, starts: mx.array) -> mx.array:
    """One query per row over keys[b, :, starts[b]:, :], as
    `mx.fast.scaled_dot_product_attention` with mlx-lm's left-padding mask
    (`supported` says for which inputs). Rows with no keys give zeros."""
    b, n_q, _, dim = queries.shape
    n_kv = keys.shape[1]
    splits = splits_for(b, n_kv)
    rep = n_q // n_kv
    k = _kernels()
    if scale not in _SCALES:
        _SCALES[scale] = mx.array([scale], mx.float32)
    if starts.dtype != mx.int32:
        starts = starts.astype(mx.int32)
    part_max, part_sum, part_acc = k["partials"](
        inputs=[queries, keys, values, starts, _SCALES[scale]],
        template=[("T", queries.dtype), ("D", dim), ("REP", rep), ("WARPS", WARPS)],
        grid=(32 * WARPS * splits, n_kv, b), threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(b, n_q, splits), (b, n_q, splits), (b, n_q, splits, dim)],
        output_dtypes=[mx.float32, mx.float32, mx.float32])
    (out,) = k["combine"](
        inputs=[part_max, part_sum, part_acc], template=[("T", queries.dtype)],
        grid=(b * n_q * dim, 1, 1), threadgroup=(dim, 1, 1),
        output_shapes=[(b, n_q, 1, dim)], output_dtypes=[queries.dtype])
    return out
