// One Llama decoder layer for a few tokens, on the CPU, in one call: what specd.engine.fused_llama's
// FusedLlamaLayer computes (RMSNorm, q/k/v, rotary embedding, the keys and values written to the
// slot cache, grouped-query attention over each token's own slot, the output product and residual,
// RMSNorm, gate/up, SiLU, down and residual), without a framework call per operation: a decode
// step makes a few hundred of those per layer, which cost about as much as reading the weights.
//
// Each token is computed alone: its products through specd_gemv* (a row's outputs do not depend
// on the rows beside it), its norms, rotation and attention over the keys it sees in its slot,
// summed in increasing key order and in an order that depends on nothing but the token. So a
// token's hidden state is bitwise the same in a one-token step, in a verify of several positions
// and as a node of a token tree. A chain's tokens in one slot (a verify's positions) attend together,
// each tile of keys and values read once for all their query heads, with each query's arithmetic
// unchanged. Built with gemv.c.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

int specd_gemv(const float *x, const float *w, float *y, int64_t R, int64_t N, int64_t K);
int specd_gemv_q4(const float *x, const uint8_t *q, const float *s, float *y, int64_t R, int64_t N, int64_t K);
int specd_gemv_q8(const float *x, const uint8_t *q, const float *s, float *y, int64_t R, int64_t N, int64_t K);
int specd_gemv_q4i8(const float *x, const uint8_t *q, const float *s, float *y, int64_t R, int64_t N, int64_t K);
int specd_gemv_q8i8(const float *x, const uint8_t *q, const float *s, float *y, int64_t R, int64_t N, int64_t K);

// A product's weight [N, K]: float32 (kind 0), or its Q4_1 (1) or Q8_0 (2) blocks (gemv.c), or those
// blocks against int8-quantized activations (3: Q4_1, 4: Q8_0; gemv_int8.c).
typedef struct {
    int64_t kind;
    const void *weight;
    const float *scales;
} Product;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    const float *input_norm, *post_norm;
    Product qkv, o, gate_up, down;
} Layer;

// The tokens of one forward. `sin` has its first half negated (as FusedLlamaBody passes it). The
// cache tensors are [slots, kv_heads, positions, head_dim] with the given strides (in floats).
// `work` holds at least specd_layer_work(layer, tokens, keys) floats. A token's key and value are
// written at positions[t] and rotated by its own cos/sin row, so a token tree's node rotates at its
// depth wherever it is written. Without `prefixes` (NULL) token t sees the keys 0..positions[t];
// with them (and `visible`), the keys 0..prefixes[t]-1 and prefixes[t] + j for each bit j set in
// visible[t]: a tree node's ancestors and itself, at most 64 of them.
typedef struct {
    int64_t tokens, keys;
    float *x;
    const float *cos, *sin;
    const int64_t *slots, *positions;
    float *cache_keys, *cache_values;
    int64_t slot_stride, head_stride, position_stride;
    float *work;
    const int64_t *prefixes;
    const uint64_t *visible;
} Batch;

static int product(const Product *p, const float *x, float *y, int64_t rows, int64_t n, int64_t k) {
    switch (p->kind) {
    case 0: return specd_gemv(x, (const float *)p->weight, y, rows, n, k);
    case 1: return specd_gemv_q4(x, (const uint8_t *)p->weight, p->scales, y, rows, n, k);
    case 2: return specd_gemv_q8(x, (const uint8_t *)p->weight, p->scales, y, rows, n, k);
    case 3: return specd_gemv_q4i8(x, (const uint8_t *)p->weight, p->scales, y, rows, n, k);
    case 4: return specd_gemv_q8i8(x, (const uint8_t *)p->weight, p->scales, y, rows, n, k);
    default: return -1;
    }
}

// exp for float32 lanes: Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial),
// within about 2 units in the last place over the range that matters here.
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float exp1(float x) {
    float lanes[8];
    _mm256_storeu_ps(lanes, exp8(_mm256_set1_ps(x)));
    return lanes[0];
}

// out = weight * (x / sqrt(mean(x^2) + eps)), as transformers' LlamaRMSNorm in float32.
static void rms_norm(const float *x, const float *weight, float *out, int64_t n, float eps) {
    double squares = 0.0;
    for (int64_t i = 0; i < n; i++) squares += (double)x[i] * x[i];
    const float inv = 1.0f / sqrtf((float)(squares / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inv);
}

// transformers' rotate_half form on one head: v * cos + cat(v[half:], v[:half]) * sin.
static void rotate(float *v, const float *cos, const float *sin, int64_t d) {
    float in[512];
    const int64_t half = d / 2;
    memcpy(in, v, (size_t)d * sizeof(float));
    for (int64_t i = 0; i < d; i++) v[i] = in[i] * cos[i] + in[i < half ? i + half : i - half] * sin[i];
}

static inline float fold8(__m256 acc) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
}

static inline float dot8(const float *a, const float *b, int64_t d) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return fold8(acc);
}

// dot8 of a against four rows of b (stride apart) at once: each sum is dot8's, operation for
// operation; four chains, so the multiply-adds do not wait on each other's latency.
static inline void dot8x4(const float *a, const float *b, int64_t stride, int64_t d, float scale, float *out) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 av = _mm256_loadu_ps(a + i);
        acc0 = _mm256_fmadd_ps(av, _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(av, _mm256_loadu_ps(b + stride + i), acc1);
        acc2 = _mm256_fmadd_ps(av, _mm256_loadu_ps(b + 2 * stride + i), acc2);
        acc3 = _mm256_fmadd_ps(av, _mm256_loadu_ps(b + 3 * stride + i), acc3);
    }
    out[0] = fold8(acc0) * scale, out[1] = fold8(acc1) * scale, out[2] = fold8(acc2) * scale, out[3] = fold8(acc3) * scale;
}

// The keys one token sees: the first `n` positions, then the positions in `picked`, in this order.
typedef struct {
    int64_t n, extra;
    const int64_t *picked;
} Keys;

// Softmax attention of one query head over the keys/values `seen` names (stride floats per
// position); out [d]. The visible keys are gathered, never masked: a tree node sees its path's keys
// in the order its chain would, so its sums are the chain's, bit for bit.
static void attend(const float *q, const float *keys, const float *values, const Keys *seen, int64_t stride,
                   int64_t d, float scale, float *scores, float *out) {
    const int64_t n = seen->n + seen->extra;
    float top = -INFINITY;
    int64_t first = 0;
    for (; first + 4 <= seen->n; first += 4) dot8x4(q, keys + first * stride, stride, d, scale, scores + first);
    for (int64_t p = first; p < n; p++) {
        const int64_t at = p < seen->n ? p : seen->picked[p - seen->n];
        scores[p] = dot8(q, keys + at * stride, d) * scale;
    }
    for (int64_t p = 0; p < n; p++) top = scores[p] > top ? scores[p] : top;
    const __m256 shift = _mm256_set1_ps(top);
    int64_t p = 0;
    for (; p + 8 <= n; p += 8) _mm256_storeu_ps(scores + p, exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + p), shift)));
    for (; p < n; p++) scores[p] = exp1(scores[p] - top);
    float total = 0.0f;
    for (p = 0; p < n; p++) total += scores[p];
    __m256 acc[64];
    const int64_t lanes = d / 8;
    for (int64_t i = 0; i < lanes; i++) acc[i] = _mm256_setzero_ps();
    for (p = 0; p < n; p++) {
        const __m256 w = _mm256_set1_ps(scores[p]);
        const float *v = values + (p < seen->n ? p : seen->picked[p - seen->n]) * stride;
        for (int64_t i = 0; i < lanes; i++) acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), acc[i]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / total);
    for (int64_t i = 0; i < lanes; i++) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], inv));
}

// Tokens of one chain whose query heads attend together (`attend_chain`): bounds its workspace.
#define CHAIN_TOKENS 16
// Keys (and values) taken through every query of a chain before the next ones: they stay in L1.
#define KEY_TILE 64

// Attention of the query heads sharing key/value head `kv` for tokens [t0, t1) of one chain (one
// slot; token t sees the keys 0..positions[t]); out rows `attended` + (t * hq + h) * d. The keys
// and values are read a tile at a time for all of them, where `attend` reads them all once a query
// head and token. Each query's sums are `attend`'s, operation for operation and in the same order,
// so its output is bitwise the same. `work`: CHAIN_TOKENS * group * (span + d) floats.
static void attend_chain(const float *qkv, int64_t width, int64_t t0, int64_t t1, int64_t hq, int64_t group,
                         int64_t kv, const float *keys, const float *values, const int64_t *positions,
                         int64_t stride, int64_t d, float scale, int64_t span, float *work, float *attended) {
    const int64_t queries = (t1 - t0) * group, lanes = d / 8;
    int64_t last = 0;
    for (int64_t t = t0; t < t1; t++) last = positions[t] + 1 > last ? positions[t] + 1 : last;
    float *scores = work, *acc = work + queries * span;
    for (int64_t p0 = 0; p0 < last; p0 += KEY_TILE)
        for (int64_t i = 0; i < queries; i++) {
            const int64_t t = t0 + i / group, end = positions[t] + 1 < p0 + KEY_TILE ? positions[t] + 1 : p0 + KEY_TILE;
            const float *q = qkv + t * width + (kv * group + i % group) * d;
            int64_t p = p0;
            for (; p + 4 <= end; p += 4) dot8x4(q, keys + p * stride, stride, d, scale, scores + i * span + p);
            for (; p < end; p++) scores[i * span + p] = dot8(q, keys + p * stride, d) * scale;
        }
    float totals[CHAIN_TOKENS * 64];
    for (int64_t i = 0; i < queries; i++) {
        float *row = scores + i * span;
        const int64_t n = positions[t0 + i / group] + 1;
        float top = -INFINITY;
        for (int64_t p = 0; p < n; p++) top = row[p] > top ? row[p] : top;
        const __m256 shift = _mm256_set1_ps(top);
        int64_t p = 0;
        for (; p + 8 <= n; p += 8) _mm256_storeu_ps(row + p, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + p), shift)));
        for (; p < n; p++) row[p] = exp1(row[p] - top);
        float total = 0.0f;
        for (p = 0; p < n; p++) total += row[p];
        totals[i] = total;
        for (int64_t j = 0; j < lanes; j++) _mm256_storeu_ps(acc + i * d + 8 * j, _mm256_setzero_ps());
    }
    __m256 a[64];
    for (int64_t p0 = 0; p0 < last; p0 += KEY_TILE)
        for (int64_t i = 0; i < queries; i++) {
            const int64_t n = positions[t0 + i / group] + 1, end = n < p0 + KEY_TILE ? n : p0 + KEY_TILE;
            if (end <= p0) continue;
            for (int64_t j = 0; j < lanes; j++) a[j] = _mm256_loadu_ps(acc + i * d + 8 * j);
            for (int64_t p = p0; p < end; p++) {
                const __m256 w = _mm256_set1_ps(scores[i * span + p]);
                const float *v = values + p * stride;
                for (int64_t j = 0; j < lanes; j++) a[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * j), a[j]);
            }
            for (int64_t j = 0; j < lanes; j++) _mm256_storeu_ps(acc + i * d + 8 * j, a[j]);
        }
    for (int64_t i = 0; i < queries; i++) {
        const __m256 inv = _mm256_set1_ps(1.0f / totals[i]);
        float *out = attended + ((t0 + i / group) * hq + kv * group + i % group) * d;
        for (int64_t j = 0; j < lanes; j++) _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(acc + i * d + 8 * j), inv));
    }
}

// Floats of workspace a batch of `tokens` attending at most `keys` keys needs.
int64_t specd_layer_work(const Layer *l, int64_t tokens, int64_t keys) {
    const int64_t qkv = (l->heads + 2 * l->kv_heads) * l->head_dim, group = l->heads / l->kv_heads;
    return tokens * (l->hidden + qkv + l->heads * l->head_dim + 3 * l->inter + l->hidden) + keys + 8 +
           CHAIN_TOKENS * group * (keys + 8 + l->head_dim);
}

// 0, or -1 where a shape is not taken (head_dim not a multiple of 8 or over 512; nothing is then
// known to be written, and the caller runs the layer another way).
int specd_layer(const Layer *l, const Batch *b) {
    const int64_t T = b->tokens, H = l->hidden, d = l->head_dim, hq = l->heads, hkv = l->kv_heads;
    const int64_t I = l->inter, width = (hq + 2 * hkv) * d;
    if (d % 8 || d > 512 || hq % hkv || T < 1) return -1;
    float *normed = b->work, *qkv = normed + T * H, *attended = qkv + T * width, *gate_up = attended + T * hq * d;
    float *act = gate_up + 2 * T * I, *out = act + T * I, *scores = out + T * H;
    for (int64_t t = 0; t < T; t++) rms_norm(b->x + t * H, l->input_norm, normed + t * H, H, l->eps);
    if (product(&l->qkv, normed, qkv, T, width, H)) return -1;
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * width;
        for (int64_t h = 0; h < hq + hkv; h++) rotate(row + h * d, b->cos + t * d, b->sin + t * d, d);
        const int64_t base = b->slots[t] * b->slot_stride + b->positions[t] * b->position_stride;
        for (int64_t h = 0; h < hkv; h++) {
            memcpy(b->cache_keys + base + h * b->head_stride, row + (hq + h) * d, (size_t)d * sizeof(float));
            memcpy(b->cache_values + base + h * b->head_stride, row + (hq + hkv + h) * d, (size_t)d * sizeof(float));
        }
    }
    // Every token's key is written before any attends: a verify's later positions see the earlier.
    // Chains (no token trees) attend a slot's run of tokens together, each key and value read once.
    const int64_t group = hq / hkv, span = b->keys + 8;
    float *chain_work = scores + b->keys + 8;
    for (int64_t t0 = 0; !b->prefixes && group <= 64 && t0 < T;) {
        int64_t t1 = t0 + 1;
        while (t1 < T && t1 - t0 < CHAIN_TOKENS && b->slots[t1] == b->slots[t0]) t1++;
        for (int64_t kv = 0; kv < hkv; kv++)
            attend_chain(qkv, width, t0, t1, hq, group, kv, b->cache_keys + b->slots[t0] * b->slot_stride + kv * b->head_stride,
                         b->cache_values + b->slots[t0] * b->slot_stride + kv * b->head_stride, b->positions,
                         b->position_stride, d, l->scale, span, chain_work, attended);
        t0 = t1;
    }
    for (int64_t t = 0; (b->prefixes || group > 64) && t < T; t++) {
        const float *row = qkv + t * width;
        int64_t picked[64];
        Keys seen = {b->positions[t] + 1, 0, picked};
        if (b->prefixes) {
            seen.n = b->prefixes[t];
            for (int64_t j = 0; j < 64; j++)
                if (b->visible[t] >> j & 1) picked[seen.extra++] = b->prefixes[t] + j;
        }
        for (int64_t h = 0; h < hq; h++) {
            const int64_t kv = b->slots[t] * b->slot_stride + (h / (hq / hkv)) * b->head_stride;
            attend(row + h * d, b->cache_keys + kv, b->cache_values + kv, &seen, b->position_stride, d, l->scale,
                   scores, attended + (t * hq + h) * d);
        }
    }
    if (product(&l->o, attended, out, T, H, hq * d)) return -1;
    for (int64_t i = 0; i < T * H; i++) b->x[i] += out[i];
    for (int64_t t = 0; t < T; t++) rms_norm(b->x + t * H, l->post_norm, normed + t * H, H, l->eps);
    if (product(&l->gate_up, normed, gate_up, T, 2 * I, H)) return -1;
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *a = act + t * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 sig = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(sig, _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) a[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
    }
    if (product(&l->down, act, out, T, H, I)) return -1;
    for (int64_t i = 0; i < T * H; i++) b->x[i] += out[i];
    return 0;
}
