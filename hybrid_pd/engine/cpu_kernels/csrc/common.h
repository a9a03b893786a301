/* What every kernel file of hybrid-pd's CPU kernels shares: the headers, the thread split
 * (SPLIT_ROWS), bfloat16 conversions, the vectorisable exp and SiLU, and typed loads and
 * stores. Only macros and static inline functions: each kernel file compiles its own copy.
 *
 * The kernels are built at first use by hybrid_pd/engine/cpu_kernels/loader.py (every .c of
 * this folder in one cc call, cc -O3 with the flags of the CPU's instruction set level:
 * x86-64-v4 for AVX-512, x86-64-v3 for AVX2, into one shared library) and called
 * through ctypes with raw pointers; every function has a pure-PyTorch counterpart that the
 * tests compare it with. Plain C11, no PyTorch headers.
 */
#ifndef HYBRID_PD_COMMON_H
#define HYBRID_PD_COMMON_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
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

/* CALL(N) with N a constant where `n` is one of the common head / state sizes (64, 128), so
 * that the callee's loops over it have a known length, else CALL(n). */
/* Where sequence s's state lies in a decode step's state operand, in state strides: s for
 * rows stacked one after another (gathered copies), rows[s] for states updated where they lie
 * in a paged pool (rows: each sequence's index in the pool's view, its block id). */
#define STATE_ROW(rows, s) ((rows) ? (rows)[s] : (long)(s))

#define WITH_COMMON_SIZE(n, CALL)                                                             \
    do {                                                                                      \
        if ((n) == 64) {                                                                      \
            CALL(64);                                                                         \
        } else if ((n) == 128) {                                                              \
            CALL(128);                                                                        \
        } else {                                                                              \
            CALL(n);                                                                          \
        }                                                                                     \
    } while (0)

/* Partial sums of the reductions over a row (a state row's read-out, a sum of squares, a
 * one-row linear): vector lanes, each over its elements in order, added in a fixed order. */
#define LANES 16

/* ---------------------------------------- bfloat16, exp, typed loads and stores */

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

#endif
