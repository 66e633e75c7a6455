// The int8-activation products (specd.engine.gemv, `activations="int8"`): rows of float32
// activations against a weight held as GGUF Q4_1 or Q8_0 blocks, where each activation row is first
// quantized, once per product, to signed 8-bit blocks of 32 (d_x = max|x| / 127, q_x =
// round(x * 127 / max|x|), s_x = d_x * sum(q_x), as llama.cpp's Q8_1), and each block's products are
// summed in integers with AVX-512 VNNI. The float32 path spends a fused multiply-add per weight per
// activation row; here one instruction sums 64 of them, and only each block's scaling is float32.
//
// Layout. The blocks are repacked once (specd.engine.gemv.pack_int8) so that 16 output rows sit side
// by side: for each group of 16 outputs and each block, input group i (inputs 4i..4i+3) of the 16
// rows fills one 64-byte register, one 32-bit lane per output. An activation's 4 bytes are broadcast
// against it, so every lane is one output's sum and no horizontal sum is ever needed. Q8_0's signed
// weights are stored plus 128 (VNNI multiplies unsigned by signed bytes); the 128 * sum(q_x) this
// adds is taken off through each row's precomputed -128 * sum(q_x).
//
// Not the float32 product. Quantizing the activations rounds each to one of 255 levels of its
// block's largest magnitude: the outputs differ from the float32 kernel's by that rounding, so
// greedy tokens may differ from the float32 path's. The weights themselves are read exactly.
//
// Exactness between rows. A row's outputs are bitwise the same alone or in a batch of any size, and
// with any number of threads: its quantization depends on its own values only, integer sums are
// exact in any order, and each output is combined in one order, block by block from the first:
//     acc = acc + (float)isum_b * (d_w,b * d_x,b)        (a multiply, then an add: never fused)
//     acc = acc + m_w,b * s_x,b                          (Q4_1 only)
// from acc = 0. tests/unit/test_gemv_int8.py repeats these operations in torch and gets the same
// bits. A verify's positions therefore get the bits their one-token steps get, as long as both take
// this mode.
//
// Needs AVX-512F, BW, VL and VNNI (specd_int8_supported); the products refuse (-1) without them.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*range_fn)(const void *job, int64_t n0, int64_t n1);
void specd_run_rows(range_fn fn, const void *args, int64_t N, int64_t weights);

#define I8 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
// Activation rows summed at once against one group's blocks (a verify of up to 16 positions in one
// pass): their accumulators, the block's eight weight registers and its scales fit the 32 vector
// registers.
#define I8_ROWS 16
// Outputs side by side in the repacked layout (one 32-bit lane each).
#define GROUP 16

static int supported;

__attribute__((constructor)) static void check_cpu(void) {
    __builtin_cpu_init();
    supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

// 1 where this CPU runs the int8-activation products.
int specd_int8_supported(void) { return supported; }

// The quantized rows of one product: q [R, K], and per row and block d_x, s_x and -128 * sum(q_x).
typedef struct {
    int8_t *q;
    float *dx, *sx;
    int32_t *base;
    int64_t K, blocks;
} Acts;

typedef struct {
    const Acts *a;
    const uint8_t *q;
    const float *s;
    float *y;
    int64_t R, N;
} Job;

I8 static void quantize_row(const float *x, const Acts *a, int64_t r) {
    int8_t *q = a->q + r * a->K;
    for (int64_t b = 0; b < a->blocks; b++) {
        const __m512 lo = _mm512_loadu_ps(x + 32 * b), hi = _mm512_loadu_ps(x + 32 * b + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512 scale = _mm512_set1_ps(id);
        // Ties to even, whatever the thread's rounding mode.
        const __m512i qlo = _mm512_cvt_roundps_epi32(_mm512_mul_ps(lo, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i qhi = _mm512_cvt_roundps_epi32(_mm512_mul_ps(hi, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(q + 32 * b), _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(q + 32 * b + 16), _mm512_cvtepi32_epi8(qhi));
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        a->dx[r * a->blocks + b] = d;
        a->sx[r * a->blocks + b] = d * (float)sum;
        a->base[r * a->blocks + b] = -128 * sum;
    }
}

// Quantizes R rows of x [R, K] into a (one allocation, at a->q: the caller frees it). 0, or -1
// without memory.
I8 static int quantize(const float *x, int64_t R, int64_t K, Acts *a) {
    a->K = K, a->blocks = K / 32;
    const size_t qbytes = ((size_t)(R * K) + 63) & ~(size_t)63, per_block = (size_t)(R * a->blocks) * 4;
    void *buffer = aligned_alloc(64, (qbytes + 3 * per_block + 63) & ~(size_t)63);
    if (!buffer) return -1;
    a->q = buffer;
    a->dx = (float *)((char *)buffer + qbytes);
    a->sx = (float *)((char *)buffer + qbytes + per_block);
    a->base = (int32_t *)((char *)buffer + qbytes + 2 * per_block);
    for (int64_t r = 0; r < R; r++) quantize_row(x + r * K, a, r);
    return 0;
}

// Input group i (4 bytes) of an activation row's block, broadcast to every lane.
I8 static inline __m512i group_of(const int8_t *x, int i) {
    int32_t v;
    memcpy(&v, x + 4 * i, 4);
    return _mm512_set1_epi32(v);
}

// One block's integer sums for 16 outputs: two chains of four, so that the multiply-adds of one
// row do not all wait on each other.
I8 static inline __m512i block_sums(const __m512i w[8], const int8_t *x, __m512i start) {
    __m512i s0 = start, s1 = _mm512_setzero_si512();
    for (int i = 0; i < 4; i++) {
        s0 = _mm512_dpbusd_epi32(s0, w[i], group_of(x, i));
        s1 = _mm512_dpbusd_epi32(s1, w[i + 4], group_of(x, i + 4));
    }
    return _mm512_add_epi32(s0, s1);
}

// Block b of the next group (its bytes follow this group's), fetched while this one is summed where
// there are several rows (as gemv.c's float products do: with one row the hardware prefetcher kept
// up alone). A prefetch never faults, past the last group too.
static inline void prefetch_next(const uint8_t *qg, const float *sg, int64_t blocks, int64_t b, int64_t qbytes,
                                 int64_t scales) {
    for (int64_t i = 0; i < qbytes; i += 64) _mm_prefetch((const char *)(qg + (blocks + b) * qbytes + i), _MM_HINT_T0);
    for (int64_t i = 0; i < scales; i += 16) _mm_prefetch((const char *)(sg + (blocks + b) * scales + i), _MM_HINT_T0);
}

// R activation rows (from row r0) against one group of 16 outputs (its blocks at qg, its scales
// at sg); outputs N apart from y, the lanes in `keep` stored.
#define Q4_DOT(R)                                                                                    \
    I8 static void q4_dot_##R(const Acts *a, int64_t r0, const uint8_t *qg, const float *sg, float *y, int64_t N, \
                              __mmask16 keep) {                                                      \
        __m512 acc[R];                                                                               \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                    \
        const __m512i nibble = _mm512_set1_epi8(0x0F);                                               \
        for (int64_t b = 0; b < a->blocks; b++) {                                                    \
            __m512i w[8];                                                                            \
            if (R > 1) prefetch_next(qg, sg, a->blocks, b, 256, 32);                                 \
            /* Chunk i: inputs 4i.. in the low nibbles, 16 + 4i.. in the high ones. */               \
            for (int i = 0; i < 4; i++) {                                                            \
                const __m512i c = _mm512_loadu_si512(qg + b * 256 + 64 * i);                         \
                w[i] = _mm512_and_si512(c, nibble);                                                  \
                w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble);                        \
            }                                                                                        \
            const __m512 dw = _mm512_loadu_ps(sg + b * 32), mw = _mm512_loadu_ps(sg + b * 32 + 16);  \
            for (int r = 0; r < R; r++) {                                                            \
                const int64_t at = (r0 + r) * a->blocks + b;                                         \
                const __m512i isum = block_sums(w, a->q + (r0 + r) * a->K + 32 * b, _mm512_setzero_si512()); \
                const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(a->dx[at]));                      \
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), dd));         \
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(mw, _mm512_set1_ps(a->sx[at])));        \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * N, keep, acc[r]);                  \
    }

#define Q8_DOT(R)                                                                                    \
    I8 static void q8_dot_##R(const Acts *a, int64_t r0, const uint8_t *qg, const float *sg, float *y, int64_t N, \
                              __mmask16 keep) {                                                      \
        __m512 acc[R];                                                                               \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                    \
        for (int64_t b = 0; b < a->blocks; b++) {                                                    \
            __m512i w[8];                                                                            \
            if (R > 1) prefetch_next(qg, sg, a->blocks, b, 512, 16);                                 \
            for (int i = 0; i < 8; i++) w[i] = _mm512_loadu_si512(qg + b * 512 + 64 * i);            \
            const __m512 dw = _mm512_loadu_ps(sg + b * 16);                                          \
            for (int r = 0; r < R; r++) {                                                            \
                const int64_t at = (r0 + r) * a->blocks + b;                                         \
                const __m512i isum = block_sums(w, a->q + (r0 + r) * a->K + 32 * b, _mm512_set1_epi32(a->base[at])); \
                const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(a->dx[at]));                      \
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), dd));         \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * N, keep, acc[r]);                  \
    }

typedef void (*i8_fn)(const Acts *, int64_t, const uint8_t *, const float *, float *, int64_t, __mmask16);

// A kind's products by the bytes and floats of one block of 16 outputs in the repacked layout.
#define I8_KIND(KIND, DOT, QBYTES, SCALES)                                                           \
    DOT(1) DOT(2) DOT(3) DOT(4) DOT(5) DOT(6) DOT(7) DOT(8) DOT(9) DOT(10) DOT(11) DOT(12) DOT(13) DOT(14) \
    DOT(15) DOT(16)                                                                                  \
    static const i8_fn KIND##_dots[I8_ROWS + 1] = {                                                  \
        0, KIND##_dot_1, KIND##_dot_2, KIND##_dot_3, KIND##_dot_4, KIND##_dot_5, KIND##_dot_6,       \
        KIND##_dot_7, KIND##_dot_8, KIND##_dot_9, KIND##_dot_10, KIND##_dot_11, KIND##_dot_12,       \
        KIND##_dot_13, KIND##_dot_14, KIND##_dot_15, KIND##_dot_16};                                 \
    static void KIND##_groups(const void *job_args, int64_t g0, int64_t g1) {                        \
        const Job *j = job_args;                                                                     \
        const int64_t blocks = j->a->blocks;                                                         \
        for (int64_t g = g0; g < g1; g++) {                                                          \
            const int64_t left = j->N - g * GROUP;                                                   \
            const __mmask16 keep = left >= GROUP ? 0xFFFF : (__mmask16)((1u << left) - 1);           \
            for (int64_t r = 0; r < j->R; r += I8_ROWS) {                                            \
                const int64_t take = j->R - r < I8_ROWS ? j->R - r : I8_ROWS;                        \
                KIND##_dots[take](j->a, r, j->q + g * blocks * QBYTES, j->s + g * blocks * SCALES,   \
                                  j->y + r * j->N + g * GROUP, j->N, keep);                          \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    int specd_gemv_##KIND##i8(const float *x, const uint8_t *q, const float *s, float *y, int64_t R, int64_t N, \
                              int64_t K) {                                                           \
        Acts a;                                                                                      \
        if (R < 1 || N < 1 || K < 32 || K % 32 || !supported || quantize(x, R, K, &a)) return -1;    \
        const Job j = {&a, q, s, y, R, N};                                                           \
        specd_run_rows(KIND##_groups, &j, (N + GROUP - 1) / GROUP, N * K);                           \
        free(a.q);                                                                                   \
        return 0;                                                                                    \
    }

I8_KIND(q4, Q4_DOT, 256, 32)
I8_KIND(q8, Q8_DOT, 512, 16)
