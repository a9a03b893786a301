/* Norms and rotations: the RMS norm of rows, the gated RMS norms of Qwen3.5 (norm, then
 * gate) and Mamba2 (gate, then norm), the L2 norm of the delta rule's q and k, and an
 * optional RMS norm per head followed by RoPE. */
#include "common.h"

/* The sum of x[o + j]^2 over j < n, in LANES partial sums (the tail in the first) added in a
 * fixed order: what every RMS norm here takes its mean of. */
static inline __attribute__((always_inline)) float
sum_squares(const void *x, long o, long n, const int bf16)
{
    float acc[LANES] = {0};
    long j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) {
            const float v = load_as(x, o + j + l, bf16);
            acc[l] += v * v;
        }
    for (; j < n; j++) {
        const float v = load_as(x, o + j, bf16);
        acc[0] += v * v;
    }
    float sum = 0.f;
    for (int l = 0; l < LANES; l++)
        sum += acc[l];
    return sum;
}

/* Gated RMS norm of Qwen3.5 / Qwen3-Next's linear attention (norm, then gate), per head
 * vector of `dim`:
 *
 *   a = x rsqrt(mean(x^2) + eps);  out = (w a) silu(z)
 *
 * with PyTorch's roundings in bfloat16 (a and w a rounded to bfloat16 as the model's
 * PyTorch form does; the sum of squares in float32 over LANES partial sums). x, z: [T, H,
 * dim], strides xt, xh and zt, zh (dim contiguous); w: [dim]; out: [T, H, dim] contiguous.
 */
static inline __attribute__((always_inline)) void
norm_gate(long tokens, int heads, int dim, const void *x, long xt, long xh, const void *z,
           long zt, long zh, const void *w, float eps, void *out, const int bf16)
{
    float a[MAX_DIM];
    for (long t = 0; t < tokens; t++)
        for (int h = 0; h < heads; h++) {
            const long xo = t * xt + h * xh, zo = t * zt + h * zh;
            const long oo = (t * heads + h) * (long)dim;
            const float r = 1.f / sqrtf(sum_squares(x, xo, dim, bf16) / (float)dim + eps);
            for (int j = 0; j < dim; j++)
                a[j] = round_as(load_as(x, xo + j, bf16) * r, bf16);
            for (int j = 0; j < dim; j++) {
                const float y = round_as(load_as(w, j, bf16) * a[j], bf16);
                store_as(out, oo + j, y * silu(load_as(z, zo + j, bf16)), bf16);
            }
        }
}

#define NORM_GATE_ROWS(bf16)                                                                  \
    SPLIT_ROWS(tokens, norm_gate(nr, heads, dim, x + r0 * xt, xt, xh, z + r0 * zt, zt, zh, w,  \
                                 eps, out + r0 * heads * dim, bf16);)

int norm_gate_f32(long tokens, int heads, int dim, const float *x, long xt, long xh,
                  const float *z, long zt, long zh, const float *w, float eps, float *out,
                  int threads)
{
    if (dim > MAX_DIM)
        return -1;
    NORM_GATE_ROWS(0)
    return 0;
}

int norm_gate_bf16(long tokens, int heads, int dim, const uint16_t *x, long xt, long xh,
                   const uint16_t *z, long zt, long zh, const uint16_t *w, float eps,
                   uint16_t *out, int threads)
{
    if (dim > MAX_DIM)
        return -1;
    NORM_GATE_ROWS(1)
    return 0;
}
#undef NORM_GATE_ROWS

/* Mamba2's gated RMS norm (gate, then norm): h = y silu(z), normalised over groups of
 * `group` channels, times w, in float32 (as the PyTorch form computes it whatever the
 * model's dtype). y: [T, inner] float32, rows ys apart; z: [T, inner], rows zs apart, and w: [inner], both float32 or
 * both bfloat16 (bf16 = 1); out: [T, inner] float32, contiguous. The sum of squares runs
 * in LANES partial sums. h is held in out's row until it is normalised there, so a group has
 * no size limit (Granite-4.0-H-350M has one group of 1,536 channels).
 */
static inline __attribute__((always_inline)) void
gate_norm(long tokens, int inner, int group, const float *y, long ys, const void *z, long zs,
          const void *w, float eps, float *out, const int bf16)
{
    for (long t = 0; t < tokens; t++)
        for (int g0 = 0; g0 < inner; g0 += group) {
            const float *yr = y + t * ys + g0;
            const long zo = t * zs + g0;
            float *restrict h = out + t * (long)inner + g0;
            for (int j = 0; j < group; j++)
                h[j] = yr[j] * silu(load_as(z, zo + j, bf16));
            const float r = 1.f / sqrtf(sum_squares(h, 0, group, 0) / (float)group + eps);
            for (int j = 0; j < group; j++)
                h[j] = load_as(w, g0 + j, bf16) * (h[j] * r);
        }
}

#define GATE_NORM_ROWS(bf16)                                                                  \
    SPLIT_ROWS(tokens, gate_norm(nr, inner, group, y + r0 * ys, ys, z + r0 * zs, zs, w, eps,   \
                                 out + r0 * inner, bf16);)

int gate_norm_f32(long tokens, int inner, int group, const float *y, long ys, const float *z,
                  long zs, const float *w, float eps, float *out, int threads)
{
    if (group < 1 || inner % group)
        return -1;
    GATE_NORM_ROWS(0)
    return 0;
}

int gate_norm_bf16(long tokens, int inner, int group, const float *y, long ys,
                   const uint16_t *z, long zs, const uint16_t *w, float eps, float *out,
                   int threads)
{
    if (group < 1 || inner % group)
        return -1;
    GATE_NORM_ROWS(1)
    return 0;
}
#undef GATE_NORM_ROWS

/* RMS norm of rows: out = x rsqrt(mean(x^2) + eps) (w + offset). x: [rows, dim], rows xs
 * apart; w: [dim]; out: [rows, dim] contiguous; all float32, or all bfloat16 (bf16 = 1),
 * computed in float32 and rounded where `RMSNorm`'s PyTorch form rounds: once at the end,
 * or with `after_cast` (x rsqrt(...) rounded first, then times w + offset rounded, and the
 * product rounded). The sum of squares runs in LANES partial sums. */
static inline __attribute__((always_inline)) void
rms_norm(long rows, long dim, const void *x, long xs, const void *w, float offset, float eps,
         void *out, const int bf16, const int after_cast)
{
    for (long r = 0; r < rows; r++) {
        const long xo = r * xs, oo = r * dim;
        const float s = 1.f / sqrtf(sum_squares(x, xo, dim, bf16) / (float)dim + eps);
        for (long j = 0; j < dim; j++) {
            const float v = load_as(x, xo + j, bf16) * s;
            const float y = after_cast
                                ? round_as(load_as(w, j, bf16) + offset, bf16) * round_as(v, bf16)
                                : v * (load_as(w, j, bf16) + offset);
            store_as(out, oo + j, y, bf16);
        }
    }
}

void rms_norm_f32(long rows, long dim, const float *x, long xs, const float *w, float offset,
                  float eps, float *out, int threads)
{
    SPLIT_ROWS(rows, rms_norm(nr, dim, x + r0 * xs, xs, w, offset, eps, out + r0 * dim, 0, 0);)
}

void rms_norm_bf16(long rows, long dim, const uint16_t *x, long xs, const uint16_t *w,
                   float offset, float eps, uint16_t *out, int after_cast, int threads)
{
    if (after_cast) {
        SPLIT_ROWS(rows,
                   rms_norm(nr, dim, x + r0 * xs, xs, w, offset, eps, out + r0 * dim, 1, 1);)
    } else {
        SPLIT_ROWS(rows,
                   rms_norm(nr, dim, x + r0 * xs, xs, w, offset, eps, out + r0 * dim, 1, 0);)
    }
}

/* L2 norm of heads, then a scale: out = (x rsqrt(sum(x^2) + eps)) scale per head of `dim`
 * floats (the delta rule's q and k). x: [tokens, heads, dim], tokens xt apart, the heads
 * side by side; out: [tokens, heads, dim] contiguous. */
static inline __attribute__((always_inline)) void
l2_norm(long tokens, int heads, int dim, const float *x, long xt, float scale, float eps,
        float *out)
{
    for (long t = 0; t < tokens; t++)
        for (int h = 0; h < heads; h++) {
            const float *xr = x + t * xt + (long)h * dim;
            float *o = out + (t * heads + h) * (long)dim;
            const float r = 1.f / sqrtf(sum_squares(xr, 0, dim, 0) + eps);
            for (int j = 0; j < dim; j++)
                o[j] = xr[j] * r * scale;
        }
}

void l2_norm_f32(long tokens, int heads, int dim, const float *x, long xt, float scale,
                 float eps, float *out, int threads)
{
    SPLIT_ROWS(tokens, l2_norm(nr, heads, dim, x + r0 * xt, xt, scale, eps,
                               out + r0 * heads * (long)dim);)
}

/* ------------------------------------------------------------------ norm and rotation */

/* Each head of each token: an optional RMS norm over its dim (y = x rsqrt(mean(x^2) + eps)
 * (w + offset); w NULL: y = x), then RoPE in the rotate-half layout on its first `rot` dims
 * (half = rot / 2: out[j] = y[j] cos[j] - y[j + half] sin[j], out[j + half] = y[j + half]
 * cos[j + half] + y[j] sin[j + half]), the other dims copied. x: [tokens, heads, dim] (tokens
 * xs, heads xh elements apart, dim contiguous; a view of a fused projection's output);
 * cos, sin: [tokens, rot] (rows cs apart); out: [tokens, heads, dim] contiguous. One pass
 * where PyTorch takes about ten operations and their temporaries. */
static inline __attribute__((always_inline)) void
norm_rope(long tokens, int heads, int dim, int rot, const float *x, long xs, long xh,
          const float *w, float offset, float eps, const float *cos, const float *sin, long cs,
          float *out)
{
    const int half = rot / 2;
    float y[MAX_DIM];
    for (long t = 0; t < tokens; t++) {
        const float *c = cos + t * cs, *sn = sin + t * cs;
        for (int h = 0; h < heads; h++) {
            const float *xr = x + t * xs + (long)h * xh;
            float *o = out + (t * heads + h) * (long)dim;
            if (w) {
                const float r = 1.f / sqrtf(sum_squares(xr, 0, dim, 0) / (float)dim + eps);
                for (int j = 0; j < dim; j++)
                    y[j] = xr[j] * r * (w[j] + offset);
            } else {
                for (int j = 0; j < dim; j++)
                    y[j] = xr[j];
            }
            for (int j = 0; j < half; j++) {
                o[j] = y[j] * c[j] - y[j + half] * sn[j];
                o[j + half] = y[j + half] * c[j + half] + y[j] * sn[j + half];
            }
            for (int j = rot; j < dim; j++)
                o[j] = y[j];
        }
    }
}

int norm_rope_f32(long tokens, int heads, int dim, int rot, const float *x, long xs, long xh,
                  const float *w, float offset, float eps, const float *cos, const float *sin,
                  long cs, float *out, int threads)
{
    if (dim > MAX_DIM || dim < 1 || rot < 0 || rot > dim || rot % 2)
        return -1;
    SPLIT_ROWS(tokens, norm_rope(nr, heads, dim, rot, x + r0 * xs, xs, xh, w, offset, eps,
                                 cos + r0 * cs, sin + r0 * cs, cs, out + r0 * heads * dim);)
    return 0;
}

