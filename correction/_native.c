/* Fused CPU kernel of the off-policy correction pass (float32 in, float64 row statistics out).
 *
 * Why: the eager torch pass runs ~20 elementwise/reduction kernels per cache block; this loop
 * reads each input once per row and does all of them in one pass (see correction/_engine.py for
 * the formulas and correction/_native.py for how it is built and called).
 *
 * Per token t of a row (m = mask, 0 or 1):
 *   nl   = m*r - m*t            (or -(m*v) from a caller-given log-ratio v); −ℓ, 0 on padding
 *   nlc  = clamp(nl, ±BOUND)
 *   rho  = exp(−nlc)            (exp_neg_v below; exactly 1 on padding)
 *   em1  = rho − 1, k3 = em1 + nlc
 *   keep = [lo1 ≤ nl ≤ hi1] · [|nl| ≤ k2b] · [k3 ≤ k3u] · m   (disabled rules pass ±inf bounds)
 *   w    = min(rho, C) · keep
 * Per row (float64, or exact int counts): Σnl, Σm·r, Σm, Σem1, Σk3, Σnl², min/max nl (0 joins when
 * the row has padding), kept count per token rule and of their AND. Per call (accumulated into
 * `sums` across calls): Σw, Σw², #(rho > C), Σem1², max/min of min(rho, C) over valid tokens
 * (before RS, as in the torch path).
 *
 * Vectorized explicitly with GCC/Clang vector extensions (see below), built without -ffast-math:
 * IEEE rounding is kept (GCC may contract a*b + c into an FMA, which only removes a rounding).
 * Row sums are float32 partials over FLUSH vector steps (16 values per lane), then float64.
 *
 * Return value: 0 ok; 1 a non-finite value was read (at a response token, or NaN/inf in padding,
 * where m*x is NaN too) or Σnl overflowed; 2 a mask value is neither 0 nor 1. On a nonzero return
 * the outputs are partial and the caller recomputes with the torch path.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define BOUND 20.0f /* LOG_RATIO_BOUND of correction/_common.py */

enum {
    S_NEG_SUM, S_ROLLOUT_SUM, S_SEQ_LEN, S_EM1_SUM, S_K3_SUM, S_K2X2_SUM, S_NEG_MIN, S_NEG_MAX,
    S_KEPT_K1, S_KEPT_K2, S_KEPT_K3, S_KEPT_TOKEN, N_STATS
};
enum { T_W_SUM, T_W_SQ, T_N_TRUNC, T_EM1_SQ, T_W_MAX, T_W_MIN, N_SUMS };
enum { P_C, P_K1_LO, P_K1_HI, P_K2_BOUND, P_K3_UPPER, N_PARAMS };

int agentrl_correction_abi(void) { return 1000 * N_STATS + 100 * N_SUMS + N_PARAMS; }

/* The loop below is written with GCC/Clang vector extensions (8 float lanes: one AVX register,
 * two SSE/NEON registers elsewhere): GCC does not vectorize a loop with this many mixed-type
 * reductions on its own without -ffast-math, and explicit lanes keep IEEE semantics. */
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef double vd __attribute__((vector_size(32)));
#define W 8
#define FLUSH 16 /* vector iterations per float partial sum (128 tokens) before it joins a double */

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }
#if defined(__AVX__) && defined(__GNUC__) && !defined(__clang__)
/* one instruction each; same results as the generic versions (minps(a, b) = a < b ? a : b) */
static inline vf sel(vi m, vf a, vf b) { return __builtin_ia32_blendvps256(b, a, (vf)m); }
static inline vf vmin(vf a, vf b) { return __builtin_ia32_minps256(a, b); }
static inline vf vmax(vf a, vf b) { return __builtin_ia32_maxps256(a, b); }
#else
static inline vf sel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
static inline vf vmin(vf a, vf b) { return sel(a < b, a, b); }
static inline vf vmax(vf a, vf b) { return sel(a > b, a, b); }
#endif
static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x}; }
static inline vd widen_sum(vf x) { /* the 8 lanes as 4 doubles (pairs added exactly in double) */
    vd lo = {x[0], x[1], x[2], x[3]};
    vd hi = {x[4], x[5], x[6], x[7]};
    return lo + hi;
}
static inline double hsum_d(vd x) { return (x[0] + x[1]) + (x[2] + x[3]); }

/* exp(−x) for |x| ≤ BOUND on 8 float32 lanes. Range reduction −x = n·ln2 + r (|r| ≤ ln2/2,
 * Cody–Waite split of ln2 so n·LN2_HI is exact), Cephes' degree-7 minimax polynomial for e^r, and
 * 2^n built from its bits (n ∈ [−29, 29]: always a normal float). Branch-free.
 * Relative error vs float64 exp, measured over every float32 in [−20, 20]: ≤ 8.4e-8 (< 1 ulp);
 * the unit test asserts ≤ 2e-7. Exactly 1 at x = 0. */
static inline vf exp_neg_v(vf x) {
    const vf magic = splat(12582912.0f);
    vf y = -x;
    vf t = y * splat(1.44269504088896341f) + magic;
    vf n = t - magic;
    vi ni = (vi)t - 0x4B400000;
    vf r = y - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * (r * r) + r + splat(1.0f);
    return p * (vf)((ni + 127) << 23);
}

/* out[i] = exp(−x[i]) with x clamped to ±BOUND, by the kernel's own exp_neg_v: exposes it to the
 * accuracy test. */
void agentrl_exp_neg(const float *x, float *out, int64_t n) {
    const vf bound = splat(BOUND);
    for (int64_t i = 0; i < n; i += W) {
        float buf[W] = {0};
        int64_t rem = n - i < W ? n - i : W;
        memcpy(buf, x + i, sizeof(float) * (size_t)rem);
        vf v = load(buf);
        v = vmin(vmax(v, -bound), bound);
        store(buf, exp_neg_v(v));
        memcpy(out + i, buf, sizeof(float) * (size_t)rem);
    }
}

enum { A_NEG, A_RO, A_EM1, A_K3, A_K2, A_W, A_WSQ, A_EM1SQ, N_ACC };

/* One row. mode 0: nl from train/rollout; 1: from log_ratio, no rollout; 2: log_ratio + rollout. */
static inline __attribute__((always_inline)) int row_kernel(
    const int mode, int64_t T, const float *restrict tr, const float *restrict ro,
    const float *restrict lr, const float *restrict mk, const float *params,
    float *restrict w_out, float *restrict k_out, double *stats, int64_t stride, double *sums) {
    const vf C = splat(params[P_C]), lo1 = splat(params[P_K1_LO]), hi1 = splat(params[P_K1_HI]);
    const vf k2b = splat(params[P_K2_BOUND]), k3u = splat(params[P_K3_UPPER]);
    const vf zero = splat(0.0f), one = splat(1.0f), bound = splat(BOUND);
    const vf inf = splat(INFINITY);
    vd total[N_ACC];
    vf part[N_ACC];
    for (int a = 0; a < N_ACC; ++a) {
        total[a] = (vd){0, 0, 0, 0};
        part[a] = zero;
    }
    vf neg_min = inf, neg_max = -inf, w_max = -inf, w_min = inf;
    vi seq_len = {0}, kept1 = {0}, kept2 = {0}, kept3 = {0}, kept = {0}, n_trunc = {0};
    vi bad_mask = {0};
    float tail[4][W];
    int since_flush = 0;
    for (int64_t i = 0; i < T; i += W) {
        int64_t rem = T - i;
        vf m, t = zero, r = zero, v = zero;
        if (rem >= W) {
            m = load(mk + i);
            if (mode == 0) t = load(tr + i);
            if (mode != 1 && mode != 0) r = load(ro + i);
            if (mode == 0) r = load(ro + i);
            if (mode != 0) v = load(lr + i);
        } else { /* the row's last partial vector: pad lanes with m = 0 and values 0 */
            memset(tail, 0, sizeof tail);
            for (int64_t l = 0; l < rem; ++l) {
                tail[0][l] = mk[i + l];
                if (mode == 0) tail[1][l] = tr[i + l];
                if (mode != 1) tail[2][l] = ro[i + l];
                if (mode != 0) tail[3][l] = lr[i + l];
            }
            m = load(tail[0]);
            t = load(tail[1]);
            r = load(tail[2]);
            v = load(tail[3]);
        }
        vf rm = mode == 1 ? zero : m * r;
        vf nl = mode == 0 ? rm - t * m : -(v * m);
        vi valid = m != zero;
        bad_mask |= valid & (m != one);
        vf nlc = vmin(vmax(nl, -bound), bound);
        vf rho = exp_neg_v(nlc);
        vf em1 = rho - one;
        vf k3 = em1 + nlc;
        vi ok1 = (nl >= lo1) & (nl <= hi1);
        vi ok2 = (vf)((vi)nl & 0x7fffffff) <= k2b;
        vi ok3 = k3 <= k3u;
        vi ok = ok1 & ok2 & ok3 & valid;
        vf wc = vmin(rho, C);
        vf w = sel(ok, wc, zero);
        vf kf = sel(ok, one, zero);
        vf wv = sel(valid, wc * m, zero); /* min(rho, C)·m before RS: the IS statistics */
        if (rem >= W) {
            store(w_out + i, w);
            store(k_out + i, kf);
        } else {
            for (int64_t l = 0; l < rem; ++l) {
                w_out[i + l] = w[l];
                k_out[i + l] = kf[l];
            }
        }
        part[A_NEG] += nl;
        part[A_RO] += rm;
        part[A_EM1] += em1;
        part[A_K3] += k3;
        part[A_K2] += nl * nl;
        part[A_W] += wv;
        part[A_WSQ] += wv * wv;
        part[A_EM1SQ] += em1 * em1;
        seq_len -= valid; /* masks are −1 where true */
        kept1 -= ok1 & valid;
        kept2 -= ok2 & valid;
        kept3 -= ok3 & valid;
        kept -= ok;
        n_trunc -= valid & (rho > C);
        neg_min = vmin(neg_min, sel(valid, nl, inf));
        neg_max = vmax(neg_max, sel(valid, nl, -inf));
        w_min = vmin(w_min, sel(valid, wc, inf));
        w_max = vmax(w_max, sel(valid, wc, -inf));
        if (++since_flush == FLUSH || rem <= W) {
            for (int a = 0; a < N_ACC; ++a) {
                total[a] += widen_sum(part[a]);
                part[a] = zero;
            }
            since_flush = 0;
        }
    }
    double acc[N_ACC];
    for (int a = 0; a < N_ACC; ++a) acc[a] = hsum_d(total[a]);
    int64_t n_valid = 0, n1 = 0, n2 = 0, n3 = 0, nk = 0, ntr = 0;
    float lo = INFINITY, hi = -INFINITY, wlo = INFINITY, whi = -INFINITY;
    int bad = 0;
    for (int l = 0; l < W; ++l) {
        n_valid += seq_len[l];
        n1 += kept1[l];
        n2 += kept2[l];
        n3 += kept3[l];
        nk += kept[l];
        ntr += n_trunc[l];
        lo = neg_min[l] < lo ? neg_min[l] : lo;
        hi = neg_max[l] > hi ? neg_max[l] : hi;
        wlo = w_min[l] < wlo ? w_min[l] : wlo;
        whi = w_max[l] > whi ? w_max[l] : whi;
        bad |= bad_mask[l];
    }
    if (n_valid < T) { /* padding holds nl = 0, which the torch path's row min/max include */
        lo = lo < 0.0f ? lo : 0.0f;
        hi = hi > 0.0f ? hi : 0.0f;
    }
    if (n_valid == 0) lo = hi = 0.0f;
    stats[S_NEG_SUM * stride] = acc[A_NEG];
    stats[S_ROLLOUT_SUM * stride] = acc[A_RO];
    stats[S_SEQ_LEN * stride] = (double)n_valid;
    stats[S_EM1_SUM * stride] = acc[A_EM1];
    stats[S_K3_SUM * stride] = acc[A_K3];
    stats[S_K2X2_SUM * stride] = acc[A_K2];
    stats[S_NEG_MIN * stride] = lo;
    stats[S_NEG_MAX * stride] = hi;
    stats[S_KEPT_K1 * stride] = (double)n1;
    stats[S_KEPT_K2 * stride] = (double)n2;
    stats[S_KEPT_K3 * stride] = (double)n3;
    stats[S_KEPT_TOKEN * stride] = (double)nk;
    sums[T_W_SUM] += acc[A_W];
    sums[T_W_SQ] += acc[A_WSQ];
    sums[T_N_TRUNC] += (double)ntr;
    sums[T_EM1_SQ] += acc[A_EM1SQ];
    if (n_valid) {
        sums[T_W_MAX] = whi > sums[T_W_MAX] ? whi : sums[T_W_MAX];
        sums[T_W_MIN] = wlo < sums[T_W_MIN] ? wlo : sums[T_W_MIN];
    }
    if (bad) return 2;
    if (!isfinite(acc[A_NEG]) || !isfinite(acc[A_RO])) return 1;
    return 0;
}

/* Rows [0, n_rows) of [n_rows, T] contiguous float32 inputs. `log_ratio` non-NULL: ℓ is given
 * (train ignored, rollout optional, for Σm·r); else ℓ = train − rollout. `weights`/`keep` may be
 * NULL (not wanted). `stats` is a [N_STATS, stride] float64 array whose columns 0..n_rows−1 are
 * written; `sums` ([N_SUMS]) is accumulated into (initialize W_MAX to −inf and W_MIN to +inf).
 * Returns 0, or the first nonzero row code (see the file comment). */
int agentrl_correction_rows(int64_t n_rows, int64_t T, const float *train, const float *rollout,
                            const float *log_ratio, const float *mask, const float *params,
                            float *weights, float *keep, double *stats, int64_t stride,
                            double *sums) {
    float *scratch = NULL;
    if (!weights || !keep) {
        scratch = (float *)malloc(sizeof(float) * (size_t)(2 * T + 1));
        if (!scratch) return 3;
    }
    int code = 0;
    for (int64_t b = 0; b < n_rows && !code; ++b) {
        int64_t off = b * T;
        float *w = weights ? weights + off : scratch;
        float *k = keep ? keep + off : scratch + T;
        double *st = stats + b;
        if (!log_ratio)
            code = row_kernel(0, T, train + off, rollout + off, NULL, mask + off, params, w, k,
                              st, stride, sums);
        else if (!rollout)
            code = row_kernel(1, T, NULL, NULL, log_ratio + off, mask + off, params, w, k, st,
                              stride, sums);
        else
            code = row_kernel(2, T, NULL, rollout + off, log_ratio + off, mask + off, params, w,
                              k, st, stride, sums);
    }
    free(scratch);
    return code;
}
