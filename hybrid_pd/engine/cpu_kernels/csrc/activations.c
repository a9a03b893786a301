/* Activations: act(gate) * up in one pass, act SiLU or GELU's tanh form. */
#include "common.h"

/* GELU's tanh form, 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3), written
 * as x / (1 + e^(-2u)): the same function, without tanh's cancellation near 0. */
static inline float gelu_tanh(float x)
{
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return x / (1.f + exp_vec(-2.f * u));
}

/* out = act(gate) * up over rows x cols, act SiLU (gelu = 0) or GELU's tanh form (gelu = 1);
 * gate and up rows gs and us elements apart (the halves of one projection, say); out
 * contiguous. One pass, one rounding per output. */
static inline __attribute__((always_inline)) float act(float x, const int gelu)
{
    return gelu ? gelu_tanh(x) : silu(x);
}

static inline __attribute__((always_inline)) void
act_mul(long rows, long cols, const void *gate, long gs, const void *up, long us, void *out,
        const int gelu, const int bf16)
{
    for (long r = 0; r < rows; r++) {
        if (bf16) {
            const uint16_t *g = (const uint16_t *)gate + r * gs, *u = (const uint16_t *)up + r * us;
            uint16_t *restrict o = (uint16_t *)out + r * cols;
            for (long j = 0; j < cols; j++)
                o[j] = float_bf16(act(bf16_float(g[j]), gelu) * bf16_float(u[j]));
        } else {
            const float *g = (const float *)gate + r * gs, *u = (const float *)up + r * us;
            float *restrict o = (float *)out + r * cols;
            for (long j = 0; j < cols; j++)
                o[j] = act(g[j], gelu) * u[j];
        }
    }
}

#define ACT_MUL_ROWS(gelu, bf16)                                                              \
    SPLIT_ROWS(rows, act_mul(nr, cols, gate + r0 * gs, gs, up + r0 * us, us, out + r0 * cols,  \
                             gelu, bf16);)

void act_mul_f32(long rows, long cols, const float *gate, long gs, const float *up, long us,
                 float *out, int gelu, int threads)
{
    if (gelu) {
        ACT_MUL_ROWS(1, 0)
    } else {
        ACT_MUL_ROWS(0, 0)
    }
}

void act_mul_bf16(long rows, long cols, const uint16_t *gate, long gs, const uint16_t *up,
                  long us, uint16_t *out, int gelu, int threads)
{
    if (gelu) {
        ACT_MUL_ROWS(1, 1)
    } else {
        ACT_MUL_ROWS(0, 1)
    }
}
#undef ACT_MUL_ROWS
