/* The register tile of the float32 panel GEMM: shared by the linears (panel_linear, in
 * linears.c) and a prompt's attention (scores and value sums, in prompt_attention.c). */
#ifndef HYBRID_PD_PANEL_TILE_H
#define HYBRID_PD_PANEL_TILE_H

#include "common.h"

/* PANEL output columns per panel, TILE_ROWS input rows per tile: the tile's sums must stay
 * in the vector registers while a panel's weights pass, so the tile follows the register
 * file the build's instruction set has (the loader picks the level; the macros say which):
 *
 *   AVX-512  32 registers of 16 floats: 8 rows x 32 columns = 16 registers of sums
 *   AVX2     16 registers of  8 floats: 3 rows x 32 columns = 12 registers of sums and one
 *            broadcast row value, the weights read by the multiply-adds from the cache
 *            (8 x 32 spills sums to memory every term: 57-67 GFLOP/s where 3 x 32 ran at
 *            103-108 on one AVX2 core of about 105 peak; 6 x 16, two weight registers,
 *            97-105 at 256 rows but 43-49 at 8)
 *   others   2 rows x 32 columns (SSE's 16 registers of 4 floats)
 *
 * PANEL divides KEY_CHUNK (prompt_attention.c). Python reads the width the library was
 * built with (`panel_width`) to pack weights for it. Every sum is over j in order whatever
 * the tile, so the results do not depend on it. HYBRID_PD_PANEL / HYBRID_PD_TILE_ROWS
 * override (for measuring other tiles). */
#if defined(HYBRID_PD_PANEL)
#define PANEL HYBRID_PD_PANEL
#else
#define PANEL 32
#endif

#if defined(HYBRID_PD_TILE_ROWS)
#define TILE_ROWS HYBRID_PD_TILE_ROWS
#elif defined(__AVX512F__)
#define TILE_ROWS 8
#elif defined(__AVX2__)
#define TILE_ROWS 3
#else
#define TILE_ROWS 2
#endif

/* r rows where r < TILE_ROWS, else TILE_ROWS: the row counts of the tails' switch cases
 * (`case 7: call(TILE_R(7))`), so a case past TILE_ROWS - 1 compiles, never runs. */
#define TILE_R(r) ((r) < TILE_ROWS ? (r) : TILE_ROWS)

#if TILE_ROWS > 8
#error "TILE_ROWS above 8: the tails' switches (linears.c, prompt_attention.c) stop at 8"
#endif

/* rows x PANEL outputs of one panel: y[r][l] = bias[l] + sum over j of x[r][j] w[j][l], each
 * sum in float32 over j in order (one fused multiply-add per term): a row's result does not
 * depend on the other rows of the call, nor on how many there are.
 *
 * With AVX2 (and not AVX-512) in intrinsics, each sum a named variable: from plain loops
 * the compiler kept some tiles' sums in an array in memory (a store per term) or made
 * 128-bit and scalar operations of them; this form runs at the core's FMA rate. The same
 * terms in the same order, so the same bits. */
#if defined(__AVX2__) && !defined(__AVX512F__) && PANEL == 32 && TILE_ROWS <= 3
static inline __attribute__((always_inline)) void
panel_tile(const int rows, long k, const float *w, const float *x, long xs, const float *bias,
           float *y, long ys, int cols)
{
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00;
    __m256 c10 = c00, c11 = c00, c12 = c00, c13 = c00, c20 = c00, c21 = c00, c22 = c00;
    __m256 c23 = c00;
    for (long j = 0; j < k; j++) {
        const float *wj = w + j * PANEL;
#define ROW_TERMS(r)                                                                           \
    if (rows > r) {                                                                            \
        const __m256 xv = _mm256_broadcast_ss(x + r * xs + j);                                 \
        c##r##0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(wj), c##r##0);                           \
        c##r##1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(wj + 8), c##r##1);                       \
        c##r##2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(wj + 16), c##r##2);                      \
        c##r##3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(wj + 24), c##r##3);                      \
    }
        ROW_TERMS(0) ROW_TERMS(1) ROW_TERMS(2)
#undef ROW_TERMS
    }
    float out[3][PANEL];
#define ROW_OUT(r)                                                                             \
    _mm256_storeu_ps(out[r], c##r##0);                                                         \
    _mm256_storeu_ps(out[r] + 8, c##r##1);                                                     \
    _mm256_storeu_ps(out[r] + 16, c##r##2);                                                    \
    _mm256_storeu_ps(out[r] + 24, c##r##3);
    ROW_OUT(0) ROW_OUT(1) ROW_OUT(2)
#undef ROW_OUT
    for (int r = 0; r < rows; r++)
        for (int l = 0; l < cols; l++)
            y[r * ys + l] = out[r][l] + (bias ? bias[l] : 0.f);
}
#else
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
#endif

#endif
