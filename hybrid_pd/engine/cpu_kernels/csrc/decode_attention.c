/* Attention of one new token per sequence over its keys in the paged pool. */
#include "common.h"

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
