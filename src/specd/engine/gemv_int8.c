// The int8-activation products (specd.engine.gemv, `activations="int8"`): rows of float32
// activations against a weight held as GGUF Q4_1 or Q8_0 blocks, where each activation row is first
// quantized, once per product, to signed 8-bit blocks of 32 (d_x = max|x| / 127, q_x =
// round(x * 127 / max|x|), s_x = d_x * sum(q_x), as llama.cpp's Q8_1), and each block's products are
// summed in integers with AVX-512 VNNI (or in an AVX2 form: see below). The float32 path spends a
// fused multiply-add per weight per activation row; here one instruction sums 64 of them, and only
// each block's scaling is float32.
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
// Two forms, the same bits. With AVX-512F, BW, VL and VNNI the sums are VNNI's (the default); with
// AVX2 only (Zen 3) they are made with maddubs and madd (the second half of this file), and
// specd_set_int8_vnni(0) forces that form where VNNI is present (the tests compare the two). Both
// quantize the activations to the same bytes and scales, their integer sums are exact, and they
// combine each output in the order above with the same float32 operations (never fused: the
// library is built with -ffp-contract=off), so a row's outputs are bitwise the same in either
// form. specd_int8_supported is 1 where either runs; the products refuse (-1) where neither does.
#include <immintrin.h>
#include <stdatomic.h>
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

// Which form the products take: 2 VNNI, 1 AVX2, 0 none (refused).
enum { NONE, AVX2, VNNI };
static int has_vnni, has_avx2;
static _Atomic int form;

// The VNNI form where `on` and the CPU has it, else the AVX2 form where it has that; returns 1 where
// VNNI is used from now on. The outputs are bitwise the same either way.
int specd_set_int8_vnni(int on) {
    atomic_store(&form, on && has_vnni ? VNNI : has_avx2 ? AVX2 : NONE);
    return atomic_load(&form) == VNNI;
}

__attribute__((constructor)) static void check_cpu(void) {
    __builtin_cpu_init();
    has_vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    // The library as a whole is built for AVX2 and FMA (gemv.py checks them before loading it).
    has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    specd_set_int8_vnni(1);
}

// 1 where this CPU runs the int8-activation products (in either form).
int specd_int8_supported(void) { return atomic_load(&form) != NONE; }

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

typedef void (*quantize_fn)(const float *x, const Acts *a, int64_t r);

// Quantizes R rows of x [R, K] into a, a row at a time by `row` (one allocation, at a->q: the caller
// frees it). 0, or -1 without memory.
static int quantize(const float *x, int64_t R, int64_t K, Acts *a, quantize_fn row) {
    a->K = K, a->blocks = K / 32;
    const size_t qbytes = ((size_t)(R * K) + 63) & ~(size_t)63, per_block = (size_t)(R * a->blocks) * 4;
    void *buffer = aligned_alloc(64, (qbytes + 3 * per_block + 63) & ~(size_t)63);
    if (!buffer) return -1;
    a->q = buffer;
    a->dx = (float *)((char *)buffer + qbytes);
    a->sx = (float *)((char *)buffer + qbytes + per_block);
    a->base = (int32_t *)((char *)buffer + qbytes + 2 * per_block);
    for (int64_t r = 0; r < R; r++) row(x + r * K, a, r);
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

// The AVX2 form. The same layout, read as two halves of 8 outputs (a half's 32 bytes of each 64-byte
// chunk, one 32-bit lane per output as above). maddubs multiplies unsigned by signed bytes and adds
// adjacent pairs into int16 with saturation, so each use is bounded below 32767 to stay exact:
// - q_x is in [-127, 127]: |x * (127 / max|x|)| exceeds 127 by at most float32 rounding, and rounds
//   to 127 (quantize_row2; the VNNI form's quantizer gives the same bytes).
// - Q4_1: a nibble (0..15) against q_x: a pair is at most 2 * 15 * 127 = 3810, and the 8 chunks of a
//   block added in int16 at most 30480, before madd widens the pairs to int32.
// - Q8_0: the stored byte is q_w + 128 (pack_int8), which against q_x could reach 2 * 255 * 127. So
//   q_w is taken back (byte ^ 0x80) and multiplied as |q_w| against q_x with q_w's sign, as llama.cpp
//   does: |q_w| <= 128 (128 only for a byte of 0, a padded output) and |q_x| <= 127, so a pair is at
//   most 2 * 128 * 127 = 32512, and each chunk is widened by madd at once. sum(q_w * q_x) is then
//   the VNNI form's sum((q_w + 128) * q_x) - 128 * sum(q_x), the same integer.
// Outputs in a half of a group.
#define HALF 8

// The VNNI form's quantize_row, with AVX2: the same bytes and scales. Each q_x is the low byte of
// its int32, as _mm512_cvtepi32_epi8 takes it, and the sum is over the int32 values.
static void quantize_row2(const float *x, const Acts *a, int64_t r) {
    int8_t *q = a->q + r * a->K;
    int8_t masks[4][32];
    // Mask i moves the low bytes of a 128-bit lane's four int32 to that lane's bytes 4i..4i+3.
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 32; j++) masks[i][j] = (int8_t)((j % 16) / 4 == i ? (j % 4) * 4 : -1);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < a->blocks; b++) {
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + 32 * b + 8 * i);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m256 scale = _mm256_set1_ps(id);
        __m256i bytes = _mm256_setzero_si256(), total = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            // Ties to even, whatever the thread's rounding mode; then an exact truncation.
            const __m256 scaled = _mm256_mul_ps(v[i], scale);
            const __m256 rounded = _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256i qi = _mm256_cvttps_epi32(rounded);
            total = _mm256_add_epi32(total, qi);
            bytes = _mm256_or_si256(bytes, _mm256_shuffle_epi8(qi, _mm256_loadu_si256((const __m256i *)masks[i])));
        }
        _mm256_storeu_si256((__m256i *)(q + 32 * b), _mm256_permutevar8x32_epi32(bytes, order));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        const int sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
        a->dx[r * a->blocks + b] = d;
        a->sx[r * a->blocks + b] = d * (float)sum;
        a->base[r * a->blocks + b] = -128 * sum;
    }
}

// Input group i (4 bytes) of an activation row's block, broadcast to every lane.
static inline __m256i group2_of(const int8_t *x, int i) {
    int32_t v;
    memcpy(&v, x + 4 * i, 4);
    return _mm256_set1_epi32(v);
}

// One Q4_1 block's integer sums for 8 outputs (the bounds above).
static inline __m256i q4_sums2(const __m256i w[8], const int8_t *x) {
    __m256i pairs = _mm256_maddubs_epi16(w[0], group2_of(x, 0));
    for (int i = 1; i < 8; i++) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[i], group2_of(x, i)));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// One Q8_0 block's integer sums for 8 outputs, from its q_w as signed bytes (the bounds above).
static inline __m256i q8_sums2(const __m256i w[8], const int8_t *x) {
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < 8; i++) {
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w[i]), _mm256_sign_epi8(group2_of(x, i), w[i]));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
    return sum;
}

// The first `keep` of a half's 8 outputs.
static inline void store_half(float *y, __m256 v, int keep) {
    if (keep == HALF) {
        _mm256_storeu_ps(y, v);
        return;
    }
    float all[HALF];
    _mm256_storeu_ps(all, v);
    memcpy(y, all, sizeof(float) * (size_t)keep);
}

// R activation rows (from row r0) against half h of one group (its blocks at qg, its scales at sg),
// combined as the VNNI form combines them; outputs N apart from y, the first `keep` stored.
#define A2_DOT(KIND, R, QBYTES, SCALES, LOAD, SUMS, MINS)                                            \
    static void KIND##_dot2_##R(const Acts *a, int64_t r0, const uint8_t *qg, const float *sg, float *y, int64_t N, \
                                int h, int keep) {                                                   \
        __m256 acc[R];                                                                               \
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                    \
        for (int64_t b = 0; b < a->blocks; b++) {                                                    \
            __m256i w[8];                                                                            \
            LOAD(qg + b * QBYTES + HALF * 4 * h, w);                                                 \
            const __m256 dw = _mm256_loadu_ps(sg + b * SCALES + HALF * h);                           \
            for (int r = 0; r < R; r++) {                                                            \
                const int64_t at = (r0 + r) * a->blocks + b;                                         \
                const __m256i isum = SUMS(w, a->q + (r0 + r) * a->K + 32 * b);                       \
                const __m256 dd = _mm256_mul_ps(dw, _mm256_set1_ps(a->dx[at]));                      \
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(isum), dd));         \
                MINS                                                                                 \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < R; r++) store_half(y + r * N, acc[r], keep);                             \
    }

// A Q4_1 half's 8 registers: chunk i's low nibbles (inputs 4i..) in w[i], its high ones in w[i + 4].
static inline void q4_load2(const uint8_t *q, __m256i w[8]) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < 4; i++) {
        const __m256i c = _mm256_loadu_si256((const __m256i *)(q + 64 * i));
        w[i] = _mm256_and_si256(c, nibble);
        w[i + 4] = _mm256_and_si256(_mm256_srli_epi16(c, 4), nibble);
    }
}

// A Q8_0 half's 8 registers of q_w as signed bytes (stored plus 128).
static inline void q8_load2(const uint8_t *q, __m256i w[8]) {
    for (int i = 0; i < 8; i++)
        w[i] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + 64 * i)), _mm256_set1_epi8((char)0x80));
}

// Q4_1's second term, after the first as in the VNNI form.
#define Q4_MINS                                                                                      \
    const __m256 mw = _mm256_loadu_ps(sg + b * 32 + 16 + HALF * h);                                  \
    acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(mw, _mm256_set1_ps(a->sx[at])));
#define Q4_DOT2(R) A2_DOT(q4, R, 256, 32, q4_load2, q4_sums2, Q4_MINS)
#define Q8_DOT2(R) A2_DOT(q8, R, 512, 16, q8_load2, q8_sums2, )

typedef void (*a2_fn)(const Acts *, int64_t, const uint8_t *, const float *, float *, int64_t, int, int);

// A kind's AVX2 products, by the bytes and floats of one block of 16 outputs, up to ROWS activation
// rows at once against a half's block (Q8_0 spends more registers per row on the signs, and takes
// fewer).
#define A2_KIND(KIND, DOT, QBYTES, SCALES, ROWS)                                                     \
    DOT(1) DOT(2) DOT(3) DOT(4) DOT(5) DOT(6) DOT(7) DOT(8)                                          \
    static const a2_fn KIND##_dots2[9] = {0, KIND##_dot2_1, KIND##_dot2_2, KIND##_dot2_3, KIND##_dot2_4, \
        KIND##_dot2_5, KIND##_dot2_6, KIND##_dot2_7, KIND##_dot2_8};                                \
    static void KIND##_groups2(const void *job_args, int64_t g0, int64_t g1) {                       \
        const Job j = *(const Job *)job_args;                                                        \
        const int64_t blocks = j.a->blocks;                                                          \
        for (int64_t g = g0; g < g1; g++)                                                            \
            for (int h = 0; h < 2 && j.N - g * GROUP > HALF * h; h++) {                              \
                const int64_t left = j.N - g * GROUP - HALF * h;                                     \
                for (int64_t r = 0; r < j.R; r += ROWS) {                                            \
                    const int64_t take = j.R - r < ROWS ? j.R - r : ROWS;                            \
                    float *y = j.y + r * j.N + g * GROUP + HALF * h;                                 \
                    KIND##_dots2[take](j.a, r, j.q + g * blocks * QBYTES, j.s + g * blocks * SCALES, y, j.N, h, \
                                       left < HALF ? (int)left : HALF);                              \
                }                                                                                    \
            }                                                                                        \
    }

A2_KIND(q4, Q4_DOT2, 256, 32, 8)
A2_KIND(q8, Q8_DOT2, 512, 16, 4)

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
        const int f = atomic_load(&form);                                                            \
        Acts a;                                                                                      \
        if (R < 1 || N < 1 || K < 32 || K % 32 || f == NONE) return -1;                              \
        if (quantize(x, R, K, &a, f == VNNI ? quantize_row : quantize_row2)) return -1;              \
        const Job j = {&a, q, s, y, R, N};                                                           \
        specd_run_rows(f == VNNI ? KIND##_groups : KIND##_groups2, &j, (N + GROUP - 1) / GROUP, N * K); \
        free(a.q);                                                                                   \
        return 0;                                                                                    \
    }

I8_KIND(q4, Q4_DOT, 256, 32)
I8_KIND(q8, Q8_DOT, 512, 16)
