/* hybrid-pd's CPU kernels: recurrences that PyTorch can only run as many small operations.
 *
 * Built at first use by hybrid_pd/engine/cpu_kernels.py (cc -O3 -march=native) and called
 * through ctypes with raw float32 pointers; every function has a pure-PyTorch counterpart
 * that the tests compare it with. Plain C11, no PyTorch headers: the build takes under a
 * second.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_DIM 1024

/* Threads: the kernels that take a `threads` argument split their work over that many
 * OpenMP threads. The library is built with OpenMP only where torch's own runtime is
 * OpenMP, and it then shares torch's copy of that runtime (one libgomp in the process):
 * the split runs on torch's intra-op threads, the ones that spin between torch's
 * operations, instead of competing with them. Every output is computed by one thread in
 * the same order whatever the count, so results do not depend on it. */
#ifdef _OPENMP
#define THREAD_ID() omp_get_thread_num()
#define THREAD_COUNT() omp_get_num_threads()
#else
#define THREAD_ID() 0
#define THREAD_COUNT() 1
#endif

/* Runs `...` for the rows (or heads, sequences, panels) r0 .. r0 + nr - 1 of `rows`: all
 * of them on this thread where the variable `threads` in scope is 1 or less, else a
 * contiguous share on each of `threads` OpenMP threads. A macro, so that each parallel
 * region (outlined into a function of its own) sees its caller's constants as constants:
 * given a type flag as an argument, `gemv`'s region ran bfloat16 2-3x slower on two threads
 * than on one. */
#define SPLIT_ROWS(rows, ...)                                                                 \
    if (threads <= 1 || (rows) < 2) {                                                         \
        const long r0 = 0, nr = (rows);                                                       \
        __VA_ARGS__                                                                           \
    } else {                                                                                  \
        _Pragma("omp parallel num_threads(threads)")                                         \
        {                                                                                     \
            const long t_ = THREAD_ID(), c_ = THREAD_COUNT();                                 \
            const long r0 = (rows) * t_ / c_, nr = (rows) * (t_ + 1) / c_ - r0;               \
            __VA_ARGS__                                                                       \
        }                                                                                     \
    }

/* Gated delta rule (Qwen3.5 / Qwen3-Next linear attention), token by token, for the value
 * heads [h0, h1) of one sequence of n tokens.
 *
 *   S <- exp(g_t) S;  delta = beta_t (v_t - S^T k_t);  S <- S + k_t delta^T;  o_t = S^T q_t
 *
 * q, k: [n, hk, dk] (value head h reads key head h / (hv / hk)); v: [n, hv, dv]; g, beta:
 * [n, hv]; each with the strides (in floats) given after it, any layout (a prompt's q, k
 * and v come channel-major out of the convolution); state: [hv, dk, dv] contiguous, updated
 * in place; out: [n, hv, dv] contiguous. A head's state (dk x dv floats) stays in cache for
 * all n tokens, and each token makes one pass over it: the update of token t, its read-out
 * and the decay and prediction of token t + 1 share the pass. Returns 0, or -1 when a
 * dimension is too large.
 */
static inline __attribute__((always_inline)) void
gdn_heads(int n, int hk, int hv, int dk, const int dv, int h0, int h1,
          const float *q, long qsn, long qsh, long qsd,
          const float *k, long ksn, long ksh, long ksd,
          const float *v, long vsn, long vsh, long vsd,
          const float *g, const float *beta, long gsn, long gsh,
          float *state, float *out)
{
    const int rep = hv / hk;
    float pred[MAX_DIM], delta[MAX_DIM], o[MAX_DIM];
    for (int h = h0; h < h1; h++) {
        float *S = state + (size_t)h * dk * dv;
        const int kh = h / rep;
        const float decay0 = expf(g[h * gsh]);
        for (int j = 0; j < dv; j++)
            pred[j] = 0.f;
        for (int i = 0; i < dk; i++) {
            float *restrict Si = S + (size_t)i * dv;
            const float ki = k[kh * ksh + i * ksd];
            for (int j = 0; j < dv; j++) {
                Si[j] *= decay0;
                pred[j] += ki * Si[j];
            }
        }
        for (int t = 0; t < n; t++) {
            const float *kt = k + t * ksn + kh * ksh;
            const float *qt = q + t * qsn + kh * qsh;
            const float *vt = v + t * vsn + h * vsh;
            const float b = beta[t * gsn + h * gsh];
            for (int j = 0; j < dv; j++) {
                delta[j] = b * (vt[j * vsd] - pred[j]);
                o[j] = 0.f;
            }
            if (t + 1 < n) {
                const float *kn = k + (t + 1) * ksn + kh * ksh;
                const float decay = expf(g[(t + 1) * gsn + h * gsh]);
                for (int j = 0; j < dv; j++)
                    pred[j] = 0.f;
                for (int i = 0; i < dk; i++) {
                    float *restrict Si = S + (size_t)i * dv;
                    const float ki = kt[i * ksd], qi = qt[i * qsd], kni = kn[i * ksd];
                    for (int j = 0; j < dv; j++) {
                        float s = Si[j] + ki * delta[j];
                        o[j] += qi * s;
                        s *= decay;
                        pred[j] += kni * s;
                        Si[j] = s;
                    }
                }
            } else {
                for (int i = 0; i < dk; i++) {
                    float *restrict Si = S + (size_t)i * dv;
                    const float ki = kt[i * ksd], qi = qt[i * qsd];
                    for (int j = 0; j < dv; j++) {
                        Si[j] += ki * delta[j];
                        o[j] += qi * Si[j];
                    }
                }
            }
            float *ot = out + ((size_t)t * hv + h) * dv;
            for (int j = 0; j < dv; j++)
                ot[j] = o[j];
        }
    }
}

static void gdn_range(int n, int hk, int hv, int dk, int dv, int h0, int h1, const float *q,
                      long qsn, long qsh, long qsd, const float *k, long ksn, long ksh,
                      long ksd, const float *v, long vsn, long vsh, long vsd, const float *g,
                      const float *beta, long gsn, long gsh, float *state, float *out)
{
    /* the common head sizes get loops of a known length: pred, delta and o in registers */
#define GDN_CALL(DV)                                                                      \
    gdn_heads(n, hk, hv, dk, DV, h0, h1, q, qsn, qsh, qsd, k, ksn, ksh, ksd, v, vsn, vsh, \
              vsd, g, beta, gsn, gsh, state, out)
    if (dv == 64)
        GDN_CALL(64);
    else if (dv == 128)
        GDN_CALL(128);
    else
        GDN_CALL(dv);
#undef GDN_CALL
}

/* All hv value heads, shared among `threads` (each head on one thread). */
int gdn_recurrent(int n, int hk, int hv, int dk, int dv,
                  const float *q, long qsn, long qsh, long qsd,
                  const float *k, long ksn, long ksh, long ksd,
                  const float *v, long vsn, long vsh, long vsd,
                  const float *g, const float *beta, long gsn, long gsh,
                  float *state, float *out, int threads)
{
    if (dv > MAX_DIM || n < 1 || hk < 1 || hv % hk)
        return -1;
#define GDN_RANGE(A, B)                                                                   \
    gdn_range(n, hk, hv, dk, dv, A, B, q, qsn, qsh, qsd, k, ksn, ksh, ksd, v, vsn, vsh,   \
              vsd, g, beta, gsn, gsh, state, out)
    SPLIT_ROWS(hv, GDN_RANGE(r0, r0 + nr);)
#undef GDN_RANGE
    return 0;
}

/* One decode step of the gated delta rule for S sequences, one token each: the arithmetic of
 * gdn_recurrent with n = 1, so a token's update is the same bit for bit in a prompt or in a
 * decode step. q, k: [S, hk, dk]; v: [S, hv, dv]; g, beta: [S, hv]; each with its strides;
 * state: [S, hv, dk, dv], each sequence's [hv, dk, dv] contiguous, sequences ss floats
 * apart (rows gathered from the pool), updated in place; out: [S, hv, dv] contiguous.
 */
int gdn_step(int seqs, int hk, int hv, int dk, int dv,
             const float *q, long qss, long qsh, long qsd,
             const float *k, long kss, long ksh, long ksd,
             const float *v, long vss, long vsh, long vsd,
             const float *g, const float *beta, long gss, long gsh,
             float *state, long ss, float *out, int threads)
{
    if (dv > MAX_DIM || hk < 1 || hv % hk)
        return -1;
    SPLIT_ROWS(seqs, {
        for (long s = r0; s < r0 + nr; s++)
            gdn_range(1, hk, hv, dk, dv, 0, hv, q + s * qss, 0, qsh, qsd, k + s * kss, 0, ksh,
                      ksd, v + s * vss, 0, vsh, vsd, g + s * gss, beta + s * gss, 0, gsh,
                      state + s * ss, out + (size_t)s * hv * dv);
    })
    return 0;
}

/* Mamba2's state space (SSD) recurrence for one token of one head:
 *
 *   S <- exp(dt a) S + (dt x) B^T;  y = S C
 *
 * S: [P, N], row stride sp (N contiguous), updated in place; x: [P], stride xp; b, c: [N];
 * y: [P]. One pass over S. Each state element becomes fma(dt x_p, B_n, decay S_pn); the sum
 * over N runs in LANES partial sums (vector lanes, each over n in order), added as a tree:
 * lanes l and l + 8, then l and l + 4, then (0 + 1) + (2 + 3) (`lanes_sum`). With AVX-512
 * (N a multiple of 16) the rows go sixteen at a time, their sums added together by shuffles
 * (`ssd_rows16`) in that same tree, so every path gives the same bits; the lane sums were
 * added one after another before, a chain of 16 scalar additions per row that took most of
 * a prompt's scan.
 */
#define LANES 16

static inline float lanes_sum(const float *acc)
{
    float s1[8], s2[4];
    for (int l = 0; l < 8; l++)
        s1[l] = acc[l] + acc[l + 8];
    for (int l = 0; l < 4; l++)
        s2[l] = s1[l] + s1[l + 4];
    return (s2[0] + s2[1]) + (s2[2] + s2[3]);
}

#ifdef __AVX512F__
/* Sixteen rows p .. p + 15 of ssd_token, N a multiple of 16: the rows' lane sums (one
 * vector each) are reduced together, four shuffle-and-add levels for all sixteen. Level by
 * level this is lanes_sum's tree: (1) l + (l + 8), (2) l + (l + 4), (3) 0 + 1 and 2 + 3,
 * (4) their sum; row r's result ends in lane 4 (r % 4) + r / 4. */
static inline __attribute__((always_inline)) void
ssd_rows16(float *S, long sp, const int ns, const float *x, long xp, float d, float decay,
           const float *bn, const float *cn, float *y)
{
    __m512 acc[16], b8[8], c4[4], d2[2];
    const __m512 dec = _mm512_set1_ps(decay);
    for (int r = 0; r < 16; r++) {
        float *row = S + r * sp;
        const __m512 u = _mm512_set1_ps(x[r * xp] * d);
        __m512 a = _mm512_setzero_ps();
        for (int n = 0; n < ns; n += 16) {
            const __m512 kept = _mm512_mul_ps(_mm512_loadu_ps(row + n), dec);
            const __m512 v = _mm512_fmadd_ps(u, _mm512_loadu_ps(bn + n), kept);
            _mm512_storeu_ps(row + n, v);
            a = _mm512_fmadd_ps(v, _mm512_loadu_ps(cn + n), a);
        }
        acc[r] = a;
    }
    for (int i = 0; i < 8; i++) /* [r.lo8 sums | r+1.lo8 sums] */
        b8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* quarter q: 4 sums of row 4 i + q */
        c4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b8[2 * i], b8[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(b8[2 * i], b8[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* quarter q: 2 sums of rows 8 i + q and 8 i + 4 + q */
        d2[i] = _mm512_add_ps(_mm512_shuffle_ps(c4[2 * i], c4[2 * i + 1], 0x88),
                              _mm512_shuffle_ps(c4[2 * i], c4[2 * i + 1], 0xDD));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d2[0], d2[1], 0x88),
                                   _mm512_shuffle_ps(d2[0], d2[1], 0xDD));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    _mm512_storeu_ps(y, _mm512_permutexvar_ps(order, e));
}
#endif

static inline __attribute__((always_inline)) void
ssd_token(float *S, long sp, int hd, const int ns, const float *x, long xp, float d,
          float decay, const float *bn, const float *cn, float *y)
{
    int p = 0;
#ifdef __AVX512F__
    if (ns % 16 == 0)
        for (; p + 16 <= hd; p += 16)
            ssd_rows16(S + p * sp, sp, ns, x + p * xp, xp, d, decay, bn, cn, y + p);
#endif
    for (; p < hd; p++) {
        float *restrict row = S + p * sp;
        const float u = x[p * xp] * d;
        float acc[LANES] = {0};
        int n = 0;
        for (; n + LANES <= ns; n += LANES)
            for (int l = 0; l < LANES; l++) {
                const float v = fmaf(u, bn[n + l], row[n + l] * decay);
                row[n + l] = v;
                acc[l] = fmaf(v, cn[n + l], acc[l]);
            }
        for (; n < ns; n++) {
            const float v = fmaf(u, bn[n], row[n] * decay);
            row[n] = v;
            acc[0] = fmaf(v, cn[n], acc[0]);
        }
        y[p] = lanes_sum(acc);
    }
}

/* One decode step for S sequences of H heads, one token each. state: [S, H, P, N] float32,
 * strides ss, sh, sp (N contiguous; rows gathered from the pool may be strided), updated in
 * place; x: [S, H, P], strides xs, xh, xp; dt: [S, H], strides ds, dh; a: [H]; b, c:
 * [S, G, N], strides bs, bg (N contiguous; head h reads group h / (H / G)); y: [S, H, P]
 * contiguous.
 */
static inline __attribute__((always_inline)) void
ssd_rows(int seqs, int heads, int hd, const int ns, int groups,
         float *state, long ss, long sh, long sp,
         const float *x, long xs, long xh, long xp, const float *dt, long ds, long dh,
         const float *a, const float *b, const float *c, long bs, long bg, float *y)
{
    const int per = heads / groups;
    for (int s = 0; s < seqs; s++)
        for (int h = 0; h < heads; h++) {
            const float d = dt[s * ds + h * dh];
            const long bo = s * bs + (h / per) * bg;
            ssd_token(state + s * ss + h * sh, sp, hd, ns, x + s * xs + h * xh, xp, d,
                      expf(d * a[h]), b + bo, c + bo, y + ((size_t)s * heads + h) * hd);
        }
}

int ssd_step(int seqs, int heads, int hd, int ns, int groups,
             float *state, long ss, long sh, long sp,
             const float *x, long xs, long xh, long xp, const float *dt, long ds, long dh,
             const float *a, const float *b, const float *c, long bs, long bg, float *y,
             int threads)
{
    if (seqs < 0 || groups < 1 || heads % groups)
        return -1;
#define SSD_CALL(NS)                                                                      \
    ssd_rows(nr, heads, hd, NS, groups, state + r0 * ss, ss, sh, sp, x + r0 * xs, xs, xh, \
             xp, dt + r0 * ds, ds, dh, a, b + r0 * bs, c + r0 * bs, bs, bg,               \
             y + (size_t)r0 * heads * hd)
    if (ns == 64) {
        SPLIT_ROWS(seqs, SSD_CALL(64);)
    } else if (ns == 128) {
        SPLIT_ROWS(seqs, SSD_CALL(128);)
    } else {
        SPLIT_ROWS(seqs, SSD_CALL(ns);)
    }
#undef SSD_CALL
    return 0;
}

/* A prompt's scan: S sequences packed one after another (sequence i has lengths[i] tokens),
 * token by token, heads [h0, h1) only. state: [S, H, P, N] contiguous, each sequence's state
 * at its start, updated in place to the state at its end; x: [T, H, P], strides xt, xh, xp;
 * dt: [T, H], strides dtt, dth; a: [H]; b, c: [T, G, N], strides bt, bg (N contiguous); y:
 * [T, H, P] contiguous. A head's state (P x N floats) stays in cache for all of a
 * sequence's tokens.
 */
static inline __attribute__((always_inline)) void
ssd_heads(int seqs, const int *lengths, int heads, int hd, const int ns, int groups, int h0,
          int h1, float *state, const float *x, long xt, long xh, long xp, const float *dt,
          long dtt, long dth, const float *a, const float *b, const float *c, long bt, long bg,
          float *y)
{
    const int per = heads / groups;
    long first = 0;
    for (int s = 0; s < seqs; s++) {
        for (int h = h0; h < h1; h++) {
            float *S = state + (((size_t)s * heads + h) * hd) * ns;
            for (long t = first; t < first + lengths[s]; t++) {
                const float d = dt[t * dtt + h * dth];
                const long bo = t * bt + (h / per) * bg;
                ssd_token(S, ns, hd, ns, x + t * xt + h * xh, xp, d, expf(d * a[h]), b + bo,
                          c + bo, y + ((size_t)t * heads + h) * hd);
            }
        }
        first += lengths[s];
    }
}

static void ssd_range(int seqs, const int *lengths, int heads, int hd, int ns, int groups,
                      int h0, int h1, float *state, const float *x, long xt, long xh, long xp,
                      const float *dt, long dtt, long dth, const float *a, const float *b,
                      const float *c, long bt, long bg, float *y)
{
#define SCAN_CALL(NS)                                                                      \
    ssd_heads(seqs, lengths, heads, hd, NS, groups, h0, h1, state, x, xt, xh, xp, dt, dtt, \
              dth, a, b, c, bt, bg, y)
    if (ns == 64)
        SCAN_CALL(64);
    else if (ns == 128)
        SCAN_CALL(128);
    else
        SCAN_CALL(ns);
#undef SCAN_CALL
}

/* All heads, shared among `threads` (each head on one thread). */
int ssd_scan(int seqs, const int *lengths, int heads, int hd, int ns, int groups,
             float *state, const float *x, long xt, long xh, long xp, const float *dt,
             long dtt, long dth, const float *a, const float *b, const float *c, long bt,
             long bg, float *y, int threads)
{
    if (seqs < 0 || groups < 1 || heads % groups)
        return -1;
#define SCAN_RANGE(A, B)                                                                   \
    ssd_range(seqs, lengths, heads, hd, ns, groups, A, B, state, x, xt, xh, xp, dt, dtt,   \
              dth, a, b, c, bt, bg, y)
    SPLIT_ROWS(heads, SCAN_RANGE(r0, r0 + nr);)
#undef SCAN_RANGE
    return 0;
}

/* ------------------------------------------------------------------ element-wise */

static inline float bits_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t float_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bf16_float(uint16_t b) { return bits_float((uint32_t)b << 16); }

/* Round to the nearest bfloat16, ties to even (as PyTorch converts); NaN stays NaN. */
static inline uint16_t float_bf16(float f)
{
    if (f != f)
        return 0x7fc0;
    uint32_t u = float_bits(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* e^x within 2 ulp, in a form the compiler vectorises (no libm call): 2^n 2^f with n the
 * nearest integer to x log2(e) and |f| <= 1/2, 2^f from its Taylor series to degree 7
 * (error below 1e-8 relative). x is clamped to [-87.3, 88.7] (no overflow, no subnormals).
 */
static inline float exp_vec(float x)
{
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    const float t = x * 1.44269504088896341f;
    const float n = (t + 12582912.f) - 12582912.f; /* round to nearest (1.5 * 2^23) */
    const float y = (t - n) * 0.693147180559945309f;
    float p = 1.f / 5040.f;
    p = p * y + 1.f / 720.f;
    p = p * y + 1.f / 120.f;
    p = p * y + 1.f / 24.f;
    p = p * y + 1.f / 6.f;
    p = p * y + 0.5f;
    p = p * y + 1.f;
    p = p * y + 1.f;
    return p * bits_float((uint32_t)((int32_t)n + 127) << 23);
}

static inline float silu(float x) { return x / (1.f + exp_vec(-x)); }

/* GELU's tanh form, 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3), written
 * as x / (1 + e^(-2u)): the same function, without tanh's cancellation near 0. */
static inline float gelu_tanh(float x)
{
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return x / (1.f + exp_vec(-2.f * u));
}

static inline __attribute__((always_inline)) float load_as(const void *p, long i, int bf16)
{
    return bf16 ? bf16_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) float round_as(float f, int bf16)
{
    return bf16 ? bf16_float(float_bf16(f)) : f;
}

static inline __attribute__((always_inline)) void store_as(void *p, long i, float f, int bf16)
{
    if (bf16)
        ((uint16_t *)p)[i] = float_bf16(f);
    else
        ((float *)p)[i] = f;
}

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
 * in LANES partial sums.
 */
static inline __attribute__((always_inline)) void
gate_norm(long tokens, int inner, int group, const float *y, long ys, const void *z, long zs,
          const void *w, float eps, float *out, const int bf16)
{
    float h[MAX_DIM];
    for (long t = 0; t < tokens; t++)
        for (int g0 = 0; g0 < inner; g0 += group) {
            const float *yr = y + t * ys + g0;
            const long zo = t * zs + g0;
            for (int j = 0; j < group; j++)
                h[j] = yr[j] * silu(load_as(z, zo + j, bf16));
            const float r = 1.f / sqrtf(sum_squares(h, 0, group, 0) / (float)group + eps);
            float *o = out + t * (long)inner + g0;
            for (int j = 0; j < group; j++)
                o[j] = load_as(w, g0 + j, bf16) * (h[j] * r);
        }
}

#define GATE_NORM_ROWS(bf16)                                                                  \
    SPLIT_ROWS(tokens, gate_norm(nr, inner, group, y + r0 * ys, ys, z + r0 * zs, zs, w, eps,   \
                                 out + r0 * inner, bf16);)

int gate_norm_f32(long tokens, int inner, int group, const float *y, long ys, const float *z,
                  long zs, const float *w, float eps, float *out, int threads)
{
    if (group > MAX_DIM || group < 1 || inner % group)
        return -1;
    GATE_NORM_ROWS(0)
    return 0;
}

int gate_norm_bf16(long tokens, int inner, int group, const float *y, long ys,
                   const uint16_t *z, long zs, const uint16_t *w, float eps, float *out,
                   int threads)
{
    if (group > MAX_DIM || group < 1 || inner % group)
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

/* ------------------------------------------------------------------ causal convolution */

/* A prompt's depthwise causal convolution, then SiLU (Mamba2's conv1d): out[t][c] =
 * silu(bias[c] + sum over k < taps of x[first[t] + k][c] w[k][c]), the sum taken tap after
 * tap from the bias (as PyTorch's shifted multiply-adds take it). x: rows xs elements apart,
 * channels contiguous (the sequences' windows, K - 1 earlier inputs then the new ones);
 * first[t]: the window row of output t's first tap; w: [taps][channels]; bias: [channels] or
 * NULL; out: [rows][channels] contiguous. One pass where PyTorch wrote the whole
 * convolution K times, picked its rows and ran SiLU over them. */
static inline __attribute__((always_inline)) void
conv_silu(long rows, long channels, int taps, const float *x, long xs, const long *first,
          const float *w, const float *bias, float *out)
{
    for (long t = 0; t < rows; t++) {
        const float *xr = x + first[t] * xs;
        float *o = out + t * channels;
        for (long c = 0; c < channels; c++)
            o[c] = bias ? bias[c] : 0.f;
        for (int k = 0; k < taps; k++) {
            const float *xk = xr + k * xs, *wk = w + (long)k * channels;
            for (long c = 0; c < channels; c++)
                o[c] += xk[c] * wk[c];
        }
        for (long c = 0; c < channels; c++)
            o[c] = silu(o[c]);
    }
}

/* One token of each of S sequences through the same convolution and SiLU, with the same
 * arithmetic per output as conv_silu (the bias, then the taps oldest first, then SiLU), so
 * a token's output does not depend on whether it came in a prompt or a decode step. state:
 * [S][channels][taps - 1] (sequences ss elements apart; the taps - 1 latest inputs, oldest
 * first), shifted in place to take the new input; x: [S][channels] (rows xs apart); w:
 * [channels][taps] (conv1d's weight); bias: [channels] or NULL; out: [S][channels]. */
static inline __attribute__((always_inline)) void
conv_step_silu(long seqs, long channels, int taps, float *state, long ss, const float *x,
               long xs, const float *w, const float *bias, float *out)
{
    const int kept = taps - 1;
    for (long s = 0; s < seqs; s++) {
        float *st = state + s * ss, *o = out + s * channels;
        const float *xr = x + s * xs;
        for (long c = 0; c < channels; c++)
            o[c] = bias ? bias[c] : 0.f;
        for (int k = 0; k < kept; k++)
            for (long c = 0; c < channels; c++)
                o[c] += st[c * kept + k] * w[c * taps + k];
        for (long c = 0; c < channels; c++)
            o[c] += xr[c] * w[c * taps + kept];
        for (long c = 0; c < channels; c++)
            o[c] = silu(o[c]);
        for (long c = 0; c < channels; c++) {
            for (int k = 0; k + 1 < kept; k++)
                st[c * kept + k] = st[c * kept + k + 1];
            if (kept > 0)
                st[c * kept + kept - 1] = xr[c];
        }
    }
}

void conv_step_silu_f32(long seqs, long channels, int taps, float *state, long ss,
                        const float *x, long xs, const float *w, const float *bias, float *out,
                        int threads)
{
    SPLIT_ROWS(seqs, conv_step_silu(nr, channels, taps, state + r0 * ss, ss, x + r0 * xs, xs, w,
                                    bias, out + r0 * channels);)
}

void conv_silu_f32(long rows, long channels, int taps, const float *x, long xs,
                   const long *first, const float *w, const float *bias, float *out, int threads)
{
    SPLIT_ROWS(rows, conv_silu(nr, channels, taps, x, xs, first + r0, w, bias,
                               out + r0 * channels);)
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

/* ------------------------------------------------------------------ one-row linear */

/* y = W x + bias for one input row, rows [r0, r1) of W: [n, k] row-major (float32, or
 * bfloat16 widened as it is read), x: [k] float32, bias: [n] (same type as W) or NULL, y:
 * float32 or, for bfloat16, rounded to bfloat16. Four rows at a time in LANES partial sums
 * each, added in a fixed order at the end.
 *
 * A decode step of one sequence reads every weight once: it runs at the memory's speed. One
 * core's hardware prefetchers keep too few lines in flight for that, so while a group of
 * four rows is summed the next group is prefetched in step (about 1.5-2x a library GEMM's
 * bandwidth for one row on the machines measured). */
static inline __attribute__((always_inline)) void
gemv(long k, const void *w, const float *x, const void *bias, void *y, long r0, long r1,
     const int bf16)
{
    const long es = bf16 ? 2 : 4, row_bytes = k * es;
    long i = r0;
    for (; i + 4 <= r1; i += 4) {
        const char *rows = (const char *)w + i * row_bytes;
        const char *ahead = rows + 4 * row_bytes;
        const int prefetch = i + 8 <= r1;
        float a0[LANES] = {0}, a1[LANES] = {0}, a2[LANES] = {0}, a3[LANES] = {0};
        long j = 0;
        for (; j + LANES <= k; j += LANES) {
            if (prefetch)
                for (long o = 4 * j * es; o < 4 * (j + LANES) * es; o += 64)
                    __builtin_prefetch(ahead + o, 0, 0);
            for (int l = 0; l < LANES; l++) {
                const float xv = x[j + l];
                a0[l] += load_as(rows, j + l, bf16) * xv;
                a1[l] += load_as(rows + row_bytes, j + l, bf16) * xv;
                a2[l] += load_as(rows + 2 * row_bytes, j + l, bf16) * xv;
                a3[l] += load_as(rows + 3 * row_bytes, j + l, bf16) * xv;
            }
        }
        for (; j < k; j++) {
            a0[0] += load_as(rows, j, bf16) * x[j];
            a1[0] += load_as(rows + row_bytes, j, bf16) * x[j];
            a2[0] += load_as(rows + 2 * row_bytes, j, bf16) * x[j];
            a3[0] += load_as(rows + 3 * row_bytes, j, bf16) * x[j];
        }
        float s[4] = {0.f, 0.f, 0.f, 0.f};
        for (int l = 0; l < LANES; l++) {
            s[0] += a0[l];
            s[1] += a1[l];
            s[2] += a2[l];
            s[3] += a3[l];
        }
        for (int r = 0; r < 4; r++)
            store_as(y, i + r, s[r] + (bias ? load_as(bias, i + r, bf16) : 0.f), bf16);
    }
    for (; i < r1; i++) {
        const char *row = (const char *)w + i * row_bytes;
        float acc[LANES] = {0};
        long j = 0;
        for (; j + LANES <= k; j += LANES)
            for (int l = 0; l < LANES; l++)
                acc[l] += load_as(row, j + l, bf16) * x[j + l];
        for (; j < k; j++)
            acc[0] += load_as(row, j, bf16) * x[j];
        float v = 0.f;
        for (int l = 0; l < LANES; l++)
            v += acc[l];
        store_as(y, i, v + (bias ? load_as(bias, i, bf16) : 0.f), bf16);
    }
}

/* gemv over the n output rows, split over `threads` in groups of four rows (its unit). */
#define GEMV_ROWS(bf16)                                                                       \
    SPLIT_ROWS((n + 3) / 4,                                                                   \
               gemv(k, w, x, bias, y, 4 * r0, 4 * (r0 + nr) < n ? 4 * (r0 + nr) : n, bf16);)

void gemv_f32(long k, const float *w, const float *x, const float *bias, float *y, long n,
              int threads)
{
    GEMV_ROWS(0)
}

void gemv_bf16(long k, const uint16_t *w, const float *x, const uint16_t *bias, uint16_t *y,
               long n, int threads)
{
    GEMV_ROWS(1)
}
#undef GEMV_ROWS

/* ------------------------------------------------------------------ decode attention */

/* Ask for `span` bytes from `row` ahead of their use. */
static inline __attribute__((always_inline)) void prefetch_row(const char *row, long span)
{
    for (long o = 0; o < span; o += 64)
        __builtin_prefetch(row + o, 0, 0);
}

/* Runs `...` for each block's share of the slots a .. b of a sequence's run of blocks:
 * `row` (the share's first slot, KV head 0, plus `extra` elements), `count` slots from t =
 * slot - a; for the body's prefetches, `next` (the next block's first slot plus `extra`,
 * NULL where no slot of it is read) and `nahead` (how many of its slots are). */
#define FOR_RUNS(extra, ...)                                                                   \
    for (int t = 0, slot = a, count = 0; slot <= b; slot += count, t += count) {               \
        const int k = slot / bs, first = slot % bs;                                            \
        count = ((k + 1) * bs - 1 < b ? (k + 1) * bs - 1 : b) - slot + 1;                      \
        const char *row = (const char *)cache + (blocks[k] * cn + first * cb + (extra)) * es;  \
        const int ahead = b - (k + 1) * bs + 1;                                                \
        const char *next =                                                                     \
            ahead > 0 ? (const char *)cache + (blocks[k + 1] * cn + (extra)) * es : NULL;      \
        const int nahead = ahead < bs ? ahead : bs;                                            \
        __VA_ARGS__                                                                            \
    }

/* Partial sums of a score: 8 (a 256-bit vector) measured faster than 16 or 4 here, the
 * sums of 16 lanes going through memory. */
#define SCORE_LANES 8

/* A score: scale (q . k) over d, SCORE_LANES partial sums added in halves, softcapped where
 * softcap > 0 (tanh(x) = 1 - 2 / (e^(2x) + 1)). */
static inline __attribute__((always_inline)) float
finish_score(float *acc, float scale, float softcap)
{
    for (int w = SCORE_LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++)
            acc[l] += acc[l + w];
    const float x = acc[0] * scale;
    return softcap > 0.f ? softcap * (1.f - 2.f / (exp_vec(2.f * x / softcap) + 1.f)) : x;
}

static inline __attribute__((always_inline)) void
score1(const float *q, const int d, const char *k, float scale, float softcap, float *p,
       const int bf16)
{
    float acc[SCORE_LANES] = {0};
    int j = 0;
    for (; j + SCORE_LANES <= d; j += SCORE_LANES)
        for (int l = 0; l < SCORE_LANES; l++)
            acc[l] += q[j + l] * load_as(k, j + l, bf16);
    for (; j < d; j++)
        acc[0] += q[j] * load_as(k, j, bf16);
    *p = finish_score(acc, scale, softcap);
}

/* score1 for the four queries q, q + d, q + 2d, q + 3d against one key: each key element
 * read once. The scores go to p, p + stride, ... */
static inline __attribute__((always_inline)) void
score4(const float *q, const int d, const char *k, float scale, float softcap, float *p,
       long stride, const int bf16)
{
    float a0[SCORE_LANES] = {0}, a1[SCORE_LANES] = {0};
    float a2[SCORE_LANES] = {0}, a3[SCORE_LANES] = {0};
    int j = 0;
    for (; j + SCORE_LANES <= d; j += SCORE_LANES)
        for (int l = 0; l < SCORE_LANES; l++) {
            const float kv = load_as(k, j + l, bf16);
            a0[l] += q[j + l] * kv;
            a1[l] += q[d + j + l] * kv;
            a2[l] += q[2 * d + j + l] * kv;
            a3[l] += q[3 * d + j + l] * kv;
        }
    for (; j < d; j++) {
        const float kv = load_as(k, j, bf16);
        a0[0] += q[j] * kv;
        a1[0] += q[d + j] * kv;
        a2[0] += q[2 * d + j] * kv;
        a3[0] += q[3 * d + j] * kv;
    }
    p[0] = finish_score(a0, scale, softcap);
    p[stride] = finish_score(a1, scale, softcap);
    p[2 * stride] = finish_score(a2, scale, softcap);
    p[3 * stride] = finish_score(a3, scale, softcap);
}

/* o[e] += sum over r < count of w[e keys + r] v_r for e < 4, v_r the `d` values at
 * v + r stride bytes: the sums stay in registers over a block's slots, LANES columns at a
 * time. keys = 0: the four rows are one (o and w the same for each e; the caller adds one). */
static inline __attribute__((always_inline)) void
values4(float *o, const int d, const char *v, long stride, int count, const float *w, long keys,
        const int bf16)
{
    const int rows = keys ? 4 : 1;
    int j0 = 0;
    for (; j0 + LANES <= d; j0 += LANES) {
        float a[4][LANES];
        for (int e = 0; e < rows; e++)
            for (int l = 0; l < LANES; l++)
                a[e][l] = o[e * d + j0 + l];
        for (int r = 0; r < count; r++) {
            const char *vr = v + r * stride;
            if (keys) {
                const float w0 = w[r], w1 = w[keys + r], w2 = w[2 * keys + r];
                const float w3 = w[3 * keys + r];
                for (int l = 0; l < LANES; l++) {
                    const float x = load_as(vr, j0 + l, bf16);
                    a[0][l] += w0 * x;
                    a[1][l] += w1 * x;
                    a[2][l] += w2 * x;
                    a[3][l] += w3 * x;
                }
            } else {
                const float w0 = w[r];
                for (int l = 0; l < LANES; l++)
                    a[0][l] += w0 * load_as(vr, j0 + l, bf16);
            }
        }
        for (int e = 0; e < rows; e++)
            for (int l = 0; l < LANES; l++)
                o[e * d + j0 + l] = a[e][l];
    }
    for (int r = 0; r < count; r++) /* the columns past the last whole LANES */
        for (int e = 0; e < rows; e++)
            for (int j = j0; j < d; j++)
                o[e * d + j] += w[e * keys + r] * load_as(v + r * stride, j, bf16);
}

/* Attention of one new token per sequence over its keys in the paged pool, read where they
 * lie (no gather into a padded copy, no mask: a sequence reads exactly its visible slots).
 *
 * q: [S, Hq, D] (rows qs, heads qh elements apart; D contiguous). The pool holds K and V of
 * slot b of block n, head h, at cache + n cn + b cb + h ch (V: + ckv), D contiguous. Sequence
 * s reads the blocks read[s W .. s W + W - 1] as one run of W bs slots, of which slots
 * lo[s] .. hi[s] are visible. Query heads h G .. h G + G - 1 share KV head h (G = Hq / Hkv).
 * softcap > 0: scores become tanh(score / softcap) softcap. sinks (or NULL): a float32
 * logit per query head that joins the softmax's denominator with no value. out: [S, Hq, D]
 * contiguous, in q's type. q, the pool and out are all float32 or all bfloat16; the sums are
 * float32. `scratch`: Hq (D + W bs) floats.
 *
 * A sequence's keys are read once, slot after slot with every KV head of the slot (the
 * pool's rows in order), the row one block ahead prefetched: the step waits on memory, and
 * the keys of a batch do not stay in the cache from one layer to the next. Scores in
 * SCORE_LANES partial sums over D (added in halves), four query heads per key read; the
 * softmax with one max and `exp_vec`; then the values, read the same way, the output sums
 * of four query heads in registers over a block's slots (`values4`). */
static inline __attribute__((always_inline)) void
decode_attention(int hq, int hkv, const int d, int bs, int width, const void *q, long qs,
                 long qh, const void *cache, long cn, long ckv, long cb, long ch,
                 const long *read, const int *lo, const int *hi, float scale, float softcap,
                 const float *sinks, void *out, long seqs, float *scratch, const int bf16)
{
    const int g = hq / hkv;
    const long es = bf16 ? 2 : 4, keys = (long)width * bs;
    const long span = ((long)(hkv - 1) * ch + d) * es;
    float *qv = scratch, *p = scratch + (long)hq * d;
    for (long s = 0; s < seqs; s++) {
        const long *blocks = read + s * width;
        const int a = lo[s], b = hi[s], n = b - a + 1;
        for (int i = 0; i < hq; i++)
            for (int j = 0; j < d; j++)
                qv[i * d + j] = load_as(q, s * qs + i * qh + j, bf16);
        FOR_RUNS(0, {
            for (int r = 0; r < count; r++) {
                if (next)
                    for (int x = r * nahead / count; x < (r + 1) * nahead / count; x++)
                        prefetch_row(next + x * cb * es, span);
                for (int h = 0, i = 0; h < hkv; h++) {
                    const char *kp = row + (r * cb + h * ch) * es;
                    float *pt = p + (long)i * keys + t + r;
                    int e = 0;
                    for (; e + 4 <= g; e += 4, i += 4, pt += 4 * keys) /* 4 queries a read */
                        score4(qv + i * d, d, kp, scale, softcap, pt, keys, bf16);
                    for (; e < g; e++, i++, pt += keys)
                        score1(qv + i * d, d, kp, scale, softcap, pt, bf16);
                }
            }
        })
        float *o = qv; /* the queries are read: their floats hold the output sums */
        for (int i = 0; i < hq; i++) {
            float *pi = p + (long)i * keys;
            float m = sinks ? sinks[i] : -INFINITY;
            for (int t = 0; t < n; t++)
                m = pi[t] > m ? pi[t] : m;
            float total = sinks ? exp_vec(sinks[i] - m) : 0.f;
            for (int t = 0; t < n; t++) {
                pi[t] = exp_vec(pi[t] - m);
                total += pi[t];
            }
            const float inv = 1.f / total;
            for (int t = 0; t < n; t++)
                pi[t] *= inv;
            for (int j = 0; j < d; j++)
                o[i * d + j] = 0.f;
        }
        FOR_RUNS(ckv, {
            if (next)
                prefetch_row(next, (nahead - 1) * cb * es + span);
            for (int h = 0, i = 0; h < hkv; h++) {
                const char *vp = row + h * ch * es;
                int e = 0;
                for (; e + 4 <= g; e += 4, i += 4) /* four query heads per value read */
                    values4(o + i * d, d, vp, cb * es, count, p + (long)i * keys + t, keys, bf16);
                for (; e < g; e++, i++)
                    values4(o + i * d, d, vp, cb * es, count, p + (long)i * keys + t, 0, bf16);
            }
        })
        for (int i = 0; i < hq; i++)
            for (int j = 0; j < d; j++)
                store_as(out, (s * hq + i) * (long)d + j, o[i * d + j], bf16);
    }
}
#undef FOR_RUNS

#define DECODE_ATTENTION(name, type, bf16)                                                     \
    int name(int hq, int hkv, int d, int bs, int width, const type *q, long qs, long qh,      \
             const type *cache, long cn, long ckv, long cb, long ch, const long *read,         \
             const int *lo, const int *hi, float scale, float softcap, const float *sinks,     \
             type *out, long seqs, int threads)                                               \
    {                                                                                         \
        if (hkv <= 0 || hq % hkv || d <= 0 || bs <= 0 || width <= 0)                           \
            return 1;                                                                         \
        int failed = 0;                                                                       \
        SPLIT_ROWS(seqs, {                                                                    \
            float *scratch =                                                                  \
                malloc(sizeof(float) * (size_t)hq * ((size_t)d + (size_t)width * bs));        \
            if (!scratch) {                                                                   \
                _Pragma("omp atomic write") failed = 1;                                       \
            } else if (nr > 0) {                                                              \
                decode_attention(hq, hkv, d, bs, width, q + r0 * qs, qs, qh, cache, cn, ckv,  \
                                 cb, ch, read + r0 * width, lo + r0, hi + r0, scale, softcap, \
                                 sinks, out + r0 * hq * d, nr, scratch, bf16);                \
            }                                                                                 \
            free(scratch);                                                                    \
        })                                                                                    \
        return failed ? 2 : 0;                                                                \
    }
DECODE_ATTENTION(decode_attention_f32, float, 0)
DECODE_ATTENTION(decode_attention_bf16, uint16_t, 1)
#undef DECODE_ATTENTION

/* ------------------------------------------------------------------ panel linear */

/* Output columns per panel: two 512-bit vectors (four 256-bit ones). */
#define PANEL 32
/* Input rows per tile: 8 rows x 32 columns of sums stay in 16 512-bit registers. */
#define TILE_ROWS 8

/* rows x PANEL outputs of one panel: y[r][l] = bias[l] + sum over j of x[r][j] w[j][l], each
 * sum in float32 over j in order (one fused multiply-add per term): a row's result does not
 * depend on the other rows of the call, nor on how many there are. */
static inline __attribute__((always_inline)) void
panel_tile(const int rows, long k, const float *w, const float *x, long xs, const float *bias,
           float *y, long ys, int cols)
{
    float acc[TILE_ROWS][PANEL];
    for (int r = 0; r < rows; r++)
        for (int l = 0; l < PANEL; l++)
            acc[r][l] = 0.f;
    for (long j = 0; j < k; j++) {
        const float *wj = w + j * PANEL;
        for (int r = 0; r < rows; r++) {
            const float xv = x[r * xs + j];
            for (int l = 0; l < PANEL; l++)
                acc[r][l] += xv * wj[l];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int l = 0; l < cols; l++)
            y[r * ys + l] = acc[r][l] + (bias ? bias[l] : 0.f);
}

/* Bytes of x a block of rows may take: the block stays in the core's L2 cache while every
 * panel passes over it (many rows re-read from memory per panel cost 5-10% at 8,192 rows). */
#define ROW_BLOCK_BYTES (256 * 1024)

/* y = x W^T + bias for m rows of x (xs elements apart, k contiguous) into y [m, n]
 * (contiguous), W [n, k] packed as panels [ceil(n / PANEL), k, PANEL] (panel p holds
 * columns p PANEL .. p PANEL + PANEL - 1, zero past n).
 *
 * A panel's weights are read in order, once per TILE_ROWS rows of x (from the cache after
 * the first), and every sum stays in a register until it is stored: no sums across vector
 * lanes, no partial products in memory. For the few rows of a decode step this reads the
 * weights at about the memory's speed (a library GEMM's small-row kernels ran at 12-14 GB/s
 * here); for many rows it is bound by the multiply-adds, as a library's is, and the rows
 * go in blocks that stay in the cache while the panels pass. */
static void panel_range(long m, long n, long k, const float *panels, const float *x, long xs,
                        const float *bias, float *y, long p0, long p1)
{
    long block = ROW_BLOCK_BYTES / (long)sizeof(float) / (k > 0 ? k : 1) / TILE_ROWS * TILE_ROWS;
    block = block < TILE_ROWS ? TILE_ROWS : block;
    for (long b0 = 0; b0 < m; b0 += block) {
        const long b1 = b0 + block < m ? b0 + block : m;
        for (long p = p0; p < p1; p++) {
            const float *w = panels + p * k * PANEL;
            const int cols = n - p * PANEL < PANEL ? (int)(n - p * PANEL) : PANEL;
            const float *b = bias ? bias + p * PANEL : NULL;
            for (long r0 = b0; r0 < b1; r0 += TILE_ROWS) {
                const float *xr = x + r0 * xs;
                float *yr = y + r0 * n + p * PANEL;
                switch (b1 - r0 < TILE_ROWS ? (int)(b1 - r0) : TILE_ROWS) {
#define TILE(R)                                                                                \
    case R:                                                                                    \
        panel_tile(R, k, w, xr, xs, b, yr, n, cols);                                           \
        break;
                    TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
#undef TILE
                }
            }
        }
    }
}

/* The panels are shared among `threads` (each thread all rows of its own panels, in the
 * same blocks: no thread waits for another). */
void panel_linear_f32(long m, long n, long k, const float *panels, const float *x, long xs,
                      const float *bias, float *y, int threads)
{
    const long count = (n + PANEL - 1) / PANEL;
    SPLIT_ROWS(count, panel_range(m, n, k, panels, x, xs, bias, y, r0, r0 + nr);)
}

/* ------------------------------------------------------------------ prompt attention */

/* Keys per chunk of a prompt's attention (one running max and sum update per row and
 * chunk), computed in tiles of PANEL keys by panel_tile: the chunk's keys transposed into
 * panels ([d][PANEL] each) are the weights, the queries the rows, so TILE_ROWS rows of
 * PANEL scores stay in registers while the keys pass. The value sums take the same tiles
 * (values_tile). */
#define KEY_CHUNK 64
/* Score rows (query tokens times the query heads of one KV head) per unit of work. */
#define ROWS_TARGET 128

/* o[r][:] += sum over c < kc of p[r][c] v[c][:] for R rows (p rows KEY_CHUNK apart, v
 * [kc][d] contiguous), PANEL columns of o at a time in registers. */
static inline __attribute__((always_inline)) void
values_tile(const int R, const float *p, const int kc, const float *v, const int d, float *o)
{
    int j0 = 0;
    for (; j0 + PANEL <= d; j0 += PANEL) {
        float acc[TILE_ROWS][PANEL];
        for (int r = 0; r < R; r++)
            for (int l = 0; l < PANEL; l++)
                acc[r][l] = o[r * d + j0 + l];
        for (int c = 0; c < kc; c++) {
            const float *vc = v + (long)c * d + j0;
            for (int r = 0; r < R; r++) {
                const float w = p[r * KEY_CHUNK + c];
                for (int l = 0; l < PANEL; l++)
                    acc[r][l] += w * vc[l];
            }
        }
        for (int r = 0; r < R; r++)
            for (int l = 0; l < PANEL; l++)
                o[r * d + j0 + l] = acc[r][l];
    }
    for (int r = 0; r < R; r++) /* the columns past the last whole PANEL */
        for (int c = 0; c < kc; c++)
            for (int j = j0; j < d; j++)
                o[r * d + j] += p[r * KEY_CHUNK + c] * v[(long)c * d + j];
}

/* Runs call(R) for the rows in tiles of TILE_ROWS (the last one R = what is left), r8 the
 * tile's first row. */
#define BY_TILES(rows, call)                                                                  \
    for (int r8 = 0; r8 < (rows); r8 += TILE_ROWS) {                                          \
        switch ((rows) - r8 < TILE_ROWS ? (rows) - r8 : TILE_ROWS) {                          \
        case 1: call(1); break;                                                               \
        case 2: call(2); break;                                                               \
        case 3: call(3); break;                                                               \
        case 4: call(4); break;                                                               \
        case 5: call(5); break;                                                               \
        case 6: call(6); break;                                                               \
        case 7: call(7); break;                                                               \
        default: call(8); break;                                                              \
        }                                                                                     \
    }

/* One score row's chunk (KEY_CHUNK floats, the visible ones c0 .. c1 - 1) made weights
 * under the row's running max *m and sum *l (online softmax): scaled, softcapped, the max
 * and the sum taken in LANES partial results added in halves. Returns what the row's
 * earlier output sums must be multiplied by (the old max's weight under the new). */
static inline __attribute__((always_inline)) float
chunk_weights(float *sr, int c0, int c1, float scale, float softcap, float *m, float *l)
{
    float part[LANES];
    for (int t = 0; t < LANES; t++)
        part[t] = -INFINITY;
    for (int c = 0; c < KEY_CHUNK; c += LANES)
        for (int t = 0; t < LANES; t++) {
            float x = sr[c + t] * scale;
            if (softcap > 0.f)
                x = softcap * (1.f - 2.f / (exp_vec(2.f * x / softcap) + 1.f));
            x = c + t >= c0 && c + t < c1 ? x : -INFINITY;
            sr[c + t] = x;
            part[t] = x > part[t] ? x : part[t];
        }
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int t = 0; t < w; t++)
            part[t] = part[t + w] > part[t] ? part[t + w] : part[t];
    const float top = part[0] > *m ? part[0] : *m;
    const float keep = *m == -INFINITY ? 0.f : exp_vec(*m - top);
    for (int t = 0; t < LANES; t++)
        part[t] = 0.f;
    for (int c = 0; c < KEY_CHUNK; c += LANES)
        for (int t = 0; t < LANES; t++) {
            const float e = c + t >= c0 && c + t < c1 ? exp_vec(sr[c + t] - top) : 0.f;
            sr[c + t] = e;
            part[t] += e;
        }
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int t = 0; t < w; t++)
            part[t] += part[t + w];
    *m = top;
    *l = *l * keep + part[0];
    return keep;
}

/* One unit of a prompt's attention: the queries a .. b - 1 and the G query heads of KV head
 * h (rows = (b - a) G: query a's heads first), over every key any of them sees, in chunks
 * of KEY_CHUNK keys with the running max and sum of each row (online softmax). The chunk's
 * keys are read from the pool into kt transposed (panels of PANEL keys) and its values
 * into vc (floats); the scores and the value sums run over whole vectors (panel_tile,
 * values_tile). */
static inline __attribute__((always_inline)) void
prompt_unit(int hq, int hkv, const int d, int bs, const void *q, long qs, long qh,
            const void *cache, long cn, long ckv, long cb, long ch, const long *read, int first,
            const int *lo, int own, float scale, float softcap, const float *sinks, void *out,
            int h, int a, int b, float *scratch, const int bf16)
{
    const int g = hq / hkv, rows = (b - a) * g;
    float *qv = scratch, *o = qv + (long)rows * d, *s = o + (long)rows * d;
    float *kt = s + (long)rows * KEY_CHUNK, *vc = kt + (long)d * KEY_CHUNK;
    float *m = vc + (long)KEY_CHUNK * d, *l = m + rows;
    const long es = bf16 ? 2 : 4;
    for (int i = a, r = 0; i < b; i++)
        for (int e = 0; e < g; e++, r++) {
            const long at = (long)i * qs + (long)(h * g + e) * qh;
            for (int j = 0; j < d; j++) {
                qv[(long)r * d + j] = load_as(q, at + j, bf16);
                o[(long)r * d + j] = 0.f;
            }
            /* a sink joins the denominator as a score with no value: start from it */
            m[r] = sinks ? sinks[h * g + e] : -INFINITY;
            l[r] = sinks ? 1.f : 0.f;
        }
    const int k_first = lo[a], k_last = own + b - 1;
    for (int k0 = k_first; k0 <= k_last; k0 += KEY_CHUNK) {
        const int kc = k_last - k0 + 1 < KEY_CHUNK ? k_last - k0 + 1 : KEY_CHUNK;
        const int tiles = (kc + PANEL - 1) / PANEL;
        for (int c = 0; c < tiles * PANEL; c++) {
            float *ktc = kt + (long)(c / PANEL) * d * PANEL + c % PANEL;
            if (c >= kc) {
                for (int j = 0; j < d; j++)
                    ktc[(long)j * PANEL] = 0.f;
                continue;
            }
            const int slot = first + k0 + c;
            const char *row = (const char *)cache +
                              (read[slot / bs] * cn + (long)(slot % bs) * cb + h * ch) * es;
            for (int j = 0; j < d; j++) {
                ktc[(long)j * PANEL] = load_as(row, j, bf16);
                vc[(long)c * d + j] = load_as(row + ckv * es, j, bf16);
            }
        }
        for (int t = 0; t < tiles; t++) {
#define SCORES(R)                                                                              \
    panel_tile(R, d, kt + (long)t * d * PANEL, qv + (long)r8 * d, d, NULL,                     \
               s + (long)r8 * KEY_CHUNK + t * PANEL, KEY_CHUNK, PANEL)
            BY_TILES(rows, SCORES)
#undef SCORES
        }
        for (int i = a, r = 0; i < b; i++) {
            /* the keys query i sees, as indices into this chunk */
            const int c0 = lo[i] - k0 > 0 ? lo[i] - k0 : 0;
            const int c1 = own + i - k0 + 1 < kc ? own + i - k0 + 1 : kc;
            for (int e = 0; e < g; e++, r++) {
                float *sr = s + (long)r * KEY_CHUNK;
                if (c1 <= c0) { /* nothing of this chunk: weights 0 */
                    for (int c = 0; c < KEY_CHUNK; c++)
                        sr[c] = 0.f;
                    continue;
                }
                const float keep = chunk_weights(sr, c0, c1, scale, softcap, m + r, l + r);
                if (keep != 1.f)
                    for (int j = 0; j < d; j++)
                        o[(long)r * d + j] *= keep;
            }
        }
#define VALUES(R) values_tile(R, s + (long)r8 * KEY_CHUNK, kc, vc, d, o + (long)r8 * d)
        BY_TILES(rows, VALUES)
#undef VALUES
    }
    for (int i = a, r = 0; i < b; i++)
        for (int e = 0; e < g; e++, r++) {
            const float inv = 1.f / l[r];
            const long at = ((long)i * hq + h * g + e) * d;
            for (int j = 0; j < d; j++)
                store_as(out, at + j, o[(long)r * d + j] * inv, bf16);
        }
}
#undef BY_TILES

/* Attention of a prompt chunk's n queries over their keys in the paged pool, read where
 * they lie. Keys are numbered in a run of slots: key t is slot first + t of the blocks
 * read[0], read[1], ... (bs slots each). Query i sees keys lo[i] .. own + i (its own key
 * last; lo never decreasing: causal, sliding-window and chunked attention all see a run).
 * q: [n, Hq, D] (rows qs, heads qh elements apart; D contiguous); the pool as
 * decode_attention reads it; softcap > 0 and sinks (or NULL) as there. out: [n, Hq, D]
 * contiguous. Work splits in units of one KV head and a block of queries (about
 * ROWS_TARGET score rows), spread over `threads`; each unit is computed whole by one thread,
 * so the result does not depend on the count. Returns 0, 1 for bad sizes, 2 when out of
 * memory. */
#define PROMPT_ATTENTION(name, type, bf16)                                                     \
    int name(int hq, int hkv, int d, int bs, int n, const type *q, long qs, long qh,           \
             const type *cache, long cn, long ckv, long cb, long ch, const long *read,         \
             int first, const int *lo, int own, float scale, float softcap,                   \
             const float *sinks, type *out, int threads)                                      \
    {                                                                                         \
        if (hkv <= 0 || hq % hkv || d <= 0 || bs <= 0 || n <= 0)                               \
            return 1;                                                                         \
        const int g = hq / hkv, per = g < ROWS_TARGET ? ROWS_TARGET / g : 1;                  \
        const int blocks = (n + per - 1) / per;                                               \
        const long units = (long)hkv * blocks;                                                \
        const size_t floats = (size_t)per * g * (2 * (size_t)d + KEY_CHUNK + 2) +             \
                              2 * (size_t)d * KEY_CHUNK;                                      \
        int failed = 0;                                                                       \
        SPLIT_ROWS(units, {                                                                   \
            float *scratch = nr > 0 ? malloc(sizeof(float) * floats) : NULL;                  \
            if (nr > 0 && !scratch) {                                                         \
                _Pragma("omp atomic write") failed = 1;                                       \
            } else {                                                                          \
                for (long u = r0; u < r0 + nr; u++) {                                         \
                    /* a KV head's blocks in the order first, last, second, ...: a share */  \
                    /* of consecutive units mixes short and long rows of keys */              \
                    const int h = (int)(u / blocks), z = (int)(u % blocks);                   \
                    const int blk = z % 2 ? blocks - 1 - z / 2 : z / 2;                       \
                    const int a = blk * per, b = a + per < n ? a + per : n;                   \
                    prompt_unit(hq, hkv, d, bs, q, qs, qh, cache, cn, ckv, cb, ch, read,      \
                                first, lo, own, scale, softcap, sinks, out, h, a, b, scratch, \
                                bf16);                                                        \
                }                                                                             \
            }                                                                                 \
            free(scratch);                                                                    \
        })                                                                                    \
        return failed ? 2 : 0;                                                                \
    }
PROMPT_ATTENTION(prompt_attention_f32, float, 0)
PROMPT_ATTENTION(prompt_attention_bf16, uint16_t, 1)
#undef PROMPT_ATTENTION
