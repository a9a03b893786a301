/* Linears: one input row against a row-major weight (gemv, float32 or bfloat16), and a few
 * or many rows against a weight packed into panels (panel_linear: float32, or bfloat16 widened
 * to float32 panel by panel). */
#include "common.h"
#include "panel_tile.h"

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

/* ------------------------------------------------------------------ panel linear */

/* Bytes of x a block of rows may take: the block stays in the core's L2 cache while every
 * panel passes over it (many rows re-read from memory per panel cost 5-10% at 8,192 rows). */
#define ROW_BLOCK_BYTES (256 * 1024)

/* y = x W^T + bias for m rows of x (xs elements apart, k contiguous) into y [m, n]
 * (contiguous; bfloat16 with `bf16`, each sum rounded once), W [n, k] packed as panels
 * [ceil(n / PANEL), k, PANEL] (panel p holds columns p PANEL .. p PANEL + PANEL - 1, zero
 * past n), float32, or bfloat16 (`bf16`) widened
 * panel by panel into `scratch` ([k, PANEL] float32, in the core's L2 cache) where the
 * processor has no bfloat16 arithmetic: once per panel per block of rows, then the same
 * float32 tile runs over it (bfloat16 to float32 is exact, so the sums are the float32
 * kernel's on the widened weights, bit for bit).
 *
 * A panel's weights are read in order, once per TILE_ROWS rows of x (from the cache after
 * the first), and every sum stays in a register until it is stored: no sums across vector
 * lanes, no partial products in memory. For the few rows of a decode step this reads the
 * weights at about the memory's speed (a library GEMM's small-row kernels ran at 12-14 GB/s
 * here); for many rows it is bound by the multiply-adds, as a library's is, and the rows
 * go in blocks that stay in the cache while the panels pass. */
static inline __attribute__((always_inline)) void
panel_range(long m, long n, long k, const void *panels, const float *x, long xs,
            const float *bias, void *y, long p0, long p1, const int bf16, float *scratch)
{
    long block = ROW_BLOCK_BYTES / (long)sizeof(float) / (k > 0 ? k : 1) / TILE_ROWS * TILE_ROWS;
    block = block < TILE_ROWS ? TILE_ROWS : block;
    for (long b0 = 0; b0 < m; b0 += block) {
        const long b1 = b0 + block < m ? b0 + block : m;
        for (long p = p0; p < p1; p++) {
            const float *w;
            if (bf16) {
                const uint16_t *src = (const uint16_t *)panels + p * k * PANEL;
                for (long i = 0; i < k * PANEL; i++)
                    scratch[i] = bits_float((uint32_t)src[i] << 16);
                w = scratch;
            } else {
                w = (const float *)panels + p * k * PANEL;
            }
            const int cols = n - p * PANEL < PANEL ? (int)(n - p * PANEL) : PANEL;
            const float *b = bias ? bias + p * PANEL : NULL;
            for (long r0 = b0; r0 < b1; r0 += TILE_ROWS) {
                const float *xr = x + r0 * xs;
                const int rows = b1 - r0 < TILE_ROWS ? (int)(b1 - r0) : TILE_ROWS;
                /* bfloat16: the tile's float32 sums into `out`, rounded into y below */
                float out[TILE_ROWS * PANEL];
                float *yr = bf16 ? out : (float *)y + r0 * n + p * PANEL;
                const long ys = bf16 ? PANEL : n;
                switch (rows) {
#define TILE(R)                                                                                \
    case R:                                                                                    \
        panel_tile(TILE_R(R), k, w, xr, xs, b, yr, ys, cols);                                  \
        break;
                    TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7)
                default:
                    panel_tile(TILE_ROWS, k, w, xr, xs, b, yr, ys, cols);
#undef TILE
                }
                if (bf16)
                    for (int r = 0; r < rows; r++) {
                        uint16_t *yb = (uint16_t *)y + (r0 + r) * n + p * PANEL;
                        for (int l = 0; l < cols; l++)
                            yb[l] = float_bf16(out[r * PANEL + l]);
                    }
            }
        }
    }
}

/* The output columns per panel this build packs for (PANEL: the instruction set's tile). */
int panel_width(void) { return PANEL; }

/* The panels are shared among `threads` (each thread all rows of its own panels, in the
 * same blocks: no thread waits for another). */
void panel_linear_f32(long m, long n, long k, const float *panels, const float *x, long xs,
                      const float *bias, float *y, int threads)
{
    const long count = (n + PANEL - 1) / PANEL;
    SPLIT_ROWS(count, panel_range(m, n, k, panels, x, xs, bias, y, r0, r0 + nr, 0, NULL);)
}

/* panel_linear_f32 with the panels and y in bfloat16 (x and bias float32: the caller widens
 * them once): each thread widens its panels one at a time into its own scratch, and rounds
 * each float32 output once. 0, or -1 where the scratch could not be allocated (then nothing
 * was written). */
int panel_linear_bf16(long m, long n, long k, const uint16_t *panels, const float *x, long xs,
                      const float *bias, uint16_t *y, int threads)
{
    const long count = (n + PANEL - 1) / PANEL;
    const size_t bytes = ((size_t)(k > 0 ? k : 1) * PANEL * sizeof(float) + 63) / 64 * 64;
    int failed = 0;
    SPLIT_ROWS(count, {
        float *scratch = aligned_alloc(64, bytes);
        if (scratch == NULL) {
            _Pragma("omp atomic write") failed = 1;
        }
        _Pragma("omp barrier")
        if (!failed)
            panel_range(m, n, k, panels, x, xs, bias, y, r0, r0 + nr, 1, scratch);
        free(scratch);
    })
    return failed ? -1 : 0;
}
