/* State scans and convolutions: the gated delta rule (Qwen3.5 / Qwen3-Next) over a prompt
 * and one decode step, Mamba2's SSD over a prompt and one decode step, and the depthwise
 * causal convolution then SiLU over a prompt and one decode step. */
#include "common.h"

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
    WITH_COMMON_SIZE(dv, GDN_CALL);
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
 * state: each sequence's [hv, dk, dv] contiguous, updated in place, sequence s's at state +
 * STATE_ROW(s) * ss (rows: NULL for rows ss floats apart, as gathered; else the index of each
 * sequence's state in a paged pool's view, its pages ss floats apart); out: [S, hv, dv]
 * contiguous.
 */
int gdn_step(int seqs, int hk, int hv, int dk, int dv,
             const float *q, long qss, long qsh, long qsd,
             const float *k, long kss, long ksh, long ksd,
             const float *v, long vss, long vsh, long vsd,
             const float *g, const float *beta, long gss, long gsh,
             float *state, long ss, const long *rows, float *out, int threads)
{
    if (dv > MAX_DIM || hk < 1 || hv % hk)
        return -1;
    SPLIT_ROWS(seqs, {
        for (long s = r0; s < r0 + nr; s++)
            gdn_range(1, hk, hv, dk, dv, 0, hv, q + s * qss, 0, qsh, qsd, k + s * kss, 0, ksh,
                      ksd, v + s * vss, 0, vsh, vsd, g + s * gss, beta + s * gss, 0, gsh,
                      state + STATE_ROW(rows, s) * ss, out + (size_t)s * hv * dv);
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
 * (N a multiple of 16) the rows go sixteen at a time, with AVX2 eight, their sums added
 * together by shuffles (`ssd_rows16`, `ssd_rows8`) in that same tree, so every path gives
 * the same bits; the lane sums were
 * added one after another before, a chain of 16 scalar additions per row that took most of
 * a prompt's scan.
 */
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
#elif defined(__AVX2__)
/* Eight rows p .. p + 7 of ssd_token with AVX2, N a multiple of 16: each row's sixteen lane
 * sums in two vectors (lanes 0-7, 8-15), reduced for all eight rows together in lanes_sum's
 * tree: (1) l + (l + 8) per row, (2) l + (l + 4) with two rows per vector, (3) 0 + 1 and
 * 2 + 3, (4) their sum; the rows end in the order 0 2 4 6 1 3 5 7, put back in order. The
 * scalar lanes_sum chain per row took as long as the row's multiply-adds at d_state 128. */
static inline __attribute__((always_inline)) void
ssd_rows8(float *S, long sp, const int ns, const float *x, long xp, float d, float decay,
          const float *bn, const float *cn, float *y)
{
    __m256 s1[8], s2[4], q[2];
    const __m256 dec = _mm256_set1_ps(decay);
    for (int r = 0; r < 8; r++) {
        float *row = S + r * sp;
        const __m256 u = _mm256_set1_ps(x[r * xp] * d);
        __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
        for (int n = 0; n < ns; n += 16) {
            const __m256 k0 = _mm256_mul_ps(_mm256_loadu_ps(row + n), dec);
            const __m256 k1 = _mm256_mul_ps(_mm256_loadu_ps(row + n + 8), dec);
            const __m256 v0 = _mm256_fmadd_ps(u, _mm256_loadu_ps(bn + n), k0);
            const __m256 v1 = _mm256_fmadd_ps(u, _mm256_loadu_ps(bn + n + 8), k1);
            _mm256_storeu_ps(row + n, v0);
            _mm256_storeu_ps(row + n + 8, v1);
            lo = _mm256_fmadd_ps(v0, _mm256_loadu_ps(cn + n), lo);
            hi = _mm256_fmadd_ps(v1, _mm256_loadu_ps(cn + n + 8), hi);
        }
        s1[r] = _mm256_add_ps(lo, hi);
    }
    for (int i = 0; i < 4; i++) /* [row 2i: l + (l + 4), l < 4 | row 2i + 1: the same] */
        s2[i] = _mm256_add_ps(_mm256_permute2f128_ps(s1[2 * i], s1[2 * i + 1], 0x20),
                              _mm256_permute2f128_ps(s1[2 * i], s1[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++) /* [4i: 0+1, 2+3; 4i+2: 0+1, 2+3 | 4i+1 ...; 4i+3 ...] */
        q[i] = _mm256_add_ps(_mm256_shuffle_ps(s2[2 * i], s2[2 * i + 1], 0x88),
                             _mm256_shuffle_ps(s2[2 * i], s2[2 * i + 1], 0xDD));
    const __m256 e = _mm256_add_ps(_mm256_shuffle_ps(q[0], q[1], 0x88),
                                   _mm256_shuffle_ps(q[0], q[1], 0xDD));
    _mm256_storeu_ps(y, _mm256_permutevar8x32_ps(e, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#endif

static inline __attribute__((always_inline)) void
ssd_token(float *S, long sp, int hd, const int ns, const float *x, long xp, float d,
          float decay, const float *bn, const float *cn, float *y)
{
    int p = 0;
#if defined(__AVX512F__)
    if (ns % 16 == 0)
        for (; p + 16 <= hd; p += 16)
            ssd_rows16(S + p * sp, sp, ns, x + p * xp, xp, d, decay, bn, cn, y + p);
#elif defined(__AVX2__)
    if (ns % 16 == 0)
        for (; p + 8 <= hd; p += 8)
            ssd_rows8(S + p * sp, sp, ns, x + p * xp, xp, d, decay, bn, cn, y + p);
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

/* One decode step for S sequences of H heads, one token each. state: [H, P, N] float32 per
 * sequence, strides sh, sp (N contiguous), updated in place, sequence s's at state +
 * STATE_ROW(rows, s) * ss (rows: NULL for rows ss floats apart, as gathered; else the index
 * of each sequence's state in a paged pool's view, its pages ss floats apart); x: [S, H, P],
 * strides xs, xh, xp; dt: [S, H], strides ds, dh; a: [H]; b, c: [S, G, N], strides bs, bg
 * (N contiguous; head h reads group h / (H / G)); y: [S, H, P] contiguous.
 */
static inline __attribute__((always_inline)) void
ssd_rows(int seqs, int heads, int hd, const int ns, int groups,
         float *state, long ss, long sh, long sp, const long *rows,
         const float *x, long xs, long xh, long xp, const float *dt, long ds, long dh,
         const float *a, const float *b, const float *c, long bs, long bg, float *y)
{
    const int per = heads / groups;
    for (int s = 0; s < seqs; s++)
        for (int h = 0; h < heads; h++) {
            const float d = dt[s * ds + h * dh];
            const long bo = s * bs + (h / per) * bg;
            ssd_token(state + STATE_ROW(rows, s) * ss + h * sh, sp, hd, ns,
                      x + s * xs + h * xh, xp, d, expf(d * a[h]), b + bo, c + bo,
                      y + ((size_t)s * heads + h) * hd);
        }
}

int ssd_step(int seqs, int heads, int hd, int ns, int groups,
             float *state, long ss, long sh, long sp, const long *rows,
             const float *x, long xs, long xh, long xp, const float *dt, long ds, long dh,
             const float *a, const float *b, const float *c, long bs, long bg, float *y,
             int threads)
{
    if (seqs < 0 || groups < 1 || heads % groups)
        return -1;
#define SSD_CALL(NS)                                                                      \
    ssd_rows(nr, heads, hd, NS, groups, rows ? state : state + r0 * ss, ss, sh, sp,       \
             rows ? rows + r0 : NULL, x + r0 * xs, xs, xh, xp, dt + r0 * ds, ds, dh, a,   \
             b + r0 * bs, c + r0 * bs, bs, bg, y + (size_t)r0 * heads * hd)
#define SSD_SPLIT(NS) SPLIT_ROWS(seqs, SSD_CALL(NS);)
    WITH_COMMON_SIZE(ns, SSD_SPLIT);
#undef SSD_SPLIT
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
    WITH_COMMON_SIZE(ns, SCAN_CALL);
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
 * [channels][taps - 1] per sequence (the taps - 1 latest inputs, oldest first), sequence s's
 * at state + STATE_ROW(rows, s) * ss (as in ssd_step), shifted in place to take the new
 * input; x: [S][channels] (rows xs apart); w: [channels][taps] (conv1d's weight); bias:
 * [channels] or NULL; out: [S][channels]. */
static inline __attribute__((always_inline)) void
conv_step_silu(long seqs, long channels, int taps, float *state, long ss, const long *rows,
               const float *x, long xs, const float *w, const float *bias, float *out)
{
    const int kept = taps - 1;
    for (long s = 0; s < seqs; s++) {
        float *st = state + STATE_ROW(rows, s) * ss, *o = out + s * channels;
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
                        const long *rows, const float *x, long xs, const float *w,
                        const float *bias, float *out, int threads)
{
    SPLIT_ROWS(seqs, conv_step_silu(nr, channels, taps, rows ? state : state + r0 * ss, ss,
                                    rows ? rows + r0 : NULL, x + r0 * xs, xs, w, bias,
                                    out + r0 * channels);)
}

void conv_silu_f32(long rows, long channels, int taps, const float *x, long xs,
                   const long *first, const float *w, const float *bias, float *out, int threads)
{
    SPLIT_ROWS(rows, conv_silu(nr, channels, taps, x, xs, first + r0, w, bias,
                               out + r0 * channels);)
}
