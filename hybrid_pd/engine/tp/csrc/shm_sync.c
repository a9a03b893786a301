/* Sequence counters in shared memory for the ranks of one node: publish a number, wait
 * until other ranks' numbers reach one. The data those numbers guard is written before a
 * publish (release) and read after a wait (acquire), so a reader sees the bytes the writer
 * wrote before it published.
 *
 * A counter is a 64-byte line of the segment: { uint32 value; uint32 sleepers; }.
 * Numbers are compared modulo 2^32 ((int32)(value - target) >= 0), so they may wrap.
 *
 * A wait spins, then yields the core, then sleeps on the counter's futex (woken by the
 * publisher when it sees a sleeper), waking every `check_ms` to see whether the ranks it
 * waits for are still alive: a dead peer is an error, not a hang.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    uint32_t value;
    uint32_t sleepers;
} hpd_counter;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield" ::: "memory");
#endif
}

static inline int reached(uint32_t value, uint32_t target) {
    return (int32_t)(value - target) >= 0;
}

static long futex(uint32_t *word, int op, uint32_t val, const struct timespec *timeout) {
    /* not FUTEX_PRIVATE: the word lives in memory shared between processes */
    return syscall(SYS_futex, word, op, val, timeout, NULL, 0);
}

/* Store `value` into the counter (release) and wake whoever sleeps on it. The store and
 * the load of `sleepers` are sequentially consistent, as are the sleeper's increment and
 * its reload of the value: either the sleeper sees the new value or we see the sleeper. */
void hpd_publish(hpd_counter *c, uint32_t value) {
    __atomic_store_n(&c->value, value, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&c->sleepers, __ATOMIC_SEQ_CST) != 0)
        futex(&c->value, FUTEX_WAKE, INT_MAX, NULL);
}

/* The counter's value, with acquire ordering. */
uint32_t hpd_load(const hpd_counter *c) {
    return __atomic_load_n(&c->value, __ATOMIC_ACQUIRE);
}

/* Whether process `pid` is gone: no such process, or a zombie (exited, not yet reaped). */
static int pid_dead(int pid) {
    if (pid <= 0)
        return 0;
    if (kill(pid, 0) != 0)
        return errno == ESRCH;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    /* "pid (comm) S ...": the state follows the last ')' */
    char *close = NULL;
    for (char *p = buf; *p; p++)
        if (*p == ')')
            close = p;
    return close != NULL && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Wait until counters[i * stride] (i < n, `stride` in bytes) all reach `target`.
 * pids[i]: the process behind counter i (checked for liveness; <= 0: not checked).
 * spin_us: how long to busy-poll, then yield_us: how long to poll between sched_yield calls
 * (the core goes to whoever else wants it), before sleeping on the futex; check_ms: how
 * often a sleeping waiter checks its peers; timeout_s <= 0: no deadline.
 * Returns 0 when reached, i + 1 when the process behind counter i died, -1 on timeout. */
int hpd_wait(char *counters, int n, long stride, uint32_t target, const int32_t *pids,
             double spin_us, double yield_us, int check_ms, double timeout_s) {
    int i = 0, yielding = 0;
    long round = 0;
    double start = now_s();
    double spin_end = start + 1e-6 * spin_us, yield_end = spin_end + 1e-6 * yield_us;
    double next_check = yield_end + 1e-3 * check_ms;  /* the peers' liveness: not before */
    double deadline = timeout_s > 0 ? start + timeout_s : 0;
    while (i < n) {
        hpd_counter *c = (hpd_counter *)(counters + (long)i * stride);
        if (reached(__atomic_load_n(&c->value, __ATOMIC_ACQUIRE), target)) {
            i++;
            continue;
        }
        if ((++round & 63) != 0) {  /* the clock is read every 64 polls */
            if (yielding)
                sched_yield();
            else
                cpu_relax();
            continue;
        }
        double t = now_s();
        if (t < spin_end)
            continue;
        if (t < yield_end) {
            yielding = 1;
            continue;
        }
        if (t >= next_check) {
            for (int j = i; j < n; j++) {
                hpd_counter *d = (hpd_counter *)(counters + (long)j * stride);
                if (!reached(__atomic_load_n(&d->value, __ATOMIC_ACQUIRE), target) &&
                    pid_dead(pids[j]))
                    return j + 1;
            }
            if (deadline > 0 && t >= deadline)
                return -1;
            next_check = t + 1e-3 * check_ms;
        }
        __atomic_add_fetch(&c->sleepers, 1, __ATOMIC_SEQ_CST);
        uint32_t seen = __atomic_load_n(&c->value, __ATOMIC_SEQ_CST);
        if (!reached(seen, target)) {
            struct timespec ts = {check_ms / 1000, (long)(check_ms % 1000) * 1000000L};
            futex(&c->value, FUTEX_WAIT, seen, &ts);  /* EAGAIN, ETIMEDOUT, EINTR: re-check */
        }
        __atomic_sub_fetch(&c->sleepers, 1, __ATOMIC_SEQ_CST);
        round = 63;  /* slept once: the next poll reads the clock (and sleeps again) */
    }
    return 0;
}

/* What stays the same from one all-reduce of a group to the next, set up once per rank:
 * rank 0's posted and done counters (`stride` bytes apart, `size` of each), the data area
 * (slot (parity p, rank r) at ((p * size) + r) * slot_bytes), the ranks' pids and the
 * waits' settings (hpd_wait). A call from Python then converts 5 arguments, not 17:
 * microseconds a call, and a decode step makes about a hundred. */
typedef struct {
    char *posted;
    char *done;
    long stride;
    int size;
    int rank;
    char *slots;
    long slot_bytes;
    const int32_t *pids;
    double spin_us;
    double yield_us;
    int check_ms;
    double timeout_s;
} hpd_group;

static int group_wait(const hpd_group *g, char *counters, uint32_t target) {
    return hpd_wait(counters, g->size, g->stride, target, g->pids, g->spin_us, g->yield_us,
                    g->check_ms, g->timeout_s);
}

/* The first half of all-reduce number `call` (counted from 1, never wrapping): wait until
 * every rank is done with call - 2 (the last user of this parity's slots); *mine is then
 * this rank's slot to fill. */
static int reduce_open(const hpd_group *g, uint64_t call, float **mine) {
    if (call > 2) {
        int got = group_wait(g, g->done, (uint32_t)(call - 2));
        if (got != 0)
            return got;
    }
    char *base = g->slots + (long)(call % 2) * g->size * g->slot_bytes;
    *mine = (float *)(base + (long)g->rank * g->slot_bytes);
    return 0;
}

/* This rank's slot filled: publish posted = call and wait for every rank's; *base is then
 * the call's slots (rank r's at r * slot_bytes) to read. The caller publishes done
 * (reduce_close) once it has read what it needs. */
static int reduce_post(const hpd_group *g, uint64_t call, const char **base) {
    hpd_publish((hpd_counter *)(g->posted + (long)g->rank * g->stride), (uint32_t)call);
    int got = group_wait(g, g->posted, (uint32_t)call);
    if (got == 0)
        *base = g->slots + (long)(call % 2) * g->size * g->slot_bytes;
    return got;
}

/* reduce_post, then the slots summed in rank order (((s0 + s1) + s2) + ...) into `sum`.
 * Each element's sum is the same chain of float adds on every rank, whatever the compiler
 * vectorizes: the same bits everywhere, and the same as adding tensors in order. */
static int reduce_sum(const hpd_group *g, uint64_t call, float *sum, long count) {
    const char *base;
    int got = reduce_post(g, call, &base);
    if (got != 0)
        return got;
    const float *s0 = (const float *)base;
    if (g->size == 1) {
        for (long i = 0; i < count; i++)
            sum[i] = s0[i];
        return 0;
    }
    const float *s1 = (const float *)(base + g->slot_bytes);
    for (long i = 0; i < count; i++)
        sum[i] = s0[i] + s1[i];
    for (int r = 2; r < g->size; r++) {
        const float *sr = (const float *)(base + (long)r * g->slot_bytes);
        for (long i = 0; i < count; i++)
            sum[i] += sr[i];
    }
    return 0;
}

static void reduce_close(const hpd_group *g, uint64_t call) {
    hpd_publish((hpd_counter *)(g->done + (long)g->rank * g->stride), (uint32_t)call);
}

/* One all-reduce of `count` floats (count * 4 <= slot_bytes), the whole collective in one
 * call. Returns what hpd_wait returns (0; r + 1 when rank r died; -1 on timeout). */
int hpd_group_all_reduce_f32(const hpd_group *g, uint64_t call, const float *src, float *dst,
                             long count) {
    float *mine;
    int got = reduce_open(g, call, &mine);
    if (got != 0)
        return got;
    for (long i = 0; i < count; i++)
        mine[i] = src[i];
    got = reduce_sum(g, call, dst, count);
    if (got == 0)
        reduce_close(g, call);
    return got;
}

/* bfloat16 <-> float32 as torch converts: widening is exact; narrowing rounds to nearest,
 * ties to even, and any NaN becomes 0x7FC0. */
static inline float bf16_widen(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* One all-reduce of `count` bfloat16 values (count * 4 <= slot_bytes): each rank's values
 * widened into its slot, summed in float32 in rank order (the float32 path's chain of adds)
 * and rounded once into `dst`, as torch rounds. */
int hpd_group_all_reduce_bf16(const hpd_group *g, uint64_t call, const uint16_t *src,
                              uint16_t *dst, long count) {
    float *mine;
    int got = reduce_open(g, call, &mine);
    if (got != 0)
        return got;
    for (long i = 0; i < count; i++)
        mine[i] = bf16_widen(src[i]);
    const char *base;
    got = reduce_post(g, call, &base);
    if (got != 0)
        return got;
    const float *s0 = (const float *)base;
    if (g->size == 1) {
        for (long i = 0; i < count; i++)
            dst[i] = bf16_round(s0[i]);
    } else {
        const float *s1 = (const float *)(base + g->slot_bytes);
        for (long i = 0; i < count; i++) {
            float acc = s0[i] + s1[i];
            for (int r = 2; r < g->size; r++)
                acc += ((const float *)(base + (long)r * g->slot_bytes))[i];
            dst[i] = bf16_round(acc);
        }
    }
    reduce_close(g, call);
    return 0;
}
