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
 * rows (CHUNK x 3 H / 2 bytes, 192 KB at H 4096) stay in L2 between the two passes. With several
 * tokens the gate/up pass takes tiles of ACT_TILE tokens (gate_up_nt: 8 with AVX-512, 4 with AVX2),
 * unpacking each row once per tile, and the down pass tiles of TOKEN_TILE.
 *
 * Vectors: one source for AVX-512 (16 lanes), AVX2 + FMA (8) and portable C, chosen at build time by
 * -march=native (the vector macros below). At T = 1 the kernel was bound by the memory stream more than by
 * its instructions on a Zen 4 VM: prefetching the next row's gate and up bytes (prefetch_next_row) took a
 * Mixtral expert from 9.97 to 7.01 ms with AVX2, and AVX-512 to 6.15 ms, on both cores (docs/cpu-kernel.md).
 * Since then one core is bound by its instructions: 0.82-1.0 us per row whether the rows come from DRAM or
 * from L3 (2-core Zen 4 VM).
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

#if defined(__AVX512F__) && defined(__FMA__)
#include <immintrin.h>
#define CRISP_SIMD 512
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CRISP_SIMD 256
#else
#define CRISP_SIMD 0
#endif

#define MAX_TOKENS 64   /* checked by the caller */
#if CRISP_SIMD == 512
/* tokens of a down pass, whose accumulators stay in registers: 8 of the 32 zmm (4 against 2: 5-7% faster at
 * T = 3..16 on the Zen 4 VM, one pass unpacks each down column once for the whole 4-token tile; 8 tokens, 16
 * zmm: no faster at T = 8..16 and 4% slower at T = 1 on a Zen 4 VM) */
#define TOKEN_TILE 4
#define ACT_TILE 8      /* tokens of a gate/up pass (gate_up_nt) */
#define SPLIT_TOKENS 4  /* gate_up_nt's tiles with even / odd chains of their own */
#else
#define TOKEN_TILE 2    /* of the 16 ymm: 2 tokens x 4 accumulators */
#define ACT_TILE 4      /* tokens of a gate/up pass (gate_up_nt; ACT_TILE / TOKEN_TILE down passes each) */
#define SPLIT_TOKENS 2  /* 4: the split accumulators spill, 15-19% slower at T = 3..8 */
#endif
#define CHUNK 32        /* neurons per chunk (see the header) */

#if !CRISP_SIMD
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
    const float *xp;           /* x packed by token tile (pack_tiles): one address register for a whole tile */
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

#if CRISP_SIMD
#define INLINE static inline __attribute__((always_inline))
/* The token loops of a tile must unroll completely for its accumulators to live in registers: gcc 12's
 * default heuristics stop short of 5 or more tokens (T = 5 ran 2.2x slower than T = 4 on the Zen 4 VM). */
#define UNROLL_TILE _Pragma("GCC unroll 8")

/* The passes prefetch the rows they read next in software, ROWS_AHEAD rows on, into L2 (prefetcht1). Measured on
 * one core of the 2-core AMD EPYC VM with AVX-512 (Zen 4), the 8-bit-activation kernel on an H 4096 x I 14336
 * expert from DRAM at T = 1: one row ahead into L1 (prefetcht0) took 9.5-10.1 ms (38-45% of a streaming read);
 * into L2 5.0-5.8 ms at 1 to 4 rows ahead, 6.4 into L3 (prefetcht2), 9.4 non-temporal. The same rows from L3 took
 * 0.6 ms per 2,048 neurons either way: L1's few outstanding misses, not the arithmetic, had bounded the pass. */
#define ROWS_AHEAD 2
#define ROW_PREFETCH _MM_HINT_T1

/* One vector type of VL floats for both instruction sets: the kernel below is written once. A 16-byte
 * step of a row holds 32 elements, NV vectors of even and NV of odd elements. With AVX-512 a step is one
 * widening load of 16 bytes into 16 lanes, so the passes issue half the instructions of AVX2 for the
 * same bytes (once the row prefetch feeds the stream, they count: 7.01 -> 6.15 ms above). */
#if CRISP_SIMD == 512
typedef __m512 vf;
typedef __m512i vi;
#define VL 16
#define V_LOAD _mm512_loadu_ps
#define V_STORE _mm512_storeu_ps
#define V_FMA _mm512_fmadd_ps
#define V_ADD _mm512_add_ps
#define V_MUL _mm512_mul_ps
#define V_ZERO _mm512_setzero_ps
#define V_SET1 _mm512_set1_ps
#define VI_SET1 _mm512_set1_epi32
#define VI_AND _mm512_and_si512
#define VI_SUB _mm512_sub_epi32
#define VI_SRLI _mm512_srli_epi32
#define VI_CVT _mm512_cvtepi32_ps
#define BYTES_TO_VI(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))  /* VL bytes */
#else
typedef __m256 vf;
typedef __m256i vi;
#define VL 8
#define V_LOAD _mm256_loadu_ps
#define V_STORE _mm256_storeu_ps
#define V_FMA _mm256_fmadd_ps
#define V_ADD _mm256_add_ps
#define V_MUL _mm256_mul_ps
#define V_ZERO _mm256_setzero_ps
#define V_SET1 _mm256_set1_ps
#define VI_SET1 _mm256_set1_epi32
#define VI_AND _mm256_and_si256
#define VI_SUB _mm256_sub_epi32
#define VI_SRLI _mm256_srli_epi32
#define VI_CVT _mm256_cvtepi32_ps
#define BYTES_TO_VI(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))  /* VL bytes */
#endif
#define NV (16 / VL)  /* vectors of each parity in a 16-byte step */

/* 16 bytes of a row as q - z: v[2h] = even elements of bytes [i + h VL, i + (h + 1) VL), v[2h + 1] = odd. */
INLINE void nibbles16(const uint8_t *q, vi vz, vf v[2 * NV]) {
    const vi low = VI_SET1(0x0f);
    for (int h = 0; h < NV; h++) {
        const vi b = BYTES_TO_VI(q + h * VL);
        v[2 * h] = VI_CVT(VI_SUB(VI_AND(b, low), vz));
        v[2 * h + 1] = VI_CVT(VI_SUB(VI_SRLI(b, 4), vz));
    }
}

#if CRISP_SIMD == 512
/* The 16 codes' values (q - z) s of one group as a vpermps table: one permute turns 16 codes into scaled
 * values, where the arithmetic takes a subtraction and a conversion (and a multiplication per group).
 * (q - z) s is exact in fp32 (at most 5 significant bits times an fp16 scale's 11). Used at T = 1 only
 * (gate_up_1): 2-8% faster there (12 of 12 width / thread configurations over two same-round runs);
 * in gate_up_nt, where the unpacking is shared by the tile, and in the one-token down pass: no gain. */
INLINE vf code_table(int zp, float scale) {
    const vf iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return V_MUL(_mm512_sub_ps(iota, V_SET1((float)zp)), V_SET1(scale));
}

/* 16 bytes of a row through a code table: v[0] = even elements, v[1] = odd. */
INLINE void nibbles16_lut(const uint8_t *q, vf table, vf v[2]) {
    const vi b = BYTES_TO_VI(q);
    v[0] = _mm512_permutexvar_ps(VI_AND(b, VI_SET1(0x0f)), table);
    v[1] = _mm512_permutexvar_ps(VI_SRLI(b, 4), table);
}
#endif

INLINE float hsum8(__m256 a) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
    return _mm_cvtss_f32(v);
}

/* The same bytes of the row ROWS_AHEAD neurons on (3 H / 2 bytes a row), one cache line at a time: at T = 1 the
 * gate/up pass streams two ranges of each row (gate and up), and the hardware prefetcher alone left the
 * AVX-512 kernel at 9.2 ms for a Mixtral expert with both cores of a Zen 4 VM against 7.2 ms with the next row
 * prefetched into L1 (one core: 18.3 -> 14.6 ms); two rows on into L2 took one core from 11.6-12.0 to 11.2-11.3 ms
 * (the pass's fp32 arithmetic bounds it). Prefetches do not fault, so points past the end of the rows are
 * harmless. */
INLINE void prefetch_next_row(const uint8_t *q, int n, int half) {
    for (int i = 0; i < n; i += 64) _mm_prefetch((const char *)(q + 3 * (size_t)ROWS_AHEAD * half + i), ROW_PREFETCH);
}

INLINE float hsum(vf a) {
#if CRISP_SIMD == 512
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)));
#else
    return hsum8(a);
#endif
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
            vf acc[TOKEN_TILE][2 * NV];  /* acc[t][2h] -> ye + i + h VL, acc[t][2h + 1] -> yo + i + h VL */
            for (int t = 0; t < NT; t++)
                for (int e = 0; e < 2 * NV; e++) acc[t][e] = V_ZERO();
            int k = 0;
            if (NT == 1) {  /* two neurons at a time into two accumulator sets: the FMA latency, not its rate */
                vf acc2[2 * NV];
                for (int e = 0; e < 2 * NV; e++) acc2[e] = V_ZERO();
                for (; k + 1 < nlive; k += 2) {
                    vf v[2 * NV], u[2 * NV];
                    nibbles16(q0 + live[k] * row_q + 2 * half + i, VI_SET1(zk[k]), v);
                    nibbles16(q0 + live[k + 1] * row_q + 2 * half + i, VI_SET1(zk[k + 1]), u);
                    const vf ck = V_SET1(c[0][k]), cu = V_SET1(c[0][k + 1]);
                    for (int e = 0; e < 2 * NV; e++) {
                        acc[0][e] = V_FMA(ck, v[e], acc[0][e]);
                        acc2[e] = V_FMA(cu, u[e], acc2[e]);
                    }
                }
                for (int e = 0; e < 2 * NV; e++) acc[0][e] = V_ADD(acc[0][e], acc2[e]);
            }
            for (; k < nlive; k++) {
                vf v[2 * NV];
                nibbles16(q0 + live[k] * row_q + 2 * half + i, VI_SET1(zk[k]), v);
                UNROLL_TILE
                for (int t = 0; t < NT; t++) {
                    const vf ck = V_SET1(c[t][k]);
                    for (int e = 0; e < 2 * NV; e++) acc[t][e] = V_FMA(ck, v[e], acc[t][e]);
                }
            }
            for (int t = 0; t < NT; t++) {
                float *ye = w->ye + (size_t)(t0 + t) * half + i, *yo = w->yo + (size_t)(t0 + t) * half + i;
                for (int h = 0; h < NV; h++) {
                    V_STORE(ye + h * VL, V_ADD(V_LOAD(ye + h * VL), acc[t][2 * h]));
                    V_STORE(yo + h * VL, V_ADD(V_LOAD(yo + h * VL), acc[t][2 * h + 1]));
                }
            }
        }
    }
}

/* One token's gate and up dots of one neuron in one pass: each x vector is loaded once for both
 * rows (half the loads of two dot_row passes), four independent chains, VL bytes of each row per
 * step so that everything stays in registers. */
#if CRISP_SIMD == 512  /* the codes through their group's table (code_table), each product already scaled */
static void gate_up_1(const Work *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0, float *gate,
                      float *up) {
    const int half = w->hidden / 2, gh = w->group / 2, groups = w->hidden / w->group;
    const float *xe = w->xe + (size_t)t0 * half, *xo = w->xo + (size_t)t0 * half;
    const uint8_t *qu = q + half;
    vf ag0 = V_ZERO(), ag1 = V_ZERO(), au0 = V_ZERO(), au1 = V_ZERO();
    for (int g = 0; g < groups; g++) {
        const vf tg = code_table(z ? z[g] : 8, SCALE(s, g)), tu = code_table(z ? z[groups + g] : 8, SCALE(s, groups + g));
        prefetch_next_row(q + g * gh, gh, half);
        prefetch_next_row(qu + g * gh, gh, half);
        for (int i = g * gh; i < (g + 1) * gh; i += 16) {
            vf vg[2], vu[2];
            nibbles16_lut(q + i, tg, vg);
            nibbles16_lut(qu + i, tu, vu);
            const vf e = V_LOAD(xe + i), o = V_LOAD(xo + i);
            ag0 = V_FMA(vg[0], e, ag0);
            ag1 = V_FMA(vg[1], o, ag1);
            au0 = V_FMA(vu[0], e, au0);
            au1 = V_FMA(vu[1], o, au1);
        }
    }
    *gate = hsum(V_ADD(ag0, ag1));
    *up = hsum(V_ADD(au0, au1));
}
#else
static void gate_up_1(const Work *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0, float *gate,
                      float *up) {
    const int half = w->hidden / 2, gh = w->group / 2, groups = w->hidden / w->group;
    const float *xe = w->xe + (size_t)t0 * half, *xo = w->xo + (size_t)t0 * half;
    const uint8_t *qu = q + half;
    const vi low = VI_SET1(0x0f);
    vf ag0 = V_ZERO(), ag1 = V_ZERO(), au0 = V_ZERO(), au1 = V_ZERO();
    for (int g = 0; g < groups; g++) {
        const vi zg = VI_SET1(z ? z[g] : 8), zu = VI_SET1(z ? z[groups + g] : 8);
        vf pg0 = V_ZERO(), pg1 = V_ZERO(), pu0 = V_ZERO(), pu1 = V_ZERO();
        prefetch_next_row(q + g * gh, gh, half);
        prefetch_next_row(qu + g * gh, gh, half);
        for (int i = g * gh; i < (g + 1) * gh; i += VL) {
            const vi bg = BYTES_TO_VI(q + i), bu = BYTES_TO_VI(qu + i);
            vf xv = V_LOAD(xe + i);
            pg0 = V_FMA(VI_CVT(VI_SUB(VI_AND(bg, low), zg)), xv, pg0);
            pu0 = V_FMA(VI_CVT(VI_SUB(VI_AND(bu, low), zu)), xv, pu0);
            xv = V_LOAD(xo + i);
            pg1 = V_FMA(VI_CVT(VI_SUB(VI_SRLI(bg, 4), zg)), xv, pg1);
            pu1 = V_FMA(VI_CVT(VI_SUB(VI_SRLI(bu, 4), zu)), xv, pu1);
        }
        const vf sg = V_SET1(SCALE(s, g)), su = V_SET1(SCALE(s, groups + g));
        ag0 = V_FMA(sg, pg0, ag0);
        ag1 = V_FMA(sg, pg1, ag1);
        au0 = V_FMA(su, pu0, au0);
        au1 = V_FMA(su, pu1, au1);
    }
    *gate = hsum(V_ADD(ag0, ag1));
    *up = hsum(V_ADD(au0, au1));
}
#endif

/* Two to ACT_TILE tokens' gate and up dots of one neuron in one pass over its two rows: each 16-byte step
 * is unpacked and scaled once for all NT tokens, VL bytes at a time (4 vectors live: AVX2's 16 ymm hold a
 * 4-token tile beside them, AVX-512's 32 zmm an 8-token one), and each token's x vectors, packed tile by tile
 * (pack_tiles) so that one address register serves the tile, are loaded once for both rows. dot_row_2 /
 * dot_row_wide_nt, which this replaced, unpacked each row once per 2 or 4 tokens and loaded x once per row,
 * from a pointer per token (16 at NT = 8: more than the general registers). A Mixtral expert on the Zen 4
 * VM, both cores, same rounds, AVX-512: T = 4 18.8 -> 14.8 ms, T = 8 40.1 -> 28.8, T = 16 74.9 -> 59.4; T = 2
 * 11.4 -> 10.5; AVX2 code (-mno-avx512f) on the same VM: T = 2 14.3 -> 13.9, T = 3 19.4 -> 17.3, T = 4
 * 24.5 -> 21.1, T = 8 47.0 -> 40.2 (interleaved A/B of the two builds). */
INLINE void gate_up_nt(const Work *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0, const int NT,
                       float *gate, float *up) {
    const int half = w->hidden / 2, gh = w->group / 2, groups = w->hidden / w->group;
    const uint8_t *qu = q + half;
    const float *xp = w->xp + (size_t)t0 * w->hidden;  /* this tile's NT tokens, packed (pack_tiles) */
    const vi low = VI_SET1(0x0f);
    /* few tokens: even and odd elements in chains of their own (fewer chains cannot cover the FMA latency);
     * more: one chain per token and row (the split accumulators would not fit) */
    const int SPLIT = NT <= SPLIT_TOKENS;
    vf ag[ACT_TILE][2], au[ACT_TILE][2];
    for (int t = 0; t < NT; t++) ag[t][0] = ag[t][1] = au[t][0] = au[t][1] = V_ZERO();
    for (int g = 0; g < groups; g++) {
        const vi zg = VI_SET1(z ? z[g] : 8), zu = VI_SET1(z ? z[groups + g] : 8);
        const vf sg = V_SET1(SCALE(s, g)), su = V_SET1(SCALE(s, groups + g));
        prefetch_next_row(q + g * gh, gh, half);
        prefetch_next_row(qu + g * gh, gh, half);
        for (int i = g * gh; i < (g + 1) * gh; i += 16) {
            const float *xb = xp + (size_t)i * 2 * NT;  /* step i / 16: NT x (16 even, 16 odd) floats */
            for (int h = 0; h < NV; h++) {  /* bytes [i + h VL, i + (h + 1) VL) */
                const vi bg = BYTES_TO_VI(q + i + h * VL), bu = BYTES_TO_VI(qu + i + h * VL);
                const vf ge = V_MUL(VI_CVT(VI_SUB(VI_AND(bg, low), zg)), sg);
                const vf go = V_MUL(VI_CVT(VI_SUB(VI_SRLI(bg, 4), zg)), sg);
                const vf ue = V_MUL(VI_CVT(VI_SUB(VI_AND(bu, low), zu)), su);
                const vf uo = V_MUL(VI_CVT(VI_SUB(VI_SRLI(bu, 4), zu)), su);
                UNROLL_TILE
                for (int t = 0; t < NT; t++) {
                    const vf e = V_LOAD(xb + 32 * t + h * VL), o = V_LOAD(xb + 32 * t + 16 + h * VL);
                    if (SPLIT) {
                        ag[t][0] = V_FMA(ge, e, ag[t][0]);
                        ag[t][1] = V_FMA(go, o, ag[t][1]);
                        au[t][0] = V_FMA(ue, e, au[t][0]);
                        au[t][1] = V_FMA(uo, o, au[t][1]);
                    } else {
                        ag[t][0] = V_FMA(go, o, V_FMA(ge, e, ag[t][0]));
                        au[t][0] = V_FMA(uo, o, V_FMA(ue, e, au[t][0]));
                    }
                }
            }
        }
    }
    for (int t = 0; t < NT; t++) {
        gate[t] = hsum(V_ADD(ag[t][0], ag[t][1]));
        up[t] = hsum(V_ADD(au[t][0], au[t][1]));
    }
}

static void gate_up(const Work *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0, int nt,
                    float *gate, float *up) {
    switch (nt) {  /* 1 < nt <= ACT_TILE: a constant NT per case keeps the tile in registers */
        case 2: gate_up_nt(w, q, s, z, t0, 2, gate, up); break;
        case 3: gate_up_nt(w, q, s, z, t0, 3, gate, up); break;
#if ACT_TILE > 4
        case 4: gate_up_nt(w, q, s, z, t0, 4, gate, up); break;
        case 5: gate_up_nt(w, q, s, z, t0, 5, gate, up); break;
        case 6: gate_up_nt(w, q, s, z, t0, 6, gate, up); break;
        case 7: gate_up_nt(w, q, s, z, t0, 7, gate, up); break;
#endif
        default: gate_up_nt(w, q, s, z, t0, ACT_TILE, gate, up); break;
    }
}

static void down_chunk(const Work *w, const uint8_t *q0, const uint16_t *s0, const uint8_t *z0, int n, int t0, int nt,
                       const float *a) {
    switch (nt) {  /* nt <= TOKEN_TILE */
        case 1: down_chunk_nt(w, q0, s0, z0, n, t0, 1, a); break;
#if TOKEN_TILE > 2
        case 3: down_chunk_nt(w, q0, s0, z0, n, t0, 3, a); break;
        case 4: down_chunk_nt(w, q0, s0, z0, n, t0, 4, a); break;
#endif
        default: down_chunk_nt(w, q0, s0, z0, n, t0, 2, a); break;
    }
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
#if CRISP_SIMD
                if (nt == 1)
                    gate_up_1(w, q, s, z, t0, gate, up);
                else
                    gate_up(w, q, s, z, t0, nt, gate, up);
#else
                dot_row(w, q, s, z, t0, nt, gate);
                dot_row(w, q + half, s + groups, z ? z + groups : NULL, t0, nt, up);
#endif
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

#if CRISP_SIMD
/* x for the multi-token gate/up pass (gate_up_nt): tile by tile (ACT_TILE tokens, the last one nt), for each 16-byte
 * step i of a row, each token's 16 even then 16 odd elements: a tile at t0 starts at t0 H floats and its
 * step i at i / 16 x 32 nt floats on. */
static void pack_tiles(const float *xe, const float *xo, int tokens, int half, float *xp) {
    for (int t0 = 0; t0 < tokens; t0 += ACT_TILE) {
        const int nt = tokens - t0 < ACT_TILE ? tokens - t0 : ACT_TILE;
        float *tile = xp + (size_t)t0 * 2 * half;
        for (int i = 0; i < half; i += 16)
            for (int t = 0; t < nt; t++) {
                float *dst = tile + (size_t)i * 2 * nt + 32 * t;
                memcpy(dst, xe + (size_t)(t0 + t) * half + i, 16 * sizeof(float));
                memcpy(dst + 16, xo + (size_t)(t0 + t) * half + i, 16 * sizeof(float));
            }
    }
}
#endif

/* out[t] += weights[t] (sum over the threads' accumulators, in thread order): thread p's (T, H) accumulator at
 * acc + p T H, its even elements first ((T, H/2) ye), then its odd ones (yo). */
static void add_thread_sums(const float *acc, int64_t nthreads, int64_t tokens, int64_t hidden, const float *weights,
                            float *out) {
    const int64_t half = hidden / 2;
    const size_t per_thread = (size_t)tokens * (size_t)hidden;
    for (int64_t t = 0; t < tokens; t++) {
        const float wt = weights[t];
        for (int64_t i = 0; i < half; i++) {
            float e = 0.0f, o = 0.0f;
            for (int64_t p = 0; p < nthreads; p++) {
                const float *ye = acc + (size_t)p * per_thread;
                e += ye[t * half + i];
                o += ye[tokens * half + t * half + i];
            }
            out[t * hidden + 2 * i] += wt * e;
            out[t * hidden + 2 * i + 1] += wt * o;
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
    float *xs = malloc(sizeof(float) * 2 * (size_t)tokens * (size_t)hidden);  /* xe, xo; then xp */
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
    float *xp = xs + tokens * hidden;
#if CRISP_SIMD
    if (tokens > 1) pack_tiles(xe, xo, (int)tokens, (int)half, xp);  /* read by gate_up_nt only */
#endif
    for (int64_t p = 0; p < nthreads; p++) {
        Work *w = &work[p];
        w->xe = xe; w->xo = xo; w->xp = xp;
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
    add_thread_sums(acc, nthreads, tokens, hidden, weights, out);
done:
    free(xs); free(acc); free(work);
    return rc;
}

/* ================================================================ 8-bit activations (crisp_expert_rows_q8)
 *
 * The same rows with llama.cpp's arithmetic (its Q4_0 x Q8_0 dots): the activations are quantized to int8 and
 * the dots are integer sums, so one instruction multiplies and adds 32 code x activation pairs (AVX2's vpmaddubsw)
 * where the fp32 path needs four per 8 (unpack, subtract, convert, FMA). What is quantized, exactly (the Python
 * reference crisp_kernels.cpu_expert_q8.expert_mlp_q8_ref does the same in float64 and fp32 where said):
 *   - x, per token and block of Q8_XBLOCK elements of H: sx = max |x| / 127 (fp32), xq = round(x / sx) (fp32
 *     division, ties to even; 0 where sx = 0);
 *   - gate / up of neuron j: sum over blocks b of s_g sx_b (sum_h xq_h q_h - z_g sum_h xq_h), the inner sums
 *     exact integers; a = silu(gate) up in fp32, 0 where j >= k_t;
 *   - the down coefficients c_jg = a_j s_jg (fp32 product), per token, group g of H and block of Q8_NBLOCK
 *     neurons aligned to multiples of Q8_NBLOCK (absolute j, clipped to [j0, j1)): sc = max_j |c_jg| / 127,
 *     cq = round(c / sc); y_h += sc sum_j cq_jg (q_jh - z_jg), the sum an exact integer.
 * The error against fp32 is the activations' rounding (llama.cpp's: Q8_0 blocks of 32), not the codes'.
 * The result depends on nthreads only through the order of the per-thread sums (their ranges start on
 * Q8_NBLOCK boundaries, so the blocks do not depend on it).
 */
#define Q8_XBLOCK 32  /* x elements per int8 scale: 16 bytes of a row, one 128-bit lane */
/* neurons per down-coefficient scale: 16 products of a 4-bit code (<= 15) and |cq| <= 127 sum to <= 30,480,
 * exact in the int16 lanes vpmaddubsw adds into, so a block needs no widening until its end */
#define Q8_NBLOCK 16
#define Q8_TILE 4     /* tokens of a gate/up pass: 2 accumulators each beside 4 unpacked vectors in 16 ymm */
#if CRISP_SIMD && defined(__AVX2__) && defined(__F16C__)
#define Q8_SIMD 1
#else
#define Q8_SIMD 0
#endif

typedef struct {
    const int8_t *xeq, *xoq;  /* (T, H/2) even / odd elements of xq */
    const float *sx;          /* (T, H/32) block scales */
    const int32_t *xsum;      /* (T, H/32) sum of xq over a block */
    const float *sxr;         /* (T, H/8): each block's scale 4 times (one 256-bit step holds two blocks) */
    const float *xsf;         /* (T, H/8): per 32-byte step 8 floats, its two blocks' xsum in slots 0 and 4, 0 elsewhere */
    const float *sx4, *xs4;   /* (T, H/32) each: sx and xsum, per 128 bytes of a row (4 steps, 8 blocks) ordered as the
                               * lanes of q8_dots_1_g64's block sums: the 4 steps' first blocks, then their second */
    const uint8_t *qweight;   /* (rows, 3, H/2), row 0 = neuron j0 */
    const uint16_t *scales;   /* (rows, 3, G) fp16 */
    const uint8_t *zeros;     /* (rows, 3, G) or NULL: 8 */
    const int64_t *kt;
    int64_t j0;
    int tokens, hidden, group, gshift;  /* gshift: log2(group), a power of 2 (checked): groups by a shift, where
                                         * a division per step cost 4% of a T = 1 gate/up pass */
    int64_t b0, b1;           /* this thread's absolute neurons */
    float *ye, *yo;           /* (T, H/2) accumulators */
    /* scratch for one block of neurons and one token: */
    float *sc;                /* (G,) the coefficients' scales */
    int32_t *zint;            /* (G,) sum_j cq_jg z_jg */
    float *cf;                /* (Q8_NBLOCK, G) the coefficients c_jg of the live rows */
    int8_t *cq;               /* (Q8_NBLOCK, G) their int8 values */
    int16_t *pairs;           /* (G, Q8_NBLOCK / 2) (cq_j, cq_j') byte pairs */
} WorkQ8;

static float q8_scale(int g, const uint16_t *s) { return SCALE(s, g); }

/* sum over bytes [i0, i1) of a row (x blocks whole: i0, i1 multiples of 16) of s_g sx_b sum_h xq_h (q_h - z_g),
 * token t; the inner sum exact (an integer) */
static float q8_dot_scalar(const WorkQ8 *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t, int i0,
                           int i1) {
    const int half = w->hidden / 2, blocks = w->hidden / Q8_XBLOCK;
    const int8_t *xe = w->xeq + (size_t)t * half, *xo = w->xoq + (size_t)t * half;
    const float *sx = w->sx + (size_t)t * blocks;
    const int32_t *xsum = w->xsum + (size_t)t * blocks;
    float acc = 0.0f;
    for (int i = i0; i < i1; i += Q8_XBLOCK / 2) {
        const int g = ((2 * i) >> w->gshift), b = 2 * i / Q8_XBLOCK;
        int32_t isum = 0;
        for (int k = i; k < i + Q8_XBLOCK / 2; k++) isum += (q[k] & 0x0f) * xe[k] + (q[k] >> 4) * xo[k];
        acc += q8_scale(g, s) * sx[b] * (float)(isum - (z ? z[g] : 8) * xsum[b]);
    }
    return acc;
}

#if Q8_SIMD
/* Two to Q8_TILE tokens' (or one token's) gate and up dots of one neuron: each 32-byte step (two x blocks, one
 * per 128-bit lane) is unpacked once for the tile; per token, 4 vpmaddubsw give the step's integer sums. */
INLINE void q8_dots_nt(const WorkQ8 *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0,
                       const int NT, const int R, float *gate, float *up) {
    /* R = 2: an expert row's gate (q, s, z) and up (H / 2 bytes, G scales and zeros on); R = 1: one row (gate) */
    const int half = w->hidden / 2, groups = w->hidden / w->group, full = half / 32 * 32;
    const uint8_t *qu = q + half;
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 ag[Q8_TILE], au[Q8_TILE];
    for (int t = 0; t < NT; t++) ag[t] = au[t] = _mm256_setzero_ps();
    for (int i = 0; i < full; i += 32) {
        const int ga = ((2 * i) >> w->gshift), gb = ((2 * i + 32) >> w->gshift);
        __m256 sg, su;
        __m256 zgf, zuf;  /* the zero points as floats, per 128-bit lane */
        const int ua = R == 2 ? groups + ga : ga, ub = R == 2 ? groups + gb : gb;  /* R = 1: the up lanes unused */
        if (ga == gb) {
            sg = _mm256_set1_ps(_cvtsh_ss(s[ga]));
            su = _mm256_set1_ps(_cvtsh_ss(s[ua]));
            zgf = _mm256_set1_ps(z ? (float)z[ga] : 8.0f);
            zuf = _mm256_set1_ps(z ? (float)z[ua] : 8.0f);
        } else {
            sg = _mm256_setr_m128(_mm_set1_ps(_cvtsh_ss(s[ga])), _mm_set1_ps(_cvtsh_ss(s[gb])));
            su = _mm256_setr_m128(_mm_set1_ps(_cvtsh_ss(s[ua])), _mm_set1_ps(_cvtsh_ss(s[ub])));
            zgf = _mm256_setr_m128(_mm_set1_ps(z ? (float)z[ga] : 8.0f), _mm_set1_ps(z ? (float)z[gb] : 8.0f));
            zuf = _mm256_setr_m128(_mm_set1_ps(z ? (float)z[ua] : 8.0f), _mm_set1_ps(z ? (float)z[ub] : 8.0f));
        }
        if (!(i & 63)) {  /* the rows ROWS_AHEAD on: 3 H / 2 bytes a row in an expert, H / 2 in a dense matrix */
            const size_t ahead = ROWS_AHEAD * (R == 2 ? 3 : 1) * (size_t)half;
            _mm_prefetch((const char *)(q + ahead + i), ROW_PREFETCH);
            if (R == 2) _mm_prefetch((const char *)(qu + ahead + i), ROW_PREFETCH);
            /* and that row's down bytes, which q8_down reads after its block's gate/up pass: one line per
             * other step covers them (H / 2 bytes); left to the hardware prefetcher, an H 2048 x I 5632 expert
             * took 1.95 ms at T = 1 on one core of a 2-core AMD EPYC VM (AVX2), 1.80 with a prefetch of them */
            if (R == 2) _mm_prefetch((const char *)(q + 2 * (size_t)half + ahead + i), ROW_PREFETCH);
        }
        const __m256i bg = _mm256_loadu_si256((const __m256i *)(q + i));
        const __m256i bu = R == 2 ? _mm256_loadu_si256((const __m256i *)(qu + i)) : bg;
        const __m256i gl = _mm256_and_si256(bg, m4), gh = _mm256_and_si256(_mm256_srli_epi16(bg, 4), m4);
        const __m256i ul = _mm256_and_si256(bu, m4), uh = _mm256_and_si256(_mm256_srli_epi16(bu, 4), m4);
        UNROLL_TILE
        for (int t = 0; t < NT; t++) {
            const size_t o = (size_t)(t0 + t) * half + i;
            const __m256i xe = _mm256_loadu_si256((const __m256i *)(w->xeq + o));
            const __m256i xo = _mm256_loadu_si256((const __m256i *)(w->xoq + o));
            const __m256 sx = _mm256_loadu_ps(w->sxr + (size_t)(t0 + t) * (w->hidden / 8) + i / 4);
            /* the step's two blocks' sums of xq, as floats in the first slot of each lane: z sum(xq) is
             * subtracted from the converted integer sum by one fnmadd before the scales multiply, and exactly:
             * both are integers below 2^24 (32 x 15 x 127), so fp32 holds them and their difference without
             * rounding (taken out of the scaled sum instead, it cancelled: 1.7e-4 relative on a one-neuron
             * range). One fnmadd where an integer madd and subtraction were: 3% of a T = 1 gate/up pass */
            const __m256 xs = _mm256_loadu_ps(w->xsf + (size_t)(t0 + t) * (w->hidden / 8) + i / 4);
            const __m256i pg = _mm256_madd_epi16(
                _mm256_add_epi16(_mm256_maddubs_epi16(gl, xe), _mm256_maddubs_epi16(gh, xo)), ones);
            const __m256i pu = _mm256_madd_epi16(
                _mm256_add_epi16(_mm256_maddubs_epi16(ul, xe), _mm256_maddubs_epi16(uh, xo)), ones);
            ag[t] = _mm256_fmadd_ps(_mm256_fnmadd_ps(zgf, xs, _mm256_cvtepi32_ps(pg)), _mm256_mul_ps(sx, sg), ag[t]);
            if (R == 2) au[t] = _mm256_fmadd_ps(_mm256_fnmadd_ps(zuf, xs, _mm256_cvtepi32_ps(pu)), _mm256_mul_ps(sx, su), au[t]);
        }
    }
    for (int t = 0; t < NT; t++) {
        gate[t] = hsum8(ag[t]) + q8_dot_scalar(w, q, s, z, t0 + t, full, half);
        if (R == 2) up[t] = hsum8(au[t]) + q8_dot_scalar(w, qu, s + groups, z ? z + groups : NULL, t0 + t, full, half);
    }
}


/* 32 bytes of a row against x's even and odd codes: 16 int16 sums of 4 products each */
INLINE __m256i q8_step_sums(const uint8_t *q, __m256i xev, __m256i xov, __m256i m4) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)q);
    return _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(b, m4), xev),
                            _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4), xov));
}

/* acc + the 128-byte chunk c's 8 block sums (from its 4 steps' sums v) less z sum(xq), times sx s: the chunk's
 * 4 groups' scales s[4c..] and zero points z[4c..] (NULL: 8), x's sx4 / xs4 slots sxv / xsv */
INLINE __m256 q8_chunk_acc(__m256 acc, const __m256i v[4], const uint16_t *s, const uint8_t *z, int c, __m256 sxv,
                           __m256 xsv) {
    const __m256i sums = _mm256_madd_epi16(
        _mm256_hadd_epi16(_mm256_hadd_epi16(v[0], v[1]), _mm256_hadd_epi16(v[2], v[3])), _mm256_set1_epi16(1));
    const __m128 s4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(s + 4 * c)));
    const __m128 z4 = z ? _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(*(const int32_t *)(z + 4 * c))))
                        : _mm_set1_ps(8.0f);
    return _mm256_fmadd_ps(_mm256_fnmadd_ps(_mm256_set_m128(z4, z4), xsv, _mm256_cvtepi32_ps(sums)),
                           _mm256_mul_ps(sxv, _mm256_set_m128(s4, s4)), acc);
}

/* acc + one 32-byte step's sums v (group g) less z sum(xq), times sx s (x's sxr / xsf slots sx / xs) */
INLINE __m256 q8_step_acc(__m256 acc, __m256i v, const uint16_t *s, const uint8_t *z, int g, __m256 sx, __m256 xs) {
    const __m256i sums = _mm256_madd_epi16(v, _mm256_set1_epi16(1));
    return _mm256_fmadd_ps(_mm256_fnmadd_ps(_mm256_set1_ps(z ? (float)z[g] : 8.0f), xs, _mm256_cvtepi32_ps(sums)),
                           _mm256_mul_ps(sx, _mm256_set1_ps(_cvtsh_ss(s[g]))), acc);
}

/* One token's gate and up dots of one neuron (R = 2; R = 1: one row), group 64: each 32-byte step is one group,
 * and four steps (128 bytes) are reduced to their eight block sums before anything turns to floats. Per step and
 * row, 2 vpmaddubsw and an add leave 16 int16 sums of 4 products each (|.| <= 4 x 15 x 127); two rounds of
 * vphaddw over the 4 steps (|.| <= 16 x 15 x 127 = 30,480: no int16 overflow) and one vpmaddwd give the 8 block
 * sums as int32 (the first blocks of the 4 steps in the low lane, their second blocks in the high one). Then z
 * sum(xq) comes off exactly (integers below 2^24) and the scales multiply once per 4 steps: one conversion, one
 * fnmadd, one multiply and one fma per 128 bytes where q8_dots_nt spends four of each and four vpmaddwd. The
 * multiply-class instructions are what bounds a T = 1 pass: on the 2-core AMD EPYC VM (AVX2) vpmaddubsw, vpmaddwd,
 * the conversions and the FMAs share about two pipes (an interleaved vpmaddubsw + fma stream ran 1.1 a cycle).
 * Measured there, both functions on the same H 2048 rows in alternating rounds: 10-17 cycles a 32-byte step of
 * gate and up where q8_dots_nt at NT = 1 takes 17-26, 1.57-1.70x as fast with the rows in L1, L2 or L3 (and H 4096);
 * a whole H 2048 x I 5632 expert from DRAM is 0-12% faster (one core; two: 7-12%), since there the stream of its
 * bytes bounds it too. */
INLINE void q8_dots_1_g64(const WorkQ8 *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t,
                          const int R, float *gate, float *up) {
    const int half = w->hidden / 2, groups = w->hidden / 64, chunks = half / 128, full = half / 32 * 32;
    const size_t ahead = ROWS_AHEAD * (R == 2 ? 3 : 1) * (size_t)half;  /* as in q8_dots_nt */
    const uint8_t *qu = q + half;
    const uint16_t *su = s + groups;
    const uint8_t *zu = z ? z + groups : NULL;
    const int8_t *xe = w->xeq + (size_t)t * half, *xo = w->xoq + (size_t)t * half;
    const float *sx4 = w->sx4 + (size_t)t * (w->hidden / 32), *xs4 = w->xs4 + (size_t)t * (w->hidden / 32);
    const float *sxr = w->sxr + (size_t)t * (w->hidden / 8), *xsf = w->xsf + (size_t)t * (w->hidden / 8);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 ag = _mm256_setzero_ps(), au = _mm256_setzero_ps();
    for (int c = 0; c < chunks; c++) {
        const int i0 = 128 * c;
        for (int p = 0; p < 128; p += 64) {
            _mm_prefetch((const char *)(q + ahead + i0 + p), ROW_PREFETCH);
            if (R == 2) {
                _mm_prefetch((const char *)(qu + ahead + i0 + p), ROW_PREFETCH);
                _mm_prefetch((const char *)(q + 2 * (size_t)half + ahead + i0 + p), ROW_PREFETCH);
            }
        }
        __m256i vg[4], vu[4];
        for (int k = 0; k < 4; k++) {
            const int i = i0 + 32 * k;
            const __m256i xev = _mm256_loadu_si256((const __m256i *)(xe + i));
            const __m256i xov = _mm256_loadu_si256((const __m256i *)(xo + i));
            vg[k] = q8_step_sums(q + i, xev, xov, m4);
            if (R == 2) vu[k] = q8_step_sums(qu + i, xev, xov, m4);
        }
        const __m256 sxv = _mm256_loadu_ps(sx4 + 8 * c), xsv = _mm256_loadu_ps(xs4 + 8 * c);
        ag = q8_chunk_acc(ag, vg, s, z, c, sxv, xsv);
        if (R == 2) au = q8_chunk_acc(au, vu, su, zu, c, sxv, xsv);
    }
    for (int i = 128 * chunks; i < full; i += 32) {  /* the last 1-3 steps of a row whose H / 2 is not a multiple of 128 */
        const __m256i xev = _mm256_loadu_si256((const __m256i *)(xe + i));
        const __m256i xov = _mm256_loadu_si256((const __m256i *)(xo + i));
        const __m256 sx = _mm256_loadu_ps(sxr + i / 4), xs = _mm256_loadu_ps(xsf + i / 4);
        ag = q8_step_acc(ag, q8_step_sums(q + i, xev, xov, m4), s, z, i >> 5, sx, xs);
        if (R == 2) au = q8_step_acc(au, q8_step_sums(qu + i, xev, xov, m4), su, zu, i >> 5, sx, xs);
    }
    gate[0] = hsum8(ag) + q8_dot_scalar(w, q, s, z, t, full, half);
    if (R == 2) up[0] = hsum8(au) + q8_dot_scalar(w, qu, su, zu, t, full, half);
}

static void q8_gate_up(const WorkQ8 *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0, int nt,
                       float *gate, float *up) {
    if (w->group == 64) {
        /* token by token, each through the one-token pass: its fewer multiply-class instructions outweigh
         * unpacking the row's codes again per token (from L1); an H 2048 x I 5632 expert from DRAM on one core of
         * the 2-core AMD EPYC VM took 6-10% less at 2, 4 and 16 tokens than through the tiles of q8_dots_nt */
        for (int t = 0; t < nt; t++) q8_dots_1_g64(w, q, s, z, t0 + t, 2, gate + t, up + t);
        return;
    }
    switch (nt) {  /* a constant NT per case keeps the tile in registers */
        case 1: q8_dots_nt(w, q, s, z, t0, 1, 2, gate, up); break;
        case 2: q8_dots_nt(w, q, s, z, t0, 2, 2, gate, up); break;
        case 3: q8_dots_nt(w, q, s, z, t0, 3, 2, gate, up); break;
        default: q8_dots_nt(w, q, s, z, t0, Q8_TILE, 2, gate, up); break;
    }
}

/* One dense row's dots with nt <= Q8_TILE tokens (crisp_dense_q8). */
static void q8_row(const WorkQ8 *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0, int nt, float *dot) {
    if (w->group == 64) {  /* as in q8_gate_up */
        for (int t = 0; t < nt; t++) q8_dots_1_g64(w, q, s, z, t0 + t, 1, dot + t, NULL);
        return;
    }
    switch (nt) {
        case 1: q8_dots_nt(w, q, s, z, t0, 1, 1, dot, NULL); break;
        case 2: q8_dots_nt(w, q, s, z, t0, 2, 1, dot, NULL); break;
        case 3: q8_dots_nt(w, q, s, z, t0, 3, 1, dot, NULL); break;
        default: q8_dots_nt(w, q, s, z, t0, Q8_TILE, 1, dot, NULL); break;
    }
}
#else
static void q8_gate_up(const WorkQ8 *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0, int nt,
                       float *gate, float *up) {
    const int half = w->hidden / 2, groups = w->hidden / w->group;
    for (int t = 0; t < nt; t++) {
        gate[t] = q8_dot_scalar(w, q, s, z, t0 + t, 0, half);
        up[t] = q8_dot_scalar(w, q + half, s + groups, z ? z + groups : NULL, t0 + t, 0, half);
    }
}

static void q8_row(const WorkQ8 *w, const uint8_t *q, const uint16_t *s, const uint8_t *z, int t0, int nt, float *dot) {
    for (int t = 0; t < nt; t++) dot[t] = q8_dot_scalar(w, q, s, z, t0 + t, 0, w->hidden / 2);
}
#endif

/* One token's down columns of the live rows of a block: quantize c_jg = a_j s_jg per group, then
 * y_h += sc_g (sum_j cq_jg q_jh - zint_g) over the row bytes, two rows at a time (their codes interleaved into
 * the byte pairs vpmaddubsw multiplies with the pair (cq_j, cq_j') and adds). */
static void q8_down(const WorkQ8 *w, const uint8_t *q0, const uint16_t *s0, const uint8_t *z0, const int *live,
                    int nlive, int t, const float *a) {
    const int half = w->hidden / 2, groups = w->hidden / w->group;
    const size_t row_q = (size_t)3 * half, row_s = (size_t)3 * groups;
    float *ye = w->ye + (size_t)t * half, *yo = w->yo + (size_t)t * half;
    float *c = w->cf;  /* (nlive, G) fp32 coefficients, then the rows' codes' zero points times cq */
    float *amax = w->sc;
    int g0 = 0;
#if Q8_SIMD
    /* eight groups at a time: the scalar loop (a division and a rounding per coefficient) took 40% of a row */
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (; g0 + 8 <= groups; g0 += 8) {
        __m256 m = _mm256_setzero_ps();
        for (int k = 0; k < nlive; k++) {
            const uint16_t *s = s0 + live[k] * row_s + 2 * groups + g0;
            const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s)),
                                           _mm256_set1_ps(a[live[k]]));
            _mm256_storeu_ps(c + k * groups + g0, v);
            m = _mm256_max_ps(m, _mm256_and_ps(v, absmask));
        }
        const __m256 sc = _mm256_div_ps(m, _mm256_set1_ps(127.0f));
        const __m256 pos = _mm256_cmp_ps(sc, _mm256_setzero_ps(), _CMP_GT_OQ);
        const __m256 safe = _mm256_blendv_ps(_mm256_set1_ps(1.0f), sc, pos);
        __m256 zi = _mm256_setzero_ps();  /* sum_j cq z: |.| <= 16 x 127 x 15, exact in fp32 */
        /* c / sc as c times 1 / sc: one division per 8 groups where there were nlive + 1; the quotient moves by
         * ~1 fp32 ulp (x 127 < 1.6e-5), inside the reference's boundary slack (BOUNDARY_SLACK, 1e-3) */
        const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), safe);
        for (int k = 0; k < nlive; k++) {
            const __m256 r = _mm256_and_ps(pos, _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(c + k * groups + g0), inv),
                                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            const uint8_t *zr = z0 ? z0 + live[k] * row_s + 2 * groups + g0 : NULL;
            const __m256 zv = zr ? _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)zr)))
                                 : _mm256_set1_ps(8.0f);
            zi = _mm256_fmadd_ps(r, zv, zi);
            const __m256i r32 = _mm256_cvtps_epi32(r);
            const __m128i r16 = _mm_packs_epi32(_mm256_castsi256_si128(r32), _mm256_extracti128_si256(r32, 1));
            _mm_storel_epi64((__m128i *)(w->cq + k * groups + g0), _mm_packs_epi16(r16, r16));
        }
        _mm256_storeu_ps(w->sc + g0, sc);
        _mm256_storeu_si256((__m256i *)(w->zint + g0), _mm256_cvtps_epi32(zi));
    }
#endif
    for (int g = g0; g < groups; g++) {
        float m = 0.0f;
        for (int k = 0; k < nlive; k++) {
            c[k * groups + g] = a[live[k]] * q8_scale(2 * groups + g, s0 + live[k] * row_s);
            const float v = fabsf(c[k * groups + g]);
            m = v > m ? v : m;
        }
        const float sc = m / 127.0f;
        int32_t zi = 0;
        for (int k = 0; k < nlive; k++) {
            const int8_t v = sc > 0.0f ? (int8_t)nearbyintf(c[k * groups + g] / sc) : 0;
            w->cq[k * groups + g] = v;
            zi += v * (z0 ? z0[live[k] * row_s + 2 * groups + g] : 8);
        }
        amax[g] = sc;
        w->zint[g] = zi;
    }
    /* the byte pairs' coefficients (cq_j, cq_j') of each group, rows paired in order, pair-major ((npairs, G): 16
     * groups a vector); an odd last row pairs with itself at coefficient 0 */
    const int npairs = (nlive + 1) / 2;
    for (int p = 0; p < npairs; p++) {
        const int k = 2 * p;
        const int8_t *lo = w->cq + k * groups, *hi = k + 1 < nlive ? w->cq + (k + 1) * groups : NULL;
        int16_t *dst = w->pairs + p * groups;
        int g = 0;
#if Q8_SIMD
        for (; g + 16 <= groups; g += 16) {
            const __m128i l = _mm_loadu_si128((const __m128i *)(lo + g));
            const __m128i h = hi ? _mm_loadu_si128((const __m128i *)(hi + g)) : _mm_setzero_si128();
            _mm_storeu_si128((__m128i *)(dst + g), _mm_unpacklo_epi8(l, h));
            _mm_storeu_si128((__m128i *)(dst + g + 8), _mm_unpackhi_epi8(l, h));
        }
#endif
        for (; g < groups; g++) dst[g] = (int16_t)((uint8_t)lo[g] | (uint16_t)(hi ? (uint8_t)hi[g] : 0) << 8);
    }
    int i = 0;
#if Q8_SIMD
    const int full = half / 32 * 32;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (; i < full; i += 32) {
        const int ga = ((2 * i) >> w->gshift), gb = ((2 * i + 32) >> w->gshift);
        __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                          _mm256_setzero_si256()};
        const int16_t *pa = w->pairs + ga, *pb = w->pairs + gb;
        for (int k = 0; k < nlive; k += 2) {
            const int k2 = k + 1 < nlive ? k + 1 : k;
            const __m256i cv = ga == gb ? _mm256_set1_epi16(pa[k / 2 * groups])
                                        : _mm256_setr_m128i(_mm_set1_epi16(pa[k / 2 * groups]), _mm_set1_epi16(pb[k / 2 * groups]));
            const __m256i qa = _mm256_loadu_si256((const __m256i *)(q0 + live[k] * row_q + 2 * half + i));
            const __m256i qb = _mm256_loadu_si256((const __m256i *)(q0 + live[k2] * row_q + 2 * half + i));
            /* the two rows' bytes interleaved first, then each nibble masked out of the (a, b) byte pairs: a 16-bit
             * shift by 4 leaves a's high nibble in the low byte, b's in the high one (8 ops where unpacking each row
             * and interleaving took 10) */
            const __m256i u0 = _mm256_unpacklo_epi8(qa, qb), u1 = _mm256_unpackhi_epi8(qa, qb);
            acc[0] = _mm256_add_epi16(acc[0], _mm256_maddubs_epi16(_mm256_and_si256(u0, m4), cv));
            acc[1] = _mm256_add_epi16(acc[1], _mm256_maddubs_epi16(_mm256_and_si256(u1, m4), cv));
            acc[2] = _mm256_add_epi16(acc[2], _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(u0, 4), m4), cv));
            acc[3] = _mm256_add_epi16(acc[3], _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(u1, 4), m4), cv));
        }
        /* acc[0]: even elements of bytes i..i+7 (lane 0) and i+16..i+23 (lane 1); acc[1]: i+8.., i+24..;
         * acc[2], acc[3]: the odd elements likewise */
        for (int e = 0; e < 4; e++) {
            float *y = e < 2 ? ye : yo;
            const int off = (e & 1) * 8;
            const __m256i lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[e]));
            const __m256i hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[e], 1));
            const __m256 fa = _mm256_cvtepi32_ps(_mm256_sub_epi32(lo, _mm256_set1_epi32(w->zint[ga])));
            const __m256 fb = _mm256_cvtepi32_ps(_mm256_sub_epi32(hi, _mm256_set1_epi32(w->zint[gb])));
            float *pa = y + i + off, *pb = y + i + 16 + off;
            _mm256_storeu_ps(pa, _mm256_fmadd_ps(fa, _mm256_set1_ps(w->sc[ga]), _mm256_loadu_ps(pa)));
            _mm256_storeu_ps(pb, _mm256_fmadd_ps(fb, _mm256_set1_ps(w->sc[gb]), _mm256_loadu_ps(pb)));
        }
    }
#endif
    for (; i < half; i++) {  /* portable C, and the last 16 bytes of a row whose H / 2 is not a multiple of 32 */
        const int g = ((2 * i) >> w->gshift);
        int32_t e = 0, o = 0;
        for (int k = 0; k < nlive; k++) {
            const uint8_t b = q0[live[k] * row_q + 2 * half + i];
            e += w->cq[k * groups + g] * (b & 0x0f);
            o += w->cq[k * groups + g] * (b >> 4);
        }
        ye[i] += w->sc[g] * (float)(e - w->zint[g]);
        yo[i] += w->sc[g] * (float)(o - w->zint[g]);
    }
}

static void run_rows_q8(const WorkQ8 *w) {
    const int half = w->hidden / 2, groups = w->hidden / w->group;
    const size_t row_q = (size_t)3 * half, row_s = (size_t)3 * groups;
    float act[Q8_TILE * Q8_NBLOCK];
    for (int64_t b0 = w->b0; b0 < w->b1;) {
        int64_t b1 = (b0 / Q8_NBLOCK + 1) * Q8_NBLOCK;
        if (b1 > w->b1) b1 = w->b1;
        const int n = (int)(b1 - b0);
        const uint8_t *q0 = w->qweight + (b0 - w->j0) * row_q;
        const uint16_t *s0 = w->scales + (b0 - w->j0) * row_s;
        const uint8_t *z0 = w->zeros ? w->zeros + (b0 - w->j0) * row_s : NULL;
        for (int t0 = 0; t0 < w->tokens; t0 += Q8_TILE) {
            const int nt = w->tokens - t0 < Q8_TILE ? w->tokens - t0 : Q8_TILE;
            for (int j = 0; j < n; j++) {
                int used = 0;
                for (int t = 0; t < nt; t++) used |= !w->kt || b0 + j < w->kt[t0 + t];
                for (int t = 0; t < Q8_TILE; t++) act[t * Q8_NBLOCK + j] = 0.0f;
                if (!used) continue;  /* no token of this tile reads row j */
                const uint8_t *q = q0 + j * row_q;
                const uint16_t *s = s0 + j * row_s;
                const uint8_t *z = z0 ? z0 + j * row_s : NULL;
                float gate[Q8_TILE], up[Q8_TILE];
                q8_gate_up(w, q, s, z, t0, nt, gate, up);
                for (int t = 0; t < nt; t++) {
                    if (w->kt && b0 + j >= w->kt[t0 + t]) continue;
                    act[t * Q8_NBLOCK + j] = gate[t] / (1.0f + expf(-gate[t])) * up[t];
                }
            }
            for (int t = 0; t < nt; t++) {
                const float *a = act + t * Q8_NBLOCK;
                int live[Q8_NBLOCK], nlive = 0;
                for (int j = 0; j < n; j++)
                    if (a[j] != 0.0f) live[nlive++] = j;
                if (nlive) q8_down(w, q0, s0, z0, live, nlive, t0 + t, a);
            }
        }
        b0 = b1;
    }
}

/* x (T, H) quantized into the buffers (xq: 2 T H / 2 int8; xf: T (3 H / 32 + H / 8) floats; xsf: T H / 8 floats,
 * zeroed; xsum: T H / 32) and their views in w (see WorkQ8). */
static void q8_quantize_x(const float *x, int64_t tokens, int64_t hidden, int8_t *xq, float *xf, float *xsf,
                          int32_t *xsum, WorkQ8 *w) {
    const int64_t half = hidden / 2, blocks = hidden / Q8_XBLOCK;
    int8_t *xeq = xq, *xoq = xq + tokens * half;
    float *sx = xf, *sxr = xf + tokens * blocks, *sx4 = sxr + tokens * (hidden / 8), *xs4 = sx4 + tokens * blocks;
    for (int64_t t = 0; t < tokens; t++) {
        const float *xt = x + t * hidden;
        for (int64_t b = 0; b < blocks; b++) {
            float amax = 0.0f;
            int finite = 1;
            for (int k = 0; k < Q8_XBLOCK; k++) {
                const float m = fabsf(xt[b * Q8_XBLOCK + k]);
                finite &= isfinite(m) != 0;
                amax = m > amax ? m : amax;
            }
            /* a block holding inf or nan gets scale nan and codes 0, so its products are nan, never finite values
             * of a cast that C leaves undefined */
            const float s = finite ? amax / 127.0f : NAN;
            int32_t sum = 0;
            for (int k = 0; k < Q8_XBLOCK; k++) {
                const int64_t h = b * Q8_XBLOCK + k;
                const int8_t v = s > 0.0f ? (int8_t)nearbyintf(xt[h] / s) : 0;
                (h & 1 ? xoq : xeq)[t * half + h / 2] = v;
                sum += v;
            }
            sx[t * blocks + b] = s;
            xsum[t * blocks + b] = sum;
            for (int k = 0; k < 4; k++) sxr[t * (hidden / 8) + 4 * b + k] = s;
            xsf[t * (hidden / 8) + 4 * b] = (float)sum;  /* |sum| <= 32 x 127: exact */
            /* block b = 2 (4 c + k) + lane of 128-byte chunk c: slot 8 c + 4 lane + k; blocks after the last whole
             * chunk are read from sxr / xsf */
            if (b < blocks / 8 * 8) {
                const int64_t slot = 8 * (b / 8) + 4 * (b & 1) + (b % 8) / 2;
                sx4[t * blocks + slot] = s;
                xs4[t * blocks + slot] = (float)sum;
            }
        }
    }
    w->xeq = xeq; w->xoq = xoq; w->sx = sx; w->xsum = xsum; w->sxr = sxr; w->xsf = xsf; w->sx4 = sx4; w->xs4 = xs4;
}

/* crisp_expert_rows_f32's contract with 8-bit activations (see the section's header). */
int crisp_expert_rows_q8(const float *x, int64_t tokens, int64_t hidden, int64_t group,
                         const uint8_t *qweight, const uint16_t *scales, const uint8_t *zeros,
                         const int64_t *kt, int64_t j0, int64_t j1, const float *weights, float *out,
                         int64_t nthreads) {
    if (tokens <= 0 || j1 <= j0) return 0;
    if (tokens > MAX_TOKENS || hidden % group || group % 32 || (group & (group - 1)) || nthreads < 1) return -2;
    const int64_t half = hidden / 2, groups = hidden / group, blocks = hidden / Q8_XBLOCK;
    const int64_t nblocks = (j1 - 1) / Q8_NBLOCK - j0 / Q8_NBLOCK + 1;  /* neuron blocks met by [j0, j1) */
    if (nthreads > nblocks) nthreads = nblocks;
    const size_t per_thread = (size_t)tokens * (size_t)hidden;
    int8_t *xq = malloc(2 * (size_t)tokens * (size_t)half);
    float *xf = malloc(sizeof(float) * (size_t)tokens * (size_t)(3 * blocks + hidden / 8));
    float *xsf = calloc((size_t)tokens * (size_t)(hidden / 8), sizeof(float));
    int32_t *xsum = malloc(sizeof(int32_t) * (size_t)tokens * (size_t)blocks);
    float *acc = calloc((size_t)nthreads * per_thread, sizeof(float));
    WorkQ8 *work = malloc(sizeof(WorkQ8) * (size_t)nthreads);
    /* per thread: sc, zint (G each), cf (Q8_NBLOCK x G floats), cq (Q8_NBLOCK x G), pairs (G x Q8_NBLOCK / 2 int16) */
    const size_t scratch_per = (size_t)groups * (8 + 4 * Q8_NBLOCK + Q8_NBLOCK + Q8_NBLOCK);
    char *scratch = malloc((size_t)nthreads * scratch_per);
    int rc = 0;
    if (!xq || !xf || !xsf || !xsum || !acc || !work || !scratch) { rc = -1; goto done; }
    q8_quantize_x(x, tokens, hidden, xq, xf, xsf, xsum, &work[0]);
    for (int64_t p = 0; p < nthreads; p++) {
        WorkQ8 *w = &work[p];
        *w = work[0];  /* x's quantization, shared */
        w->qweight = qweight; w->scales = scales; w->zeros = zeros; w->kt = kt; w->j0 = j0;
        w->tokens = (int)tokens; w->hidden = (int)hidden; w->group = (int)group; w->gshift = __builtin_ctzll(group);
        /* whole neuron blocks per thread: the first block starts at j0, the others on multiples of Q8_NBLOCK */
        const int64_t first = j0 / Q8_NBLOCK;
        const int64_t lo = first + nblocks * p / nthreads, hi = first + nblocks * (p + 1) / nthreads;
        w->b0 = p == 0 ? j0 : lo * Q8_NBLOCK;
        w->b1 = p == nthreads - 1 ? j1 : hi * Q8_NBLOCK;
        w->ye = acc + (size_t)p * per_thread; w->yo = w->ye + tokens * half;
        char *mine = scratch + (size_t)p * scratch_per;
        w->sc = (float *)mine;
        w->zint = (int32_t *)(mine + 4 * groups);
        w->cf = (float *)(mine + 8 * groups);
        w->pairs = (int16_t *)(mine + (8 + 4 * Q8_NBLOCK) * groups);
        w->cq = (int8_t *)(mine + (8 + 5 * Q8_NBLOCK) * groups);
    }
    const int team_size = (int)(nthreads < omp_get_num_procs() ? nthreads : omp_get_num_procs());
#pragma omp parallel num_threads(team_size)
    {
        const int team = omp_get_num_threads();
        for (int64_t p = omp_get_thread_num(); p < nthreads; p += team) run_rows_q8(&work[p]);
    }
    add_thread_sums(acc, nthreads, tokens, hidden, weights, out);
    /* a token whose x holds inf or nan: its rows' activations are nan, which the down pass's coefficient
     * quantization would turn into finite codes; the fp32 path's result is non-finite, so this one is nan */
    for (int64_t t = 0; t < tokens; t++) {
        int finite = 1;
        for (int64_t b = 0; b < blocks; b++) finite &= !isnan(work[0].sx[t * blocks + b]);
        if (!finite)
            for (int64_t h = 0; h < hidden; h++) out[t * hidden + h] = NAN;
    }
done:
    free(xq); free(xf); free(xsf); free(xsum); free(acc); free(work); free(scratch);
    return rc;
}

/* out (T, rows) = x (T, H) times the rows' 4-bit codes (rows, H / 2) with their fp16 scales and uint8 zero points
 * (rows, G), NULL zeros: 8: a dense layer's y = x W^T in the format's rows, with the expert kernel's 8-bit
 * activations and integer dots (q8_dots_nt, one row). Rows go to threads in contiguous ranges; each output is one
 * row's dot, so the result does not depend on nthreads. Returns 0, -1 out of memory, -2 bad sizes. */
int crisp_dense_q8(const float *x, int64_t tokens, int64_t hidden, int64_t group, const uint8_t *qweight,
                   const uint16_t *scales, const uint8_t *zeros, int64_t rows, float *out, int64_t nthreads) {
    if (tokens <= 0 || rows <= 0) return 0;
    if (tokens > MAX_TOKENS || hidden % group || group % 32 || (group & (group - 1)) || nthreads < 1) return -2;
    const int64_t half = hidden / 2, groups = hidden / group, blocks = hidden / Q8_XBLOCK;
    if (nthreads > rows) nthreads = rows;
    int8_t *xq = malloc(2 * (size_t)tokens * (size_t)half);
    float *xf = malloc(sizeof(float) * (size_t)tokens * (size_t)(3 * blocks + hidden / 8));
    float *xsf = calloc((size_t)tokens * (size_t)(hidden / 8), sizeof(float));
    int32_t *xsum = malloc(sizeof(int32_t) * (size_t)tokens * (size_t)blocks);
    int rc = 0;
    if (!xq || !xf || !xsf || !xsum) { rc = -1; goto done; }
    WorkQ8 w;
    memset(&w, 0, sizeof w);
    q8_quantize_x(x, tokens, hidden, xq, xf, xsf, xsum, &w);
    w.tokens = (int)tokens; w.hidden = (int)hidden; w.group = (int)group; w.gshift = __builtin_ctzll(group);
    const int team_size = (int)(nthreads < omp_get_num_procs() ? nthreads : omp_get_num_procs());
#pragma omp parallel num_threads(team_size)
    {
        const int team = omp_get_num_threads();
        for (int64_t p = omp_get_thread_num(); p < nthreads; p += team) {
            for (int64_t o = rows * p / nthreads; o < rows * (p + 1) / nthreads; o++) {
                const uint8_t *q = qweight + o * half;
                const uint16_t *s = scales + o * groups;
                const uint8_t *z = zeros ? zeros + o * groups : NULL;
                /* two rows at a time where the range has them: row o + 1 sits H / 2 bytes and G scales on, as an
                 * expert's up row does after its gate row, so the expert's pass serves them and each x vector is
                 * loaded once for both (one row at a time: 0.37 ms for a 2048 x 2048 matrix on one core, 2 MB) */
                const int pair = o + 1 < rows * (p + 1) / nthreads;
                for (int t0 = 0; t0 < (int)tokens; t0 += Q8_TILE) {
                    const int nt = (int)tokens - t0 < Q8_TILE ? (int)tokens - t0 : Q8_TILE;
                    float dot[Q8_TILE], next[Q8_TILE];
                    if (pair)
                        q8_gate_up(&w, q, s, z, t0, nt, dot, next);
                    else
                        q8_row(&w, q, s, z, t0, nt, dot);
                    for (int t = 0; t < nt; t++) {
                        out[(t0 + t) * rows + o] = dot[t];
                        if (pair) out[(t0 + t) * rows + o + 1] = next[t];
                    }
                }
                o += pair;
            }
        }
    }
done:
    free(xq); free(xf); free(xsf); free(xsum);
    return rc;
}

/* ------------------------------------------------------------------------------------------------------------
 * Dense layers with bf16 weights and fp32 activations (crisp_dense_bf16): out (T, rows) = x (T, H) W^T for W (rows, H)
 * in bf16, its values widened exactly (a bf16 is the top half of an fp32) and multiplied by x in fp32. For
 * attention's weights of a bf16 checkpoint loaded in fp32, the same values in half the bytes: a decode step of a
 * model whose attention reads 201 MB a token in fp32 (docs/cpu-kernel.md) reads 101. Four rows per pass share
 * each x vector and keep four independent accumulator chains; the token loop runs inside a pass, so a prefill
 * re-reads the pass's four rows (4 H x 2 bytes) from L1 / L2, not from memory. Rows go to threads in contiguous
 * ranges and each output is one row's dot, so the result does not depend on nthreads.
 */
#if CRISP_SIMD && defined(__AVX2__)
INLINE __m256 bf16x8(const uint16_t *p) {  /* 8 bf16 as 8 fp32: zero-extend to 32 bits, shift into the top half */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

static float bf16_to_float(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* out[t * rows + o] for n (1 or 4) rows from o on, every token: sum_h x_th w_oh, the vector part over the first
 * H / 8 * 8 elements, the rest in scalar code */
static void bf16_rows(const float *x, int64_t tokens, int64_t hidden, const uint16_t *w, int64_t rows, int64_t o,
                      int n, float *out) {
    int64_t full = 0;
    for (int64_t t = 0; t < tokens; t++) {
        const float *xt = x + t * hidden;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if CRISP_SIMD && defined(__AVX2__)
        full = hidden / 8 * 8;
        if (n == 4) {
            const uint16_t *a = w + o * hidden, *b = a + hidden, *c = b + hidden, *d = c + hidden;
            __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
            for (int64_t h = 0; h < full; h += 8) {
                /* the next pass's four rows, a line each per 32 elements (as crisp_dense_int8): left to the hardware
                 * prefetcher, a 2048 x 2048 matrix took 706-813 us on one core of the 2-core AMD EPYC VM (AVX2),
                 * 528-537 with this into L1; on the Zen 4 VM 529-567 us into L1, 336-337 into L2 (ROW_PREFETCH) */
                if (!(h & 31) && o + 8 <= rows) {
                    _mm_prefetch((const char *)(a + 4 * hidden + h), ROW_PREFETCH);
                    _mm_prefetch((const char *)(b + 4 * hidden + h), ROW_PREFETCH);
                    _mm_prefetch((const char *)(c + 4 * hidden + h), ROW_PREFETCH);
                    _mm_prefetch((const char *)(d + 4 * hidden + h), ROW_PREFETCH);
                }
                const __m256 xv = _mm256_loadu_ps(xt + h);
                s0 = _mm256_fmadd_ps(bf16x8(a + h), xv, s0);
                s1 = _mm256_fmadd_ps(bf16x8(b + h), xv, s1);
                s2 = _mm256_fmadd_ps(bf16x8(c + h), xv, s2);
                s3 = _mm256_fmadd_ps(bf16x8(d + h), xv, s3);
            }
            acc[0] = hsum8(s0); acc[1] = hsum8(s1); acc[2] = hsum8(s2); acc[3] = hsum8(s3);
        } else {
            const uint16_t *a = w + o * hidden;
            __m256 s0 = _mm256_setzero_ps();
            for (int64_t h = 0; h < full; h += 8) s0 = _mm256_fmadd_ps(bf16x8(a + h), _mm256_loadu_ps(xt + h), s0);
            acc[0] = hsum8(s0);
        }
#endif
        for (int r = 0; r < n; r++) {
            const uint16_t *row = w + (o + r) * hidden;
            for (int64_t h = full; h < hidden; h++) acc[r] += bf16_to_float(row[h]) * xt[h];
            out[t * rows + o + r] = acc[r];
        }
    }
}

/* Returns 0, -2 bad sizes. */
int crisp_dense_bf16(const float *x, int64_t tokens, int64_t hidden, const uint16_t *w, int64_t rows, float *out,
                     int64_t nthreads) {
    if (tokens <= 0 || rows <= 0) return 0;
    if (hidden <= 0 || nthreads < 1) return -2;
    if (nthreads > rows) nthreads = rows;
    const int team_size = (int)(nthreads < omp_get_num_procs() ? nthreads : omp_get_num_procs());
#pragma omp parallel num_threads(team_size)
    {
        const int team = omp_get_num_threads();
        for (int64_t p = omp_get_thread_num(); p < nthreads; p += team) {
            const int64_t r1 = rows * (p + 1) / nthreads;
            int64_t o = rows * p / nthreads;
            for (; o + 4 <= r1; o += 4) bf16_rows(x, tokens, hidden, w, rows, o, 4, out);
            for (; o < r1; o++) bf16_rows(x, tokens, hidden, w, rows, o, 1, out);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------------------
 * Dense layers with 8-bit weights (crisp_dense_int8): W (rows, H) as int8 codes with one fp16 scale per block of
 * I8_BLOCK = 32 elements of H (llama.cpp's Q8_0 layout: 8.5 bits a weight, 34 bytes a block), x quantized per
 * block of 32 as the q8 expert path does (scale amax / 127, codes rounded to nearest even, |q| <= 127) and kept as
 * int16, so vpmaddwd multiplies sign-extended weight codes with them directly:
 *     out[t, o] = sum_b (sw_ob sx_tb) sum_{h in b} qw_oh qx_th,
 * each block's inner sum an exact integer (|.| <= 32 x 127 x 127 < 2^19, exact in fp32 too). Four rows per pass
 * share each x vector and keep four accumulator chains; per 8 blocks each row's 8 fp16 scales are widened and
 * multiplied by the token's 8 block scales once, then broadcast per block. Rows go to threads in contiguous
 * ranges and each output is one row's dot, so the result does not depend on nthreads.
 */
#define I8_BLOCK 32

/* x (T, H) as int16 codes (T, H) and block scales (T, H / 32) */
static void int8_quantize_x(const float *x, int64_t tokens, int64_t hidden, int16_t *xq, float *sx) {
    const int64_t blocks = hidden / I8_BLOCK;
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t b = 0; b < blocks; b++) {
            const float *xb = x + t * hidden + b * I8_BLOCK;
            float amax = 0.0f;
            int finite = 1;
            for (int k = 0; k < I8_BLOCK; k++) {
                const float m = fabsf(xb[k]);
                finite &= isfinite(m) != 0;
                amax = m > amax ? m : amax;
            }
            const float s = finite ? amax / 127.0f : NAN;  /* as q8_quantize_x: nan out, never a silent number */
            for (int k = 0; k < I8_BLOCK; k++) xq[t * hidden + b * I8_BLOCK + k] = s > 0.0f ? (int16_t)nearbyintf(xb[k] / s) : 0;
            sx[t * blocks + b] = s;
        }
    }
}

static int32_t int8_block_dot(const int8_t *w, const int16_t *x) {
    int32_t acc = 0;
    for (int k = 0; k < I8_BLOCK; k++) acc += (int32_t)w[k] * x[k];
    return acc;
}

/* out[t * rows + o + r] for NR (1 or 4) rows from o on, every token; each row's sums in the same order whatever NR
 * (so whichever pass a row falls in, by the threads' ranges, its result is the same bits) */
static inline __attribute__((always_inline)) void int8_rows(const int16_t *xq, const float *sx, int64_t tokens, int64_t hidden, const int8_t *w,
                      const uint16_t *ws, int64_t rows, int64_t o, const int NR, float *out) {
    const int64_t blocks = hidden / I8_BLOCK;
    const int8_t *r0 = w + o * hidden;
    const uint16_t *s0 = ws + o * blocks;
    for (int64_t t = 0; t < tokens; t++) {
        const int16_t *xt = xq + t * hidden;
        const float *st = sx + t * blocks;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        int64_t b = 0;
#if CRISP_SIMD && defined(__AVX2__) && defined(__F16C__)
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        float comb[4][8];  /* sw_rb sx_tb of the 8 blocks in hand */
        for (; b + 8 <= blocks; b += 8) {
            const __m256 sxv = _mm256_loadu_ps(st + b);
            for (int r = 0; r < NR; r++)
                _mm256_storeu_ps(comb[r], _mm256_mul_ps(sxv, _mm256_cvtph_ps(
                    _mm_loadu_si128((const __m128i *)(s0 + r * blocks + b)))));
            for (int k = 0; k < 8; k++) {
                const int64_t h = (b + k) * I8_BLOCK;
                const __m256i xa = _mm256_loadu_si256((const __m256i *)(xt + h));
                const __m256i xb = _mm256_loadu_si256((const __m256i *)(xt + h + 16));
                /* the next pass's rows, a line each per two blocks: left to the hardware prefetcher, a 2048 x 2048
                 * matrix took 485 us on one core of the 2-core AMD EPYC VM (AVX2; 9.2 GB/s), 343 with this into L1
                 * (13.0; bf16: 588); on the Zen 4 VM 377 us into L1, 220-222 into L2 (ROW_PREFETCH; 19 GB/s) */
                if (!(k & 1) && o + 2 * NR <= rows)
                    for (int r = 0; r < NR; r++) _mm_prefetch((const char *)(r0 + (NR + r) * hidden + h), ROW_PREFETCH);
                for (int r = 0; r < NR; r++) {
                    const int8_t *row = r0 + r * hidden + h;
                    const __m256i wa = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)row));
                    const __m256i wb = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + 16)));
                    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(wa, xa), _mm256_madd_epi16(wb, xb));
                    a[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&comb[r][k]), a[r]);
                }
            }
        }
        for (int r = 0; r < NR; r++) acc[r] = hsum8(a[r]);
#endif
        for (int r = 0; r < NR; r++) {  /* the blocks after the last 8 (all of them in portable C) */
            const int8_t *row = r0 + r * hidden;
            const uint16_t *srow = s0 + r * blocks;
            for (int64_t c = b; c < blocks; c++)
                acc[r] += SCALE(srow, c) * st[c] * (float)int8_block_dot(row + c * I8_BLOCK, xt + c * I8_BLOCK);
            out[t * rows + o + r] = acc[r];
        }
    }
}

/* out (T, rows) = x (T, H) W^T for W (rows, H) int8 with fp16 scales (rows, H / 32): see the section's header.
 * Returns 0, -1 out of memory, -2 bad sizes (H not a positive multiple of 32, too many tokens). */
int crisp_dense_int8(const float *x, int64_t tokens, int64_t hidden, const int8_t *w, const uint16_t *scales,
                     int64_t rows, float *out, int64_t nthreads) {
    if (tokens <= 0 || rows <= 0) return 0;
    if (tokens > MAX_TOKENS || hidden <= 0 || hidden % I8_BLOCK || nthreads < 1) return -2;
    if (nthreads > rows) nthreads = rows;
    int16_t *xq = malloc(sizeof(int16_t) * (size_t)tokens * (size_t)hidden);
    float *sx = malloc(sizeof(float) * (size_t)tokens * (size_t)(hidden / I8_BLOCK));
    int rc = 0;
    if (!xq || !sx) { rc = -1; goto done; }
    int8_quantize_x(x, tokens, hidden, xq, sx);
    const int team_size = (int)(nthreads < omp_get_num_procs() ? nthreads : omp_get_num_procs());
#pragma omp parallel num_threads(team_size)
    {
        const int team = omp_get_num_threads();
        for (int64_t p = omp_get_thread_num(); p < nthreads; p += team) {
            const int64_t r1 = rows * (p + 1) / nthreads;
            int64_t o = rows * p / nthreads;
            for (; o + 4 <= r1; o += 4) int8_rows(xq, sx, tokens, hidden, w, scales, rows, o, 4, out);
            for (; o < r1; o++) int8_rows(xq, sx, tokens, hidden, w, scales, rows, o, 1, out);
        }
    }
done:
    free(xq); free(sx);
    return rc;
}

int crisp_native_abi(void) { return 6; }

/* The vector width this build computes with: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (portable C). */
int crisp_native_vector_bits(void) { return CRISP_SIMD; }
