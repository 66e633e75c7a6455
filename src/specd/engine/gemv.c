// y[r, n] = sum_k x[r, k] * w[n, k]: rows of activations against a linear layer's weight, for the
// one-token steps and the verifies of a CPU decode (every forward up to specd.engine.gemv.RowKernel's
// bound). Built by specd.engine.gemv with -mavx2 -mfma -ffp-contract=off -pthread.
//
// Threads. specd_set_threads(n) shares each product's weight rows among n threads (the caller and
// n - 1 helpers, which spin briefly between products and then sleep): a weight row's outputs are
// computed by one thread with the same code whichever it is, so the results do not depend on n.
//
// Exactness. Every output is summed the same way whatever the row count, and whatever form the
// weight is held in: the k group of 8 starting at k is multiplied and added into accumulator
// (k / 8) % 4 (eight lanes each, in order of k; the last, partial group through a masked load),
// then the four are folded as (a0 + a1) + (a2 + a3) and summed horizontally. A row's outputs are
// therefore bitwise the same alone or in a batch of any size. That keeps a verify's logits equal to
// the one-token steps' (greedy exactness) only where both take this kernel: specd.engine.gemv's
// RowKernel takes it for every forward up to a bound, by rule, since torch's product sums a row
// differently beside other rows. Four chains, not one, so that a row's multiply-adds do not wait on
// each other's latency.
//
// Weight forms. specd_gemv reads nn.Linear's row-major float32 weight. specd_gemv_q4 and
// specd_gemv_q8 read it as blocks of 32 inputs, GGUF's Q4_1 (w = d * q + m, q in 0..15) and Q8_0
// (w = d * q, q in -127..127) layouts, which a float32 model loaded from such a GGUF holds exactly.
// Each weight is rebuilt with the float32 operations that made the float32 copy (a multiply, then
// an add: never fused, hence -ffp-contract=off), so their outputs are bitwise specd_gemv's on the
// float32 copy, from an eighth (Q4_1) or about a quarter (Q8_0) of the bytes.
//
// gemv_int8.c, built into the same library, is another mode over the same blocks: the activations
// quantized to 8 bits, integer dot products. Its outputs are not these (the activations' rounding
// changes them), but they keep this file's row exactness by the same rule: a fixed order per output,
// so a row's bits do not depend on the rows beside it or on the threads (gemv_int8.c says how).
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#define MAX_ROWS 8
#define CHAINS 4
// Activation rows summed at once against one weight row: 3 x CHAINS accumulators and the weight
// fit the 16 vector registers.
#define SUB_ROWS 3

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    lo = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, lo);
    return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}

static inline float fold(const __m256 acc[CHAINS]) {
    return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

// R activation rows (x, K apart) against one float32 weight row wn; outputs N apart from y.
// With more than one row the arithmetic between loads hides less of the memory latency, so the next
// weight row is prefetched (a line per 16 floats; a prefetch never faults); with one row the
// hardware prefetcher did better alone.
#define DOT(R)                                                                                       \
    static void dot_##R(const float *x, const float *wn, float *y, int64_t N, int64_t K, __m256i tail, \
                        int prefetch) {                                                              \
        __m256 acc[R][CHAINS];                                                                       \
        for (int r = 0; r < R; r++)                                                                  \
            for (int c = 0; c < CHAINS; c++) acc[r][c] = _mm256_setzero_ps();                        \
        const int64_t whole = K & ~(int64_t)31, full = K & ~(int64_t)7;                              \
        for (int64_t k = 0; k < whole; k += 32) {                                                    \
            if (prefetch) {                                                                          \
                _mm_prefetch((const char *)(wn + K + k), _MM_HINT_T0);                               \
                _mm_prefetch((const char *)(wn + K + k + 16), _MM_HINT_T0);                          \
            }                                                                                        \
            for (int c = 0; c < CHAINS; c++) {                                                       \
                const __m256 wv = _mm256_loadu_ps(wn + k + 8 * c);                                   \
                for (int r = 0; r < R; r++)                                                          \
                    acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8 * c), wv, acc[r][c]); \
            }                                                                                        \
        }                                                                                            \
        /* The last groups of 8 (fewer than 4) and the masked tail, each into its own chain. */      \
        for (int c = 0; c < CHAINS; c++) {                                                           \
            const int64_t k = whole + 8 * c;                                                         \
            if (k >= K) break;                                                                       \
            const __m256i mask = k < full ? _mm256_set1_epi32(-1) : tail;                            \
            const __m256 wv = _mm256_maskload_ps(wn + k, mask);                                      \
            for (int r = 0; r < R; r++)                                                              \
                acc[r][c] = _mm256_fmadd_ps(_mm256_maskload_ps(x + r * K + k, mask), wv, acc[r][c]); \
        }                                                                                            \
        for (int r = 0; r < R; r++) y[r * N] = fold(acc[r]);                                         \
    }

DOT(1) DOT(2) DOT(3)

typedef void (*dot_fn)(const float *, const float *, float *, int64_t, int64_t, __m256i, int);
static const dot_fn dots[SUB_ROWS + 1] = {0, dot_1, dot_2, dot_3};

// `rows` activation rows against weight row wn, SUB_ROWS at a time (after the first pass the
// weight row is in L1).
static void dot_rows(const float *x, const float *wn, float *y, int64_t rows, int64_t N, int64_t K,
                     __m256i tail, int prefetch) {
    for (int64_t r = 0; r < rows; r += SUB_ROWS) {
        const int64_t take = rows - r < SUB_ROWS ? rows - r : SUB_ROWS;
        dots[take](x + r * K, wn, y + r * N, N, K, tail, prefetch && r == 0);
    }
}

static __m256i tail_mask(int64_t K) {
    int32_t lanes[8];
    for (int i = 0; i < 8; i++) lanes[i] = i < (K & 7) ? -1 : 0;
    return _mm256_loadu_si256((const __m256i *)lanes);
}

// -- the helpers ------------------------------------------------------------------------------
// A product's weight rows are taken in chunks from a shared counter by the caller and whichever
// helpers are running, so a helper the scheduler has put aside delays nothing but its own chunk.
// Each product is a record in a ring; a helper announces itself on the record (refs) and checks its
// generation before reading it, and the caller invalidates a record, then waits for its readers to
// leave, before reusing it (Dekker's pattern: both sides write, then read the other's variable).
#define MAX_THREADS 64
#define RING 64
// A product smaller than this (weights) is not split: waking a helper would cost more.
#define SPLIT_WEIGHTS (1 << 16)
// Pauses a thread spins before it sleeps (helpers) or yields its core (a caller waiting for a chunk).
#define SPINS 20000

typedef void (*range_fn)(const void *job, int64_t n0, int64_t n1);

typedef struct {
    _Atomic int64_t generation, refs, next, done;
    range_fn fn;
    const void *job;
    int64_t rows, chunk;
} Record;

static int threads = 1, started = 0;
static Record ring[RING];
static _Atomic int64_t generation;
static _Atomic int sleepers;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
// Held while a product is split: a second caller at the same time runs its product alone.
static atomic_flag busy = ATOMIC_FLAG_INIT;

static void take_chunks(Record *r) {
    int64_t n0;
    while ((n0 = atomic_fetch_add(&r->next, r->chunk)) < r->rows) {
        const int64_t n1 = n0 + r->chunk < r->rows ? n0 + r->chunk : r->rows;
        r->fn(r->job, n0, n1);
        atomic_fetch_add(&r->done, n1 - n0);
    }
}

static void *helper(void *unused) {
    (void)unused;
    int64_t seen = 0;
    for (;;) {
        int64_t now;
        for (int spin = 0; (now = atomic_load(&generation)) == seen; spin++) {
            if (spin < SPINS) {
                _mm_pause();
                continue;
            }
            pthread_mutex_lock(&lock);
            atomic_fetch_add(&sleepers, 1);
            while (atomic_load(&generation) == seen) pthread_cond_wait(&wake, &lock);
            atomic_fetch_sub(&sleepers, 1);
            pthread_mutex_unlock(&lock);
            spin = 0;
        }
        seen = now;
        Record *r = &ring[now % RING];
        atomic_fetch_add(&r->refs, 1);
        if (atomic_load(&r->generation) == now) take_chunks(r);
        atomic_fetch_sub(&r->refs, 1);
    }
    return NULL;
}

static void register_fork_handler(void);

// A child of fork has none of the helpers: it runs its products alone until told otherwise.
static void forked(void) {
    started = 0;
    threads = 1;
    for (int i = 0; i < RING; i++) atomic_store(&ring[i].refs, 0);
    atomic_flag_clear(&busy);
}

// Threads for the products from now on (1..MAX_THREADS); helpers are started once and kept, idle
// ones asleep. Returns the number in use.
int specd_set_threads(int n) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork_handler);
    n = n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : n;
    for (; started < n - 1; started++) {
        pthread_t t;
        if (pthread_create(&t, NULL, helper, NULL) != 0) break;
        pthread_detach(t);
    }
    threads = n < started + 1 ? n : started + 1;
    return threads;
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, forked); }

static void wait_until(_Atomic int64_t *value, int64_t want, int equal) {
    for (int spin = 0; (atomic_load(value) == want) != equal; spin++)
        if (spin < SPINS) _mm_pause();
        else sched_yield();
}

// fn over rows [0, N), shared with the helpers where the product is large enough.
static void run_rows(range_fn fn, const void *args, int64_t N, int64_t weights) {
    if (threads == 1 || weights < SPLIT_WEIGHTS || N < 2 * threads || atomic_flag_test_and_set(&busy)) {
        fn(args, 0, N);
        return;
    }
    const int64_t now = atomic_load(&generation) + 1;
    Record *r = &ring[now % RING];
    atomic_store(&r->generation, -1);
    wait_until(&r->refs, 0, 1);
    r->fn = fn, r->job = args, r->rows = N;
    r->chunk = N / (4 * threads) > 8 ? N / (4 * threads) : 8;
    atomic_store(&r->next, 0);
    atomic_store(&r->done, 0);
    atomic_store(&r->generation, now);
    atomic_store(&generation, now);
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&lock);
    }
    take_chunks(r);
    wait_until(&r->done, N, 1);
    atomic_flag_clear(&busy);
}

// run_rows for the products of gemv_int8.c, built into the same library.
void specd_run_rows(range_fn fn, const void *args, int64_t N, int64_t weights) { run_rows(fn, args, N, weights); }

// -- the products -------------------------------------------------------------------------------
typedef struct {
    const float *x;
    const void *w;
    const float *s;
    float *y;
    int64_t R, N, K;
} Product;

// Weight floats in a tile: the weight rows every pass of activation rows goes through before the
// next ones, so a product of many rows streams its weight from memory once, not once a pass.
#define FLOAT_TILE 4096

static void float_rows(const void *job_args, int64_t n0, int64_t n1) {
    const Product *p = job_args;
    const __m256i tail = tail_mask(p->K);
    const float *w = p->w;
    const int64_t tile = p->K < FLOAT_TILE ? FLOAT_TILE / p->K : 1;
    for (int64_t t = n0; t < n1; t += tile) {
        const int64_t t1 = t + tile < n1 ? t + tile : n1;
        for (int64_t r0 = 0; r0 < p->R; r0 += MAX_ROWS) {
            const int64_t rows = p->R - r0 < MAX_ROWS ? p->R - r0 : MAX_ROWS;
            for (int64_t n = t; n < t1; n++)
                dot_rows(p->x + r0 * p->K, w + n * p->K, p->y + r0 * p->N + n, rows, p->N, p->K, tail, rows > 1);
        }
    }
}

// Inputs of at most SMALL_K (a multiple of 32): a dot is a few multiply-adds, so folding and
// summing each output alone cost more than the dot. Eight weight rows' chains are folded as `fold`
// folds them, then summed side by side: each lane adds the same two values in the same order as
// `hsum` (a + b and b + a are the same float), so every output is bitwise `fold`'s.
#define SMALL_K 128

static inline __m256 folded(const float *x, const float *wn, int64_t K) {
    __m256 acc[CHAINS];
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 32)
        for (int c = 0; c < CHAINS; c++)
            acc[c] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8 * c), _mm256_loadu_ps(wn + k + 8 * c), acc[c]);
    return _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
}

// hsum of each of f[0..7], as one register: the halves of each added, then pairs, then pairs again.
static inline __m256 hsum8(const __m256 f[8]) {
    __m256 s[4];
    for (int i = 0; i < 4; i++)
        s[i] = _mm256_add_ps(_mm256_permute2f128_ps(f[2 * i], f[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(f[2 * i], f[2 * i + 1], 0x31));
    // Lanes now hold f0, f2, f4, f6, f1, f3, f5, f7.
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
    return _mm256_permutevar8x32_ps(t, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static void float_rows_small(const void *job_args, int64_t n0, int64_t n1) {
    const Product *p = job_args;
    const __m256i tail = tail_mask(p->K);
    const float *w = p->w;
    const int64_t tile = FLOAT_TILE / p->K;
    for (int64_t t = n0; t < n1; t += tile) {
        const int64_t t1 = t + tile < n1 ? t + tile : n1;
        for (int64_t r = 0; r < p->R; r++) {
            const float *x = p->x + r * p->K;
            float *y = p->y + r * p->N;
            int64_t n = t;
            for (; n + 8 <= t1; n += 8) {
                __m256 f[8];
                for (int j = 0; j < 8; j++) f[j] = folded(x, w + (n + j) * p->K, p->K);
                _mm256_storeu_ps(y + n, hsum8(f));
            }
            for (; n < t1; n++) dot_1(x, w + n * p->K, y + n, p->N, p->K, tail, 0);
        }
    }
}

// x [R, K], w [N, K], y [R, N], all contiguous float32. Rows are taken MAX_ROWS at a time, each
// weight row streamed once for them. Returns 0, or -1 for a shape it does not take (nothing written).
int specd_gemv(const float *x, const float *w, float *y, int64_t R, int64_t N, int64_t K) {
    if (R < 1 || N < 1 || K < 1) return -1;
    const Product p = {x, w, NULL, y, R, N, K};
    run_rows(K % 32 == 0 && K <= SMALL_K ? float_rows_small : float_rows, &p, N, N * K);
    return 0;
}

// Q4_1 blocks: 16 bytes per 32 inputs (byte b: q[b] in the low nibble, q[b + 16] in the high one)
// and a (d, m) float pair per block.
static inline void q4_block(const uint8_t *q, const float *dm, __m256 w[4]) {
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    const __m128i lo = _mm_and_si128(bytes, nibble), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    const __m256 d = _mm256_set1_ps(dm[0]), m = _mm256_set1_ps(dm[1]);
    const __m128i parts[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
    for (int i = 0; i < 4; i++)
        w[i] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), d), m);
}

// Q8_0 blocks: 32 signed bytes per 32 inputs and a float d per block.
static inline void q8_block(const uint8_t *q, const float *d, __m256 w[4]) {
    const __m256 scale = _mm256_set1_ps(d[0]);
    for (int i = 0; i < 4; i++) {
        const __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + 8 * i));
        w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale);
    }
}

// -- the AVX-512 forms of the block products ---------------------------------------------------
// A 16-lane register holds two of the four chains side by side: inputs k..k+15 of a block of 32 are
// the k groups of chains 0 and 1, k+16..k+31 those of chains 2 and 3. Its multiply-adds are the
// lane-wise fused ones of the 8-lane form, and its halves are folded in the same order, so its
// outputs are bitwise the 8-lane form's, with half the instructions and two registers per row
// instead of four: up to WIDE_ROWS rows share each block's rebuild. Chosen when the library loads
// where the CPU has AVX-512F (specd_set_wide changes it).
#define WIDE __attribute__((target("avx512f")))
#define WIDE_ROWS 8
// Weight rows taken through every pass of activation rows before the next ones: their blocks stay
// in L1 or L2 between passes.
#define WIDE_TILE 16

// Activation rows per pass over a weight row: as many as fit about 12 KiB (measured better than
// filling L1 or the registers).
static inline int64_t wide_pass(int64_t K) {
    const int64_t fit = 3072 / K;
    return fit < 1 ? 1 : fit > WIDE_ROWS ? WIDE_ROWS : fit;
}

// 0: the 8-lane form; 1: the 16-lane form.
static _Atomic int wide;

WIDE static inline __m256 upper(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

WIDE static inline float fold_wide(__m512 chains01, __m512 chains23) {
    const __m256 a0 = _mm512_castps512_ps256(chains01), a1 = upper(chains01);
    const __m256 a2 = _mm512_castps512_ps256(chains23), a3 = upper(chains23);
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

// The block's 16 possible weights are rebuilt once (d * q + m for q = 0..15, the same float32
// operations as the 8-lane form's per weight) and each input's nibble picks its own.
WIDE static inline void q4_wide_block(const uint8_t *q, const float *dm, __m512 w[2]) {
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_add_ps(_mm512_mul_ps(levels, _mm512_set1_ps(dm[0])), _mm512_set1_ps(dm[1]));
    // A byte widened to 32 bits: its low nibble is the index (the permutation reads 4 bits).
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    w[0] = _mm512_permutexvar_ps(bytes, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

WIDE static inline void q8_wide_block(const uint8_t *q, const float *d, __m512 w[2]) {
    const __m512 scale = _mm512_set1_ps(d[0]);
    for (int i = 0; i < 2; i++) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(q + 16 * i));
        w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), scale);
    }
}

#define WIDE_DOT(KIND, QBYTES, SCALES, R)                                                            \
    WIDE static void KIND##_wide_dot_##R(const float *x, const uint8_t *qn, const float *sn, float *y, \
                                         int64_t N, int64_t K) {                                     \
        __m512 acc[R][2];                                                                            \
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();                    \
        for (int64_t b = 0; b < K / 32; b++) {                                                       \
            __m512 w[2];                                                                             \
            KIND##_wide_block(qn + b * QBYTES, sn + b * SCALES, w);                                  \
            for (int h = 0; h < 2; h++)                                                              \
                for (int r = 0; r < R; r++)                                                          \
                    acc[r][h] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + b * 32 + 16 * h), w[h], acc[r][h]); \
        }                                                                                            \
        for (int r = 0; r < R; r++) y[r * N] = fold_wide(acc[r][0], acc[r][1]);                      \
    }

#define WIDE_BLOCKS(KIND, QBYTES, SCALES)                                                            \
    WIDE_DOT(KIND, QBYTES, SCALES, 1) WIDE_DOT(KIND, QBYTES, SCALES, 2) WIDE_DOT(KIND, QBYTES, SCALES, 3) \
    WIDE_DOT(KIND, QBYTES, SCALES, 4) WIDE_DOT(KIND, QBYTES, SCALES, 5) WIDE_DOT(KIND, QBYTES, SCALES, 6) \
    WIDE_DOT(KIND, QBYTES, SCALES, 7) WIDE_DOT(KIND, QBYTES, SCALES, 8)                              \
    static const KIND##_fn KIND##_wide_dots[WIDE_ROWS + 1] = {                                       \
        0, KIND##_wide_dot_1, KIND##_wide_dot_2, KIND##_wide_dot_3, KIND##_wide_dot_4,               \
        KIND##_wide_dot_5, KIND##_wide_dot_6, KIND##_wide_dot_7, KIND##_wide_dot_8};                 \
    static void KIND##_wide_rows(const void *job_args, int64_t n0, int64_t n1) {                     \
        const Product *p = job_args;                                                                 \
        const int64_t blocks = p->K / 32;                                                            \
        const uint8_t *q = p->w;                                                                     \
        const int64_t pass = wide_pass(p->K);                                                        \
        for (int64_t t = n0; t < n1; t += WIDE_TILE) {                                               \
            const int64_t t1 = t + WIDE_TILE < n1 ? t + WIDE_TILE : n1;                              \
            for (int64_t r = 0; r < p->R; r += pass) {                                               \
                const int64_t take = p->R - r < pass ? p->R - r : pass;                              \
                for (int64_t n = t; n < t1; n++)                                                     \
                    KIND##_wide_dots[take](p->x + r * p->K, q + n * blocks * QBYTES, p->s + n * blocks * SCALES, \
                                           p->y + r * p->N + n, p->N, p->K);                         \
            }                                                                                        \
        }                                                                                            \
    }

// Use the 16-lane block products from now on where `on` and the CPU has AVX-512F; returns 1 if they
// are used. The outputs are the same either way (a test compares them).
int specd_set_wide(int on) {
    __builtin_cpu_init();
    atomic_store(&wide, on && __builtin_cpu_supports("avx512f"));
    return atomic_load(&wide);
}

__attribute__((constructor)) static void choose_form(void) { specd_set_wide(1); }

// R activation rows (x, K apart) against one weight row held as blocks (qn, sn); outputs N apart
// from y. Each block is rebuilt in registers, then summed as DOT sums a float32 row.
#define BLOCK_DOT(KIND, QBYTES, SCALES, R)                                                           \
    static void KIND##_dot_##R(const float *x, const uint8_t *qn, const float *sn, float *y, int64_t N, \
                               int64_t K) {                                                          \
        __m256 acc[R][CHAINS];                                                                       \
        for (int r = 0; r < R; r++)                                                                  \
            for (int c = 0; c < CHAINS; c++) acc[r][c] = _mm256_setzero_ps();                        \
        for (int64_t b = 0; b < K / 32; b++) {                                                       \
            __m256 w[4];                                                                             \
            KIND##_block(qn + b * QBYTES, sn + b * SCALES, w);                                       \
            for (int c = 0; c < CHAINS; c++)                                                         \
                for (int r = 0; r < R; r++)                                                          \
                    acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + b * 32 + 8 * c), w[c], acc[r][c]); \
        }                                                                                            \
        for (int r = 0; r < R; r++) y[r * N] = fold(acc[r]);                                         \
    }

// Both block forms, by their block's bytes and floats. Rows are taken SUB_ROWS at a time against
// each weight row (whose blocks are in L1 after the first pass).
#define BLOCKS(KIND, QBYTES, SCALES)                                                                 \
    BLOCK_DOT(KIND, QBYTES, SCALES, 1) BLOCK_DOT(KIND, QBYTES, SCALES, 2) BLOCK_DOT(KIND, QBYTES, SCALES, 3) \
    typedef void (*KIND##_fn)(const float *, const uint8_t *, const float *, float *, int64_t, int64_t); \
    static const KIND##_fn KIND##_dots[SUB_ROWS + 1] = {0, KIND##_dot_1, KIND##_dot_2, KIND##_dot_3}; \
    static void KIND##_rows(const void *job_args, int64_t n0, int64_t n1) {                          \
        const Product *p = job_args;                                                                 \
        const int64_t blocks = p->K / 32;                                                            \
        const uint8_t *q = p->w;                                                                     \
        for (int64_t n = n0; n < n1; n++)                                                            \
            for (int64_t r = 0; r < p->R; r += SUB_ROWS) {                                           \
                const int64_t take = p->R - r < SUB_ROWS ? p->R - r : SUB_ROWS;                      \
                KIND##_dots[take](p->x + r * p->K, q + n * blocks * QBYTES, p->s + n * blocks * SCALES, \
                                  p->y + r * p->N + n, p->N, p->K);                                  \
            }                                                                                        \
    }                                                                                                \
    WIDE_BLOCKS(KIND, QBYTES, SCALES)                                                                \
    int specd_gemv_##KIND(const float *x, const uint8_t *q, const float *s, float *y, int64_t R, int64_t N, \
                          int64_t K) {                                                               \
        if (R < 1 || N < 1 || K < 32 || K % 32) return -1;                                           \
        const Product p = {x, q, s, y, R, N, K};                                                     \
        run_rows(atomic_load(&wide) ? KIND##_wide_rows : KIND##_rows, &p, N, N * K);                           \
        return 0;                                                                                    \
    }

BLOCKS(q4, 16, 2)
BLOCKS(q8, 32, 1)
