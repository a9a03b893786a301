/* The register tile of the float32 panel GEMM: shared by the linears (panel_linear, in
 * linears.c) and a prompt's attention (scores and value sums, in prompt_attention.c). */
#ifndef HYBRID_PD_PANEL_TILE_H
#define HYBRID_PD_PANEL_TILE_H

#include "common.h"

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

#endif
