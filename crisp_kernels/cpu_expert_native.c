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
 * operands without shuffles. The zero point leaves the inner loop: sum_h x_h (q_h - z) s =
 * s (sum_h x_h q_h - z xsum_group).
 *
 * Threads: neurons are split into nthreads contiguous ranges (pthreads; no OpenMP, whose runtime
 * would be a second one beside torch's), each with its own (T, H) accumulator, summed at the end
 * in a fixed order: the result does not depend on timing, only on nthreads.
 */
#include <math.h>
#include <pthread.h>
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
#define TOKEN_TILE 4    /* tokens whose accumulators stay in registers at once */

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
#endif

typedef struct {
    /* shared, read-only */
    const float *xe, *xo;      /* (T, H/2) even / odd elements of x */
    const float *xsum;         /* (T, G) sum of x over each group */
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

INLINE float scale_of(const uint16_t *s, int g) { return _cvtsh_ss(s[g]); }

/* 16 bytes of a row: elements 2i (lo) and 2i + 1 (hi) of bytes [i, i + 8) and [i + 8, i + 16). */
INLINE void nibbles16(const uint8_t *q, __m256 *lo0, __m256 *hi0, __m256 *lo1, __m256 *hi1) {
    const __m256i low = _mm256_set1_epi32(0x0f);
    __m128i b16 = _mm_loadu_si128((const __m128i *)q);
    __m256i b0 = _mm256_cvtepu8_epi32(b16), b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b16, 8));
    *lo0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));
    *hi0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    *lo1 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));
    *hi1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
}

INLINE float hsum(__m256 a) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
    return _mm_cvtss_f32(v);
}

/* NT is a constant at every call (the switch below), so the accumulators stay in registers:
 * NT * NACC of them, NACC = 4 / 2 / 1 independent chains per token for NT = 1 / 2 / >= 3 (one
 * token needs several chains to cover the FMA latency; four tokens with two chains each spilled:
 * 2.3x slower per token than three). The group's scale multiplies the unpacked values once,
 * shared by every token. */
INLINE void dot_row_nt(const Work *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0, const int NT,
                       float *res) {
    const int half = w->hidden / 2, gh = w->group / 2, groups = w->hidden / w->group;
    const int NACC = NT == 1 ? 4 : NT == 2 ? 2 : 1;
    const float *xe[TOKEN_TILE], *xo[TOKEN_TILE];
    __m256 acc[TOKEN_TILE][4];
    float zterm[TOKEN_TILE];
    for (int t = 0; t < NT; t++) {
        xe[t] = w->xe + (size_t)(t0 + t) * half;
        xo[t] = w->xo + (size_t)(t0 + t) * half;
        for (int a = 0; a < NACC; a++) acc[t][a] = _mm256_setzero_ps();
        zterm[t] = 0.0f;
    }
    for (int g = 0; g < groups; g++) {
        const float sc = scale_of(s, g), zp = z ? (float)z[g] : 8.0f;
        const __m256 vs = _mm256_set1_ps(sc);
        for (int i = g * gh; i < (g + 1) * gh; i += 16) {
            __m256 lo0, hi0, lo1, hi1;
            nibbles16(q + i, &lo0, &hi0, &lo1, &hi1);
            lo0 = _mm256_mul_ps(lo0, vs); hi0 = _mm256_mul_ps(hi0, vs);
            lo1 = _mm256_mul_ps(lo1, vs); hi1 = _mm256_mul_ps(hi1, vs);
            for (int t = 0; t < NT; t++) {
                acc[t][0] = _mm256_fmadd_ps(lo0, _mm256_loadu_ps(xe[t] + i), acc[t][0]);
                acc[t][1 % NACC] = _mm256_fmadd_ps(hi0, _mm256_loadu_ps(xo[t] + i), acc[t][1 % NACC]);
                acc[t][2 % NACC] = _mm256_fmadd_ps(lo1, _mm256_loadu_ps(xe[t] + i + 8), acc[t][2 % NACC]);
                acc[t][3 % NACC] = _mm256_fmadd_ps(hi1, _mm256_loadu_ps(xo[t] + i + 8), acc[t][3 % NACC]);
            }
        }
        for (int t = 0; t < NT; t++) zterm[t] += sc * zp * w->xsum[(size_t)(t0 + t) * groups + g];
    }
    for (int t = 0; t < NT; t++) {
        __m256 sum = acc[t][0];
        for (int a = 1; a < NACC; a++) sum = _mm256_add_ps(sum, acc[t][a]);
        res[t] = hsum(sum) - zterm[t];
    }
}

INLINE void axpy_row_nt(const Work *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0, const int NT,
                        const float *a) {
    const int half = w->hidden / 2, gh = w->group / 2, groups = w->hidden / w->group;
    float *ye[TOKEN_TILE], *yo[TOKEN_TILE];
    for (int t = 0; t < NT; t++) {
        ye[t] = w->ye + (size_t)(t0 + t) * half;
        yo[t] = w->yo + (size_t)(t0 + t) * half;
    }
    for (int g = 0; g < groups; g++) {
        const float sc = scale_of(s, g);
        const __m256 vz = _mm256_set1_ps(z ? (float)z[g] : 8.0f);
        __m256 c[TOKEN_TILE];
        for (int t = 0; t < NT; t++) c[t] = _mm256_set1_ps(a[t] * sc);
        for (int i = g * gh; i < (g + 1) * gh; i += 16) {
            __m256 lo0, hi0, lo1, hi1;
            nibbles16(q + i, &lo0, &hi0, &lo1, &hi1);
            lo0 = _mm256_sub_ps(lo0, vz); hi0 = _mm256_sub_ps(hi0, vz);
            lo1 = _mm256_sub_ps(lo1, vz); hi1 = _mm256_sub_ps(hi1, vz);
            for (int t = 0; t < NT; t++) {
                _mm256_storeu_ps(ye[t] + i, _mm256_fmadd_ps(c[t], lo0, _mm256_loadu_ps(ye[t] + i)));
                _mm256_storeu_ps(yo[t] + i, _mm256_fmadd_ps(c[t], hi0, _mm256_loadu_ps(yo[t] + i)));
                _mm256_storeu_ps(ye[t] + i + 8, _mm256_fmadd_ps(c[t], lo1, _mm256_loadu_ps(ye[t] + i + 8)));
                _mm256_storeu_ps(yo[t] + i + 8, _mm256_fmadd_ps(c[t], hi1, _mm256_loadu_ps(yo[t] + i + 8)));
            }
        }
    }
}

static void dot_row(const Work *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0, int nt,
                    float *res) {
    switch (nt) {
        case 1: dot_row_nt(w, q, s, z, t0, 1, res); break;
        case 2: dot_row_nt(w, q, s, z, t0, 2, res); break;
        case 3: dot_row_nt(w, q, s, z, t0, 3, res); break;
        default: dot_row_nt(w, q, s, z, t0, 4, res); break;
    }
}

static void axpy_row(const Work *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0, int nt,
                     const float *a) {
    switch (nt) {
        case 1: axpy_row_nt(w, q, s, z, t0, 1, a); break;
        case 2: axpy_row_nt(w, q, s, z, t0, 2, a); break;
        case 3: axpy_row_nt(w, q, s, z, t0, 3, a); break;
        default: axpy_row_nt(w, q, s, z, t0, 4, a); break;
    }
}

#else /* portable C: the same arithmetic, element by element */

static void dot_row(const Work *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0, int nt,
                    float *res) {
    const int half = w->hidden / 2, gh = w->group / 2, groups = w->hidden / w->group;
    for (int t = 0; t < nt; t++) {
        const float *xe = w->xe + (size_t)(t0 + t) * half, *xo = w->xo + (size_t)(t0 + t) * half;
        float acc = 0.0f, zterm = 0.0f;
        for (int g = 0; g < groups; g++) {
            const float sc = half_to_float(s[g]), zp = z ? (float)z[g] : 8.0f;
            float part = 0.0f;
            for (int i = g * gh; i < (g + 1) * gh; i++) part += (float)(q[i] & 0x0f) * xe[i] + (float)(q[i] >> 4) * xo[i];
            acc += sc * part;
            zterm += sc * zp * w->xsum[(size_t)(t0 + t) * groups + g];
        }
        res[t] = acc - zterm;
    }
}

static void axpy_row(const Work *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0, int nt,
                     const float *a) {
    const int half = w->hidden / 2, gh = w->group / 2, groups = w->hidden / w->group;
    for (int g = 0; g < groups; g++) {
        const float sc = half_to_float(s[g]), zp = z ? (float)z[g] : 8.0f;
        for (int t = 0; t < nt; t++) {
            const float c = a[t] * sc;
            float *ye = w->ye + (size_t)(t0 + t) * half, *yo = w->yo + (size_t)(t0 + t) * half;
            for (int i = g * gh; i < (g + 1) * gh; i++) {
                ye[i] += c * ((float)(q[i] & 0x0f) - zp);
                yo[i] += c * ((float)(q[i] >> 4) - zp);
            }
        }
    }
}
#endif

static void *run_rows(void *arg) {
    const Work *w = (const Work *)arg;
    const int half = w->hidden / 2, groups = w->hidden / w->group;
    const size_t row_q = (size_t)3 * half, row_s = (size_t)3 * groups;
    for (int64_t r = w->r0; r < w->r1; r++) {
        const int64_t j = w->j0 + r;
        const uint8_t *q = w->qweight + r * row_q;
        const uint16_t *s = w->scales + r * row_s;
        const uint8_t *z = w->zeros ? w->zeros + r * row_s : NULL;
        for (int t0 = 0; t0 < w->tokens; t0 += TOKEN_TILE) {
            int nt = w->tokens - t0 < TOKEN_TILE ? w->tokens - t0 : TOKEN_TILE;
            int used = 0;
            for (int t = 0; t < nt; t++) used |= !w->kt || j < w->kt[t0 + t];
            if (!used) continue;  /* no token of this tile reads row j: its bytes are not touched */
            float gate[TOKEN_TILE], up[TOKEN_TILE], act[TOKEN_TILE];
            dot_row(w, q, s, z, t0, nt, gate);
            dot_row(w, q + half, s + groups, z ? z + groups : NULL, t0, nt, up);
            for (int t = 0; t < nt; t++) {
                const int keep = !w->kt || j < w->kt[t0 + t];
                act[t] = keep ? gate[t] / (1.0f + expf(-gate[t])) * up[t] : 0.0f;
            }
            axpy_row(w, q + 2 * half, s + 2 * groups, z ? z + 2 * groups : NULL, t0, nt, act);
        }
    }
    return NULL;
}

/* out[t, :] += weights[t] * sum_{j0 <= j < j1, j < kt[t]} a_tj down_j, for T tokens.
 * x: (T, H) fp32; qweight/scales/zeros: the expert's rows from row j0 on; kt: (T,) int64 or NULL;
 * weights: (T,) fp32; out: (T, H) fp32. Returns 0, or -1 when a buffer cannot be allocated or a
 * thread started (out untouched then). */
int crisp_expert_rows_f32(const float *x, int64_t tokens, int64_t hidden, int64_t group,
                          const uint8_t *qweight, const uint16_t *scales, const uint8_t *zeros,
                          const int64_t *kt, int64_t j0, int64_t j1, const float *weights, float *out,
                          int64_t nthreads) {
    if (tokens <= 0 || j1 <= j0) return 0;
    if (tokens > MAX_TOKENS || hidden % group || group % 16 || nthreads < 1) return -2;
    const int64_t half = hidden / 2, groups = hidden / group, rows = j1 - j0;
    if (nthreads > rows) nthreads = rows;
    float *xs = malloc(sizeof(float) * (size_t)tokens * (size_t)(hidden + groups));
    float *acc = calloc((size_t)nthreads * (size_t)tokens * (size_t)hidden, sizeof(float));
    Work *work = malloc(sizeof(Work) * (size_t)nthreads);
    pthread_t *tid = malloc(sizeof(pthread_t) * (size_t)nthreads);
    int rc = 0;
    if (!xs || !acc || !work || !tid) { rc = -1; goto done; }
    float *xe = xs, *xo = xs + tokens * half, *xsum = xs + tokens * hidden;
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t i = 0; i < half; i++) {
            xe[t * half + i] = x[t * hidden + 2 * i];
            xo[t * half + i] = x[t * hidden + 2 * i + 1];
        }
        for (int64_t g = 0; g < groups; g++) {
            float sum = 0.0f;
            for (int64_t h = g * group; h < (g + 1) * group; h++) sum += x[t * hidden + h];
            xsum[t * groups + g] = sum;
        }
    }
    int64_t started = 0;
    for (int64_t p = 0; p < nthreads; p++) {
        Work *w = &work[p];
        w->xe = xe; w->xo = xo; w->xsum = xsum;
        w->qweight = qweight; w->scales = scales; w->zeros = zeros; w->kt = kt; w->j0 = j0;
        w->tokens = (int)tokens; w->hidden = (int)hidden; w->group = (int)group;
        w->r0 = rows * p / nthreads; w->r1 = rows * (p + 1) / nthreads;
        w->ye = acc + (size_t)p * tokens * hidden; w->yo = w->ye + tokens * half;
    }
    for (int64_t p = 1; p < nthreads; p++) {
        if (pthread_create(&tid[p], NULL, run_rows, &work[p]) != 0) { rc = -1; break; }
        started = p;
    }
    run_rows(&work[0]);
    for (int64_t p = 1; p <= started; p++) pthread_join(tid[p], NULL);
    if (rc) goto done;
    for (int64_t t = 0; t < tokens; t++) {
        const float wt = weights[t];
        for (int64_t i = 0; i < half; i++) {
            float e = 0.0f, o = 0.0f;
            for (int64_t p = 0; p < nthreads; p++) {
                const float *ye = acc + (size_t)p * tokens * hidden + t * half;
                e += ye[i];
                o += ye[tokens * half + i];
            }
            out[t * hidden + 2 * i] += wt * e;
            out[t * hidden + 2 * i + 1] += wt * o;
        }
    }
done:
    free(xs); free(acc); free(work); free(tid);
    return rc;
}

int crisp_native_abi(void) { return 1; }
