/* Attention of a prompt chunk's queries over their keys in the paged pool. */
#include "common.h"
#include "panel_tile.h"

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
        case 1: call(TILE_R(1)); break;                                                       \
        case 2: call(TILE_R(2)); break;                                                       \
        case 3: call(TILE_R(3)); break;                                                       \
        case 4: call(TILE_R(4)); break;                                                       \
        case 5: call(TILE_R(5)); break;                                                       \
        case 6: call(TILE_R(6)); break;                                                       \
        case 7: call(TILE_R(7)); break;                                                       \
        default: call(TILE_ROWS); break;                                                      \
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
