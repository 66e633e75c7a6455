// y[r, n] = sum_k x[r, k] * w[n, k] (+ nothing else): a few rows of activations against nn.Linear's
// row-major float32 weight, for the one-token steps and short verifies of a CPU decode.
//
// The product is bound by reading the weight, so each weight row is streamed once for up to 8
// activation rows. Every output is accumulated the same way whatever the row count: eight lanes
// over k in order (the last, partial group of 8 through a masked load), then the same horizontal
// sum. A row's outputs are therefore bitwise the same alone or in a
// batch, which keeps a verify's logits equal to the one-token steps' (greedy exactness).
// Built by specd.engine.gemv with -mavx2 -mfma; no OpenMP (one thread: torch's own threads are
// left alone).
#include <immintrin.h>
#include <stdint.h>

#define MAX_ROWS 8

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    lo = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, lo);
    return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}

// NB weight rows from n0 against R activation rows (NB is 1, below); `tail` masks the lanes of the last k group.
// With more than one row the arithmetic between loads hides less of the memory latency, so the
// next rows are prefetched (a line per 16 floats; a prefetch past the end never faults); with one
// row the hardware prefetcher did better alone.
#define TILE(R, NB)                                                                                 \
    static void tile_##R##_##NB(const float *x, const float *w, float *y, int64_t N, int64_t K,   \
                                int64_t n0, __m256i tail) {                                        \
        __m256 acc[R][NB];                                                                          \
        for (int r = 0; r < R; r++)                                                                 \
            for (int j = 0; j < NB; j++) acc[r][j] = _mm256_setzero_ps();                           \
        const int64_t full = K & ~(int64_t)7;                                                       \
        for (int64_t k = 0; k < full; k += 8) {                                                     \
            __m256 wv[NB];                                                                          \
            for (int j = 0; j < NB; j++) wv[j] = _mm256_loadu_ps(w + (n0 + j) * K + k);            \
            if (R > 1 && (k & 15) == 0)                                                             \
                for (int j = 0; j < NB; j++)                                                        \
                    _mm_prefetch((const char *)(w + (n0 + NB + j) * K + k), _MM_HINT_T0);           \
            for (int r = 0; r < R; r++) {                                                           \
                __m256 xv = _mm256_loadu_ps(x + r * K + k);                                         \
                for (int j = 0; j < NB; j++) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);     \
            }                                                                                       \
        }                                                                                           \
        if (full < K) {                                                                             \
            __m256 wv[NB];                                                                          \
            for (int j = 0; j < NB; j++) wv[j] = _mm256_maskload_ps(w + (n0 + j) * K + full, tail); \
            for (int r = 0; r < R; r++) {                                                           \
                __m256 xv = _mm256_maskload_ps(x + r * K + full, tail);                             \
                for (int j = 0; j < NB; j++) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);     \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < R; r++)                                                                 \
            for (int j = 0; j < NB; j++) y[r * N + n0 + j] = hsum(acc[r][j]);                      \
    }

// One weight row at a time: the weight is then read as one sequential stream, which the hardware
// prefetcher followed much better than several rows interleaved (the activation rows stay in L1).
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(5, 1) TILE(6, 1) TILE(7, 1) TILE(8, 1)

typedef void (*tile_fn)(const float *, const float *, float *, int64_t, int64_t, int64_t, __m256i);

static const tile_fn tiles[MAX_ROWS + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1,
                                            tile_5_1, tile_6_1, tile_7_1, tile_8_1};

// x [R, K], w [N, K], y [R, N], all contiguous float32. Rows are taken 8 at a time. Returns 0, or
// -1 for a shape it does not take (nothing written).
int specd_gemv(const float *x, const float *w, float *y, int64_t R, int64_t N, int64_t K) {
    if (R < 1 || N < 1 || K < 1) return -1;
    int32_t lanes[8];
    for (int i = 0; i < 8; i++) lanes[i] = i < (K & 7) ? -1 : 0;
    const __m256i tail = _mm256_loadu_si256((const __m256i *)lanes);
    for (int64_t r0 = 0; r0 < R; r0 += MAX_ROWS) {
        const int64_t rows = R - r0 < MAX_ROWS ? R - r0 : MAX_ROWS;
        const float *xr = x + r0 * K;
        float *yr = y + r0 * N;
        for (int64_t n = 0; n < N; n++) tiles[rows](xr, w, yr, N, K, n, tail);
    }
    return 0;
}
