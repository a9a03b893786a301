/* hybrid-pd's CPU kernels: recurrences that PyTorch can only run as many small operations.
 *
 * Built at first use by hybrid_pd/engine/cpu_kernels.py (cc -O3 -march=native) and called
 * through ctypes with raw float32 pointers; every function has a pure-PyTorch counterpart
 * that the tests compare it with. Plain C11, no PyTorch headers: the build takes under a
 * second.
 */
#include <math.h>
#include <stddef.h>

#define MAX_DIM 1024

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

int gdn_recurrent(int n, int hk, int hv, int dk, int dv, int h0, int h1,
                  const float *q, long qsn, long qsh, long qsd,
                  const float *k, long ksn, long ksh, long ksd,
                  const float *v, long vsn, long vsh, long vsd,
                  const float *g, const float *beta, long gsn, long gsh,
                  float *state, float *out)
{
    if (dv > MAX_DIM || n < 1 || hk < 1 || hv % hk)
        return -1;
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
    return 0;
}
