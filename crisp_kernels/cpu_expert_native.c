/* The CPU expert kernel on the format's own rows: one expert over neurons [j0, j1) of its
 * neuron-major 4-bit prefix, fp32 throughout (crisp_kernels/cpu_native.py builds and calls it).
 *
 * Row j of the format holds everything neuron j needs: gate row, up row and down column, each
 * H / 2 bytes (low nibble = even element), fp16 scales and optional uint8 zero points per group
 * of g elements of H. One pass over a row computes, per token t,
 *     g_t = sum_h x_th (q_gate[h] - z) s,  u_t likewise,  a_t = silu(g_t) u_t  (0 when j >= k_t),
 *     y_t += a_t (q_down - z) s,
 * so the kernel reads exactly the bytes of rows [j0, j1) once, and no second copy of the experts
 * is needed (the int4pack path needs one: x 2.05 host memory).
 *
 * Even and odd elements: a byte holds elements 2i (low) and 2i + 1 (high), so x and y are kept
 * split into their even and odd halves (xe, xo, ye, yo), and a byte's two nibbles meet their
 * operands without shuffles. The zero point is subtracted from the integer codes before they
 * become floats, so every product is x_h (q_h - z) s as in the reference: taking z out of the sum
 * (s (sum_h x_h q_h - z sum_h x_h)) saves that subtraction but cancels: a neuron whose
 * pre-activation is 1/1000 of sum |x_h w_h| then lost 4e-5 of it, against 1.3e-5 for a sequential
 * fp32 dot (tests/test_cpu_expert.py's single-neuron row ranges).
 *
 * Neurons go in chunks of CHUNK: first every gate/up dot of the chunk (a_tj), then the chunk's down
 * columns block by block of 32 elements of H, summed over the chunk's neurons in registers and
 * added to y once per chunk (adding each neuron's column to y in memory cost one load and one
 * store of y per 8 elements per token: the bottleneck at T > 1, 0.45 GB/s at T = 16). A chunk's
 * rows (CHUNK x 3 H / 2 bytes, 192 KB at H 4096) stay in L2 between the two passes.
 *
 * Threads: neurons are split into nthreads contiguous ranges, each with its own (T, H) accumulator,
 * summed at the end in a fixed order: the result does not depend on timing, only on nthreads. The
 * ranges run on an OpenMP team, and the library links libgomp.so.1 by that name, which the dynamic
 * loader resolves to the copy torch has loaded already: the kernel's threads are torch's intra-op
 * threads. Threads of its own (pthreads, an earlier version) competed on a 2-core host with torch's
 * OpenMP threads, which spin for a while after each torch op: 2 threads ran no faster than 1 after
 * torch ops (3.4 against 3.0 GB/s), and 4.9 GB/s with OMP_WAIT_POLICY=PASSIVE.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CRISP_AVX2 1
#else
#define CRISP_AVX2 0
#endif

#define MAX_TOKENS 64   /* checked by the caller */
#define TOKEN_TILE 2    /* tokens of a down pass, whose accumulators stay in the 16 ymm registers */
#define ACT_TILE 4      /* tokens of a gate/up pass (two down passes each) */
#define CHUNK 32        /* neurons per chunk (see the header) */

#if !CRISP_AVX2
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400u)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#define SCALE(s, g) half_to_float((s)[g])
#else
#define SCALE(s, g) _cvtsh_ss((s)[g])
#endif

typedef struct {
    /* shared, read-only */
    const float *xe, *xo;      /* (T, H/2) even / odd elements of x */
    const uint8_t *qweight;    /* (rows, 3, H/2), row 0 = neuron j0 */
    const uint16_t *scales;    /* (rows, 3, G) fp16 */
    const uint8_t *zeros;      /* (rows, 3, G) or NULL: 8 */
    const int64_t *kt;         /* (T,) neuron j used by token t iff j < kt[t] (absolute j) */
    int64_t j0;
    int tokens, hidden, group;
    /* this thread's */
    int64_t r0, r1;            /* rows (relative to j0) */
    float *ye, *yo;            /* (T, H/2) accumulators */
} Work;

#if CRISP_AVX2
#define INLINE static inline __attribute__((always_inline))

/* 16 bytes of a row as q - z: elements 2i (lo) and 2i + 1 (hi) of bytes [i, i + 8) and [i + 8, i + 16). */
INLINE void nibbles16(const uint8_t *q, __m256i vz, __m256 v[4]) {
    const __m256i low = _mm256_set1_epi32(0x0f);
    __m128i b16 = _mm_loadu_si128((const __m128i *)q);
    __m256i b0 = _mm256_cvtepu8_epi32(b16), b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b16, 8));
    v[0] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b0, low), vz));  /* even elements, bytes [i, i + 8) */
    v[1] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b0, 4), vz));   /* odd */
    v[2] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b1, low), vz));  /* even, bytes [i + 8, i + 16) */
    v[3] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b1, 4), vz));
}

INLINE float hsum(__m256 a) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
    return _mm_cvtss_f32(v);
}

/* res[t] = sum_h x_th (q_h - z) s over one projection row for two tokens [t0, t0 + 2): two independent
 * chains per token (one chain cannot cover the FMA latency), per group partial sums scaled once by the
 * group's scale; 8 accumulators in registers. (One token takes gate_up_1, three or four dot_row_wide_nt.) */
static void dot_row_2(const Work *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0, float *res) {
    const int half = w->hidden / 2, gh = w->group / 2, groups = w->hidden / w->group;
    const float *xe[2], *xo[2];
    __m256 acc[2][2];
    for (int t = 0; t < 2; t++) {
        xe[t] = w->xe + (size_t)(t0 + t) * half;
        xo[t] = w->xo + (size_t)(t0 + t) * half;
        acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    }
    for (int g = 0; g < groups; g++) {
        const __m256i vz = _mm256_set1_epi32(z ? z[g] : 8);
        __m256 part[2][2];
        for (int t = 0; t < 2; t++) part[t][0] = part[t][1] = _mm256_setzero_ps();
        for (int i = g * gh; i < (g + 1) * gh; i += 16) {
            __m256 v[4];
            nibbles16(q + i, vz, v);
            for (int t = 0; t < 2; t++) {
                part[t][0] = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xe[t] + i), part[t][0]);
                part[t][1] = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xo[t] + i), part[t][1]);
                part[t][0] = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xe[t] + i + 8), part[t][0]);
                part[t][1] = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xo[t] + i + 8), part[t][1]);
            }
        }
        const __m256 vs = _mm256_set1_ps(SCALE(s, g));
        for (int t = 0; t < 2; t++) {
            acc[t][0] = _mm256_fmadd_ps(vs, part[t][0], acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(vs, part[t][1], acc[t][1]);
        }
    }
    for (int t = 0; t < 2; t++) res[t] = hsum(_mm256_add_ps(acc[t][0], acc[t][1]));
}

/* The down columns of rows [0, n) of a chunk: y_t += sum_j c_tgj (q_j - z_jg), c_tgj = a_tj s_jg;
 * a: (NT, CHUNK). Rows whose a is 0 for every token of the tile are not read. */
INLINE void down_chunk_nt(const Work *w, const uint8_t *q0, const uint16_t *s0, const uint8_t *z0, int n, int t0,
                          const int NT, const float *a) {
    const int half = w->hidden / 2, gh = w->group / 2, groups = w->hidden / w->group;
    const size_t row_q = (size_t)3 * half, row_s = (size_t)3 * groups;
    int live[CHUNK], nlive = 0;
    for (int j = 0; j < n; j++) {
        int used = 0;
        for (int t = 0; t < NT; t++) used |= a[t * CHUNK + j] != 0.0f;
        if (used) live[nlive++] = j;
    }
    if (!nlive) return;
    float c[TOKEN_TILE][CHUNK];
    int zk[CHUNK];
    for (int g = 0; g < groups; g++) {
        for (int k = 0; k < nlive; k++) {
            const int j = live[k];
            const float sc = SCALE(s0 + j * row_s + 2 * groups, g);
            zk[k] = z0 ? z0[j * row_s + 2 * groups + g] : 8;
            for (int t = 0; t < NT; t++) c[t][k] = a[t * CHUNK + j] * sc;
        }
        for (int i = g * gh; i < (g + 1) * gh; i += 16) {
            __m256 acc[TOKEN_TILE][4];
            for (int t = 0; t < NT; t++)
                for (int e = 0; e < 4; e++) acc[t][e] = _mm256_setzero_ps();
            int k = 0;
            if (NT == 1) {  /* two neurons at a time into two accumulator sets: the FMA latency, not its rate */
                __m256 acc2[4];
                for (int e = 0; e < 4; e++) acc2[e] = _mm256_setzero_ps();
                for (; k + 1 < nlive; k += 2) {
                    __m256 v[4], u[4];
                    nibbles16(q0 + live[k] * row_q + 2 * half + i, _mm256_set1_epi32(zk[k]), v);
                    nibbles16(q0 + live[k + 1] * row_q + 2 * half + i, _mm256_set1_epi32(zk[k + 1]), u);
                    const __m256 ck = _mm256_broadcast_ss(&c[0][k]), cu = _mm256_broadcast_ss(&c[0][k + 1]);
                    for (int e = 0; e < 4; e++) {
                        acc[0][e] = _mm256_fmadd_ps(ck, v[e], acc[0][e]);
                        acc2[e] = _mm256_fmadd_ps(cu, u[e], acc2[e]);
                    }
                }
                for (int e = 0; e < 4; e++) acc[0][e] = _mm256_add_ps(acc[0][e], acc2[e]);
            }
            for (; k < nlive; k++) {
                __m256 v[4];
                nibbles16(q0 + live[k] * row_q + 2 * half + i, _mm256_set1_epi32(zk[k]), v);
                for (int t = 0; t < NT; t++) {
                    const __m256 ck = _mm256_broadcast_ss(&c[t][k]);
                    for (int e = 0; e < 4; e++) acc[t][e] = _mm256_fmadd_ps(ck, v[e], acc[t][e]);
                }
            }
            for (int t = 0; t < NT; t++) {
                float *ye = w->ye + (size_t)(t0 + t) * half + i, *yo = w->yo + (size_t)(t0 + t) * half + i;
                _mm256_storeu_ps(ye, _mm256_add_ps(_mm256_loadu_ps(ye), acc[t][0]));
                _mm256_storeu_ps(yo, _mm256_add_ps(_mm256_loadu_ps(yo), acc[t][1]));
                _mm256_storeu_ps(ye + 8, _mm256_add_ps(_mm256_loadu_ps(ye + 8), acc[t][2]));
                _mm256_storeu_ps(yo + 8, _mm256_add_ps(_mm256_loadu_ps(yo + 8), acc[t][3]));
            }
        }
    }
}

/* One token's gate and up dots of one neuron in one pass: each x vector is loaded once for both
 * rows (half the loads of two dot_row passes), four independent chains, 8 bytes of each row per
 * step so that everything stays in the 16 ymm registers. */
static void gate_up_1(const Work *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0, float *gate,
                      float *up) {
    const int half = w->hidden / 2, gh = w->group / 2, groups = w->hidden / w->group;
    const float *xe = w->xe + (size_t)t0 * half, *xo = w->xo + (size_t)t0 * half;
    const uint8_t *qu = q + half;
    const __m256i low = _mm256_set1_epi32(0x0f);
    __m256 ag0 = _mm256_setzero_ps(), ag1 = _mm256_setzero_ps(), au0 = _mm256_setzero_ps(), au1 = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const __m256i zg = _mm256_set1_epi32(z ? z[g] : 8), zu = _mm256_set1_epi32(z ? z[groups + g] : 8);
        __m256 pg0 = _mm256_setzero_ps(), pg1 = _mm256_setzero_ps(), pu0 = _mm256_setzero_ps(), pu1 = _mm256_setzero_ps();
        for (int i = g * gh; i < (g + 1) * gh; i += 8) {
            __m256i bg = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + i)));
            __m256i bu = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qu + i)));
            __m256 xv = _mm256_loadu_ps(xe + i);
            pg0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(bg, low), zg)), xv, pg0);
            pu0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(bu, low), zu)), xv, pu0);
            xv = _mm256_loadu_ps(xo + i);
            pg1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bg, 4), zg)), xv, pg1);
            pu1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bu, 4), zu)), xv, pu1);
        }
        const __m256 sg = _mm256_set1_ps(SCALE(s, g)), su = _mm256_set1_ps(SCALE(s, groups + g));
        ag0 = _mm256_fmadd_ps(sg, pg0, ag0);
        ag1 = _mm256_fmadd_ps(sg, pg1, ag1);
        au0 = _mm256_fmadd_ps(su, pu0, au0);
        au1 = _mm256_fmadd_ps(su, pu1, au1);
    }
    *gate = hsum(_mm256_add_ps(ag0, ag1));
    *up = hsum(_mm256_add_ps(au0, au1));
}

/* Three or four tokens: per-group partial sums would take 2 x NT x 2 registers, so the unpacked codes
 * are scaled once per 16 bytes (shared by the tokens) and summed straight into two chains per token. */
INLINE void dot_row_wide_nt(const Work *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0,
                            const int NT, float *res) {
    const int half = w->hidden / 2, gh = w->group / 2, groups = w->hidden / w->group;
    const float *xe[ACT_TILE], *xo[ACT_TILE];
    __m256 acc[ACT_TILE][2];
    for (int t = 0; t < NT; t++) {
        xe[t] = w->xe + (size_t)(t0 + t) * half;
        xo[t] = w->xo + (size_t)(t0 + t) * half;
        acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    }
    for (int g = 0; g < groups; g++) {
        const __m256i vz = _mm256_set1_epi32(z ? z[g] : 8);
        const __m256 vs = _mm256_set1_ps(SCALE(s, g));
        for (int i = g * gh; i < (g + 1) * gh; i += 16) {
            __m256 v[4];
            nibbles16(q + i, vz, v);
            for (int e = 0; e < 4; e++) v[e] = _mm256_mul_ps(v[e], vs);
            for (int t = 0; t < NT; t++) {
                acc[t][0] = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xe[t] + i), acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xo[t] + i), acc[t][1]);
                acc[t][0] = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xe[t] + i + 8), acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xo[t] + i + 8), acc[t][1]);
            }
        }
    }
    for (int t = 0; t < NT; t++) res[t] = hsum(_mm256_add_ps(acc[t][0], acc[t][1]));
}

static void dot_row(const Work *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0, int nt,
                    float *res) {
    switch (nt) {
        case 1: dot_row_wide_nt(w, q, s, z, t0, 1, res); break;  /* not reached: one token takes gate_up_1 */
        case 2: dot_row_2(w, q, s, z, t0, res); break;
        case 3: dot_row_wide_nt(w, q, s, z, t0, 3, res); break;
        default: dot_row_wide_nt(w, q, s, z, t0, 4, res); break;
    }
}

static void down_chunk(const Work *w, const uint8_t *q0, const uint16_t *s0, const uint8_t *z0, int n, int t0, int nt,
                       const float *a) {
    if (nt == 1) down_chunk_nt(w, q0, s0, z0, n, t0, 1, a);
    else down_chunk_nt(w, q0, s0, z0, n, t0, 2, a);
}

#else /* portable C: the same arithmetic, element by element */

static void dot_row(const Work *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0, int nt,
                    float *res) {
    const int half = w->hidden / 2, gh = w->group / 2, groups = w->hidden / w->group;
    for (int t = 0; t < nt; t++) {
        const float *xe = w->xe + (size_t)(t0 + t) * half, *xo = w->xo + (size_t)(t0 + t) * half;
        float acc = 0.0f;
        for (int g = 0; g < groups; g++) {
            const int zp = z ? z[g] : 8;
            float part = 0.0f;
            for (int i = g * gh; i < (g + 1) * gh; i++)
                part += (float)((q[i] & 0x0f) - zp) * xe[i] + (float)((q[i] >> 4) - zp) * xo[i];
            acc += SCALE(s, g) * part;
        }
        res[t] = acc;
    }
}

static void down_chunk(const Work *w, const uint8_t *q0, const uint16_t *s0, const uint8_t *z0, int n, int t0, int nt,
                       const float *a) {
    const int half = w->hidden / 2, gh = w->group / 2, groups = w->hidden / w->group;
    const size_t row_q = (size_t)3 * half, row_s = (size_t)3 * groups;
    for (int j = 0; j < n; j++) {
        const uint8_t *q = q0 + j * row_q + 2 * half;
        for (int t = 0; t < nt; t++) {
            if (a[t * CHUNK + j] == 0.0f) continue;
            float *ye = w->ye + (size_t)(t0 + t) * half, *yo = w->yo + (size_t)(t0 + t) * half;
            for (int g = 0; g < groups; g++) {
                const float c = a[t * CHUNK + j] * SCALE(s0 + j * row_s + 2 * groups, g);
                const int zp = z0 ? z0[j * row_s + 2 * groups + g] : 8;
                for (int i = g * gh; i < (g + 1) * gh; i++) {
                    ye[i] += c * (float)((q[i] & 0x0f) - zp);
                    yo[i] += c * (float)((q[i] >> 4) - zp);
                }
            }
        }
    }
}
#endif

static void run_rows(const Work *w) {
    const int half = w->hidden / 2, groups = w->hidden / w->group;
    const size_t row_q = (size_t)3 * half, row_s = (size_t)3 * groups;
    float act[ACT_TILE * CHUNK];
    for (int64_t c0 = w->r0; c0 < w->r1; c0 += CHUNK) {
        const int n = (int)(w->r1 - c0 < CHUNK ? w->r1 - c0 : CHUNK);
        const uint8_t *q0 = w->qweight + c0 * row_q;
        const uint16_t *s0 = w->scales + c0 * row_s;
        const uint8_t *z0 = w->zeros ? w->zeros + c0 * row_s : NULL;
        for (int t0 = 0; t0 < w->tokens; t0 += ACT_TILE) {
            const int nt = w->tokens - t0 < ACT_TILE ? w->tokens - t0 : ACT_TILE;
            for (int j = 0; j < n; j++) {
                const int64_t neuron = w->j0 + c0 + j;
                int used = 0;
                for (int t = 0; t < nt; t++) used |= !w->kt || neuron < w->kt[t0 + t];
                for (int t = 0; t < ACT_TILE; t++) act[t * CHUNK + j] = 0.0f;
                if (!used) continue;  /* no token of this tile reads row j: its bytes are not touched */
                const uint8_t *q = q0 + j * row_q;
                const uint16_t *s = s0 + j * row_s;
                const uint8_t *z = z0 ? z0 + j * row_s : NULL;
                float gate[ACT_TILE], up[ACT_TILE];
#if CRISP_AVX2
                if (nt == 1) {
                    gate_up_1(w, q, s, z, t0, gate, up);
                } else
#endif
                {
                    dot_row(w, q, s, z, t0, nt, gate);
                    dot_row(w, q + half, s + groups, z ? z + groups : NULL, t0, nt, up);
                }
                for (int t = 0; t < nt; t++) {
                    const int keep = !w->kt || neuron < w->kt[t0 + t];
                    act[t * CHUNK + j] = keep ? gate[t] / (1.0f + expf(-gate[t])) * up[t] : 0.0f;
                }
            }
            for (int d = 0; d < nt; d += TOKEN_TILE)
                down_chunk(w, q0, s0, z0, n, t0 + d, nt - d < TOKEN_TILE ? nt - d : TOKEN_TILE, act + d * CHUNK);
        }
    }
}

/* out[t, :] += weights[t] * sum_{j0 <= j < j1, j < kt[t]} a_tj down_j, for T tokens.
 * x: (T, H) fp32; qweight/scales/zeros: the expert's rows from row j0 on; kt: (T,) int64 or NULL;
 * weights: (T,) fp32; out: (T, H) fp32. Returns 0, or -1 when a buffer cannot be allocated, -2 for
 * sizes it does not take (out untouched then). */
int crisp_expert_rows_f32(const float *x, int64_t tokens, int64_t hidden, int64_t group,
                          const uint8_t *qweight, const uint16_t *scales, const uint8_t *zeros,
                          const int64_t *kt, int64_t j0, int64_t j1, const float *weights, float *out,
                          int64_t nthreads) {
    if (tokens <= 0 || j1 <= j0) return 0;
    if (tokens > MAX_TOKENS || hidden % group || group % 32 || nthreads < 1) return -2;
    const int64_t half = hidden / 2, rows = j1 - j0;
    if (nthreads > rows) nthreads = rows;
    const size_t per_thread = (size_t)tokens * (size_t)hidden;  /* ye, yo */
    float *xs = malloc(sizeof(float) * (size_t)tokens * (size_t)hidden);
    float *acc = calloc((size_t)nthreads * per_thread, sizeof(float));
    Work *work = malloc(sizeof(Work) * (size_t)nthreads);
    int rc = 0;
    if (!xs || !acc || !work) { rc = -1; goto done; }
    float *xe = xs, *xo = xs + tokens * half;
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t i = 0; i < half; i++) {
            xe[t * half + i] = x[t * hidden + 2 * i];
            xo[t * half + i] = x[t * hidden + 2 * i + 1];
        }
    }
    for (int64_t p = 0; p < nthreads; p++) {
        Work *w = &work[p];
        w->xe = xe; w->xo = xo;
        w->qweight = qweight; w->scales = scales; w->zeros = zeros; w->kt = kt; w->j0 = j0;
        w->tokens = (int)tokens; w->hidden = (int)hidden; w->group = (int)group;
        w->r0 = rows * p / nthreads; w->r1 = rows * (p + 1) / nthreads;
        w->ye = acc + (size_t)p * per_thread; w->yo = w->ye + tokens * half;
    }
    /* the ranges are fixed by nthreads (the result depends on it alone); the team is at most one thread
     * per processor, and a smaller team than there are ranges takes several each */
    const int team_size = (int)(nthreads < omp_get_num_procs() ? nthreads : omp_get_num_procs());
#pragma omp parallel num_threads(team_size)
    {
        const int team = omp_get_num_threads();
        for (int64_t p = omp_get_thread_num(); p < nthreads; p += team) run_rows(&work[p]);
    }
    for (int64_t t = 0; t < tokens; t++) {
        const float wt = weights[t];
        for (int64_t i = 0; i < half; i++) {
            float e = 0.0f, o = 0.0f;
            for (int64_t p = 0; p < nthreads; p++) {
                e += work[p].ye[t * half + i];
                o += work[p].yo[t * half + i];
            }
            out[t * hidden + 2 * i] += wt * e;
            out[t * hidden + 2 * i + 1] += wt * o;
        }
    }
done:
    free(xs); free(acc); free(work);
    return rc;
}

int crisp_native_abi(void) { return 1; }
