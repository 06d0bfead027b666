/* The compiled frame codec of the file log (agentlog.events.log._framecodec).
 *
 * The hot loops of agentlog.events.log.scan and .writer, with the same
 * behaviour as their pure-Python versions (agentlog.events.log.framecodec selects
 * one; the differential tests hold them to identical results):
 *
 *   scan()          walk the frames wholly inside a read buffer: bound the
 *                   lengths, check the masked CRC32C, the session-id length,
 *                   the LSN sequence and the session id's UTF-8, and stop at
 *                   the first bad frame with the Python scanner's reason;
 *   scan_mapped()   the same over a memory-mapped segment, guarded against
 *                   the file shrinking under the mapping (SIGBUS), and its
 *                   compressed batches (libzstd, dlopen: mapped_batch());
 *   MappedScan      scan_mapped() with the walk (bounds, CRC, LSNs) in a
 *                   second thread that holds no GIL, ahead of the caller,
 *                   who builds the frames it has checked (take()); the walk
 *                   also decompresses compressed batches (libzstd, dlopen);
 *   scan_batch()    the frames of a decompressed batch, with its place;
 *   encode_frame()  one frame (header, session id, payload, masked CRC);
 *   encode_batch()  many frames into one contiguous buffer;
 *   encode_columns() the same, from a batch held as columns (lists).
 *
 * CRC32C: no table here. The SSE4.2 / ARMv8 CRC32C instruction when the CPU
 * has it (compiled with a target attribute, chosen at import by CPU
 * detection), else a call into the google_crc32c package (the C library the
 * pure-Python path uses too). set_crc_backend("python") forces that fallback
 * so that tests cover it on any machine.
 *
 * Layouts (little-endian; see format.py):
 *   frame  = u32 masked crc | u32 length | u8 type | u64 lsn | u64 seq | i64 ts
 *            | u8 flags | u16 sid length | sid | payload
 *   crc covers everything after the crc field; length counts from the lsn on.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the frame codec reads little-endian fields in place: little-endian hosts only (the pure-Python path covers others)"
#endif

#if defined(__x86_64__) || defined(__i386__)
#define FC_X86 1
#include <cpuid.h>
#include <nmmintrin.h>
#include <wmmintrin.h>
#include <immintrin.h>
#elif defined(__aarch64__)
#define FC_ARM 1
#include <sys/auxv.h>
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7)
#endif
#endif

#define FRAME_PREFIX 9 /* crc + length + type */
#define ENV_SIZE 27    /* lsn, seq, ts, flags, sid length */
#define SID_AT (FRAME_PREFIX + ENV_SIZE)
#define TYPE_RECORD 1
#define MASK_DELTA 0xA282EAD8u

/* ------------------------------------------------------------------ CRC32C */

enum { BACKEND_HW = 1, BACKEND_PY = 2 };
static int crc_backend = BACKEND_PY;
/* Fold with VPCLMULQDQ where the CPU can: on its widest registers (FOLD_BEST), on 256-bit ones
   (FOLD_256: set_crc_backend("hardware-fold256"), for tests and A/Bs), or not (FOLD_OFF:
   "hardware-streams"). */
enum { FOLD_OFF, FOLD_BEST, FOLD_256 };
static int crc_fold = FOLD_BEST;
static int hw_available = 0;
static PyObject *py_extend = NULL; /* google_crc32c.extend */

#if defined(FC_X86)
static int have_clmul = 0;

__attribute__((target("sse4.2"))) static uint64_t crc_one(uint64_t c, const uint8_t *p, size_t n) {
    /* One stream: c is the raw register (already inverted by the caller). */
    while (n >= 8) {
        uint64_t a;
        memcpy(&a, p, 8);
        c = _mm_crc32_u64(c, a);
        p += 8;
        n -= 8;
    }
    while (n--) c = _mm_crc32_u8((uint32_t)c, *p++);
    return c;
}

/* Three streams: the instruction has a latency of 3 cycles and a throughput
   of 1, so three independent streams run about 3x faster than one. Each
   block of 3*K bytes is three CRCs, combined by shifting the first two over
   the bytes after them: c * x^(8*nbytes) mod P is one carry-less multiply by
   a constant and one CRC instruction (no table). */
#define K_BIG 4096
#define K_SMALL 256
static uint32_t k_big[2], k_small[2]; /* x^(8*2K-33), x^(8*K-33) mod P, reflected */

__attribute__((target("sse4.2"))) static uint32_t xpow_mod(unsigned int e) {
    /* x^e mod P in the reflected representation: x^(e % 32), then times x^32
       (one CRC instruction over four zero bytes) e / 32 times. Init only. */
    uint32_t r = 0x80000000u >> (e % 32);
    for (unsigned int i = 0; i < e / 32; i++) r = _mm_crc32_u32(r, 0);
    return r;
}

__attribute__((target("sse4.2,pclmul"))) static inline uint32_t shift_by(uint32_t c, uint32_t k) {
    /* c * x^(8n) mod P for k = x^(8n-33) mod P: the carry-less product is
       c*k*x (reflected), and the CRC of it as a 64-bit message multiplies by x^32. */
    __m128i prod = _mm_clmulepi64_si128(_mm_cvtsi32_si128((int)c), _mm_cvtsi32_si128((int)k), 0);
    return _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(prod));
}

__attribute__((target("sse4.2,pclmul"))) static uint64_t crc_three(uint64_t c, const uint8_t **pp, size_t *pn, size_t K,
                                                                    const uint32_t *k) {
    const uint8_t *p = *pp;
    size_t n = *pn;
    while (n >= 3 * K) {
        uint64_t c0 = c, c1 = 0, c2 = 0;
        for (size_t i = 0; i < K; i += 8) {
            uint64_t a, b, d;
            memcpy(&a, p + i, 8);
            memcpy(&b, p + K + i, 8);
            memcpy(&d, p + 2 * K + i, 8);
            c0 = _mm_crc32_u64(c0, a);
            c1 = _mm_crc32_u64(c1, b);
            c2 = _mm_crc32_u64(c2, d);
        }
        c = shift_by((uint32_t)c0, k[0]) ^ shift_by((uint32_t)c1, k[1]) ^ (uint32_t)c2;
        p += 3 * K;
        n -= 3 * K;
    }
    *pp = p;
    *pn = n;
    return c;
}

/* Folding: with VPCLMULQDQ on 512-bit registers (AVX-512), four registers of
   four 128-bit lanes each take 256 bytes a step, several times the CRC
   instruction's rate (which stays the instruction of choice for short
   inputs and for the last bytes). A lane A, the polynomial of 128 message
   bits, is "folded" F bits forward: A * x^F mod P is congruent to
   A_first * x^(F+64) + A_second * x^F, each a 64 x 32-bit carry-less product
   of at most 96 bits, added to the lane F bits on. In the reflected order a
   lane's first 64 message bits are its low quadword, and the product of two
   reflected operands comes out multiplied by x^33 (see shift_by), so the
   constants are x^(F+31) and x^(F-33) mod P. The 128 bits left at the end go
   through the CRC instruction, which multiplies them by x^32 as a CRC does. */
typedef struct {
    uint32_t first, second; /* multiply a lane's first (low) and second (high) quadword */
} fold_k;
static fold_k fold_2048, fold_512, fold_384, fold_256, fold_128;
static int have_fold512 = 0, have_fold256 = 0;
#define FOLD_MIN 512 /* bytes: below it, setting up the registers costs more than folding saves */

static fold_k fold_constants(unsigned int bits) {
    fold_k k = {xpow_mod(bits + 31), xpow_mod(bits - 33)};
    return k;
}

#define FOLD_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))

FOLD_TARGET static inline __m512i fold_lanes(fold_k k) {
    return _mm512_set_epi64(k.second, k.first, k.second, k.first, k.second, k.first, k.second, k.first);
}

/* x folded forward by k's distance onto d: both of x's products and d in one three-way XOR. */
FOLD_TARGET static inline __m512i fold_onto(__m512i x, __m512i k, __m512i d) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11), d, 0x96);
}

/* SSE encodings only: both fold kernels call it, the 256-bit one on CPUs without AVX-512, so it must
   not be compiled for the 512-bit target (where the compiler may use EVEX forms). */
__attribute__((target("pclmul,sse4.2"))) static inline __m128i fold_lane(__m128i x, fold_k k) {
    __m128i kk = _mm_set_epi64x(k.second, k.first);
    return _mm_xor_si128(_mm_clmulepi64_si128(x, kk, 0x00), _mm_clmulepi64_si128(x, kk, 0x11));
}

/* The CRC register of a folded 128-bit lane: its 16 bytes through the instruction from a zero register. */
__attribute__((target("sse4.2"))) static inline uint64_t lane_crc(__m128i r) {
    uint64_t out = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(r));
    return _mm_crc32_u64(out, (uint64_t)_mm_cvtsi128_si64(_mm_unpackhi_epi64(r, r)));
}

/* The register c (not inverted here) continued over the whole 64-byte steps of
   p[0:*pn] (at least FOLD_MIN bytes); *pp and *pn move past them. */
FOLD_TARGET static uint64_t crc_fold512(uint64_t c, const uint8_t **pp, size_t *pn) {
    const uint8_t *p = *pp;
    size_t n = *pn;
    /* The register's 32 bits are added to the message's first 32, as the CRC instruction adds them. */
    __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, (long long)(uint32_t)c));
    __m512i x1 = _mm512_loadu_si512(p + 64), x2 = _mm512_loadu_si512(p + 128), x3 = _mm512_loadu_si512(p + 192);
    p += 256;
    n -= 256;
    const __m512i k4 = fold_lanes(fold_2048), k1 = fold_lanes(fold_512);
    while (n >= 256) {
        x0 = fold_onto(x0, k4, _mm512_loadu_si512(p));
        x1 = fold_onto(x1, k4, _mm512_loadu_si512(p + 64));
        x2 = fold_onto(x2, k4, _mm512_loadu_si512(p + 128));
        x3 = fold_onto(x3, k4, _mm512_loadu_si512(p + 192));
        p += 256;
        n -= 256;
    }
    x1 = fold_onto(x0, k1, x1);
    x2 = fold_onto(x1, k1, x2);
    x3 = fold_onto(x2, k1, x3);
    while (n >= 64) {
        x3 = fold_onto(x3, k1, _mm512_loadu_si512(p));
        p += 64;
        n -= 64;
    }
    /* The four lanes onto the last. */
    __m128i r = _mm512_extracti32x4_epi32(x3, 3);
    r = _mm_xor_si128(r, fold_lane(_mm512_extracti32x4_epi32(x3, 0), fold_384));
    r = _mm_xor_si128(r, fold_lane(_mm512_extracti32x4_epi32(x3, 1), fold_256));
    r = _mm_xor_si128(r, fold_lane(_mm512_extracti32x4_epi32(x3, 2), fold_128));
    *pp = p;
    *pn = n;
    return lane_crc(r);
}

#define FOLD256_TARGET __attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2")))

FOLD256_TARGET static inline __m256i fold_lanes256(fold_k k) {
    return _mm256_set_epi64x(k.second, k.first, k.second, k.first);
}

FOLD256_TARGET static inline __m256i fold_onto256(__m256i x, __m256i k, __m256i d) {
    return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00), _mm256_clmulepi64_epi128(x, k, 0x11)), d);
}

/* crc_fold512 on 256-bit registers (AVX2 with VPCLMULQDQ: AMD Zen 3, Intel Alder Lake and later
   client CPUs, which have no AVX-512): eight registers of two lanes, still 256 bytes a step, then
   32-byte steps; the same constants by distance. */
FOLD256_TARGET static uint64_t crc_fold256(uint64_t c, const uint8_t **pp, size_t *pn) {
    const uint8_t *p = *pp;
    size_t n = *pn;
    __m256i x[8];
    x[0] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p), _mm256_set_epi64x(0, 0, 0, (long long)(uint32_t)c));
    for (int i = 1; i < 8; i++) x[i] = _mm256_loadu_si256((const __m256i *)(p + 32 * i));
    p += 256;
    n -= 256;
    const __m256i k8 = fold_lanes256(fold_2048), k1 = fold_lanes256(fold_256);
    while (n >= 256) {
        for (int i = 0; i < 8; i++) x[i] = fold_onto256(x[i], k8, _mm256_loadu_si256((const __m256i *)(p + 32 * i)));
        p += 256;
        n -= 256;
    }
    for (int i = 1; i < 8; i++) x[i] = fold_onto256(x[i - 1], k1, x[i]);
    __m256i last = x[7];
    while (n >= 32) {
        last = fold_onto256(last, k1, _mm256_loadu_si256((const __m256i *)p));
        p += 32;
        n -= 32;
    }
    *pp = p;
    *pn = n;
    return lane_crc(_mm_xor_si128(_mm256_extracti128_si256(last, 1), fold_lane(_mm256_castsi256_si128(last), fold_128)));
}

/* VPCLMULQDQ and the register width's feature (``leaf7_ebx_bit``: AVX2, AVX-512F) in the CPU, and
   that register state (``xcr0_mask``) enabled by the OS (XCR0); ``leaf1_ecx``: what CPUID leaf 1
   said (detect_hw asked it already). */
static int detect_fold(unsigned int leaf1_ecx, unsigned int leaf7_ebx_bit, unsigned int xcr0_mask) {
    unsigned int a, b, c, d;
    if (!(leaf1_ecx & bit_OSXSAVE)) return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b & leaf7_ebx_bit) || !(c & (1u << 10))) return 0;
    unsigned int xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    return (xlo & xcr0_mask) == xcr0_mask;
}

static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c = crc;
    if (crc_fold != FOLD_OFF && n >= FOLD_MIN) {
        if (have_fold512 && crc_fold == FOLD_BEST)
            c = crc_fold512(c, &p, &n);
        else if (have_fold256)
            c = crc_fold256(c, &p, &n);
    }
    if (have_clmul) {
        c = crc_three(c, &p, &n, K_BIG, k_big);
        c = crc_three(c, &p, &n, K_SMALL, k_small);
    }
    return (uint32_t)crc_one(c, p, n);
}

static int detect_hw(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    if (!(c & bit_SSE4_2)) return 0;
    if (c & bit_PCLMUL) {
        k_big[0] = xpow_mod(8 * 2 * K_BIG - 33);
        k_big[1] = xpow_mod(8 * K_BIG - 33);
        k_small[0] = xpow_mod(8 * 2 * K_SMALL - 33);
        k_small[1] = xpow_mod(8 * K_SMALL - 33);
        have_clmul = 1;
        have_fold512 = detect_fold(c, bit_AVX512F, 0xE6); /* SSE, AVX, opmask, upper ZMM0-15, ZMM16-31 state */
        have_fold256 = detect_fold(c, bit_AVX2, 0x6);      /* SSE and AVX state */
        if (have_fold512 || have_fold256) {
            fold_2048 = fold_constants(2048);
            fold_512 = fold_constants(512);
            fold_384 = fold_constants(384);
            fold_256 = fold_constants(256);
            fold_128 = fold_constants(128);
        }
    }
    return 1;
}
#elif defined(FC_ARM)
#include <arm_acle.h>
__attribute__((target("+crc"))) static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) {
        crc = __crc32cb(crc, *p++);
        n--;
    }
    while (n >= 8) {
        uint64_t a;
        memcpy(&a, p, 8);
        crc = __crc32cd(crc, a);
        p += 8;
        n -= 8;
    }
    while (n--) crc = __crc32cb(crc, *p++);
    return crc;
}

static int detect_hw(void) { return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0; }
#else
static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n) {
    (void)p;
    (void)n;
    return crc;
}
static int detect_hw(void) { return 0; }
#endif

#if defined(FC_X86)
#define FOLD256_AVAILABLE have_fold256
#else
#define FOLD256_AVAILABLE 0
#endif

/* CRC32C of p[0:n] continued from the finished value ``crc`` (google_crc32c.extend
   semantics). Returns 0 and sets *out, or -1 with a Python exception set. */
static int crc_extend(uint32_t crc, const uint8_t *p, size_t n, uint32_t *out) {
    if (crc_backend == BACKEND_HW) {
        *out = ~crc_hw(~crc, p, n);
        return 0;
    }
    /* google_crc32c.extend takes bytes only (not a memoryview): a copy, on the slow path only. */
    PyObject *view = PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)n);
    if (view == NULL) return -1;
    PyObject *res = PyObject_CallFunction(py_extend, "kO", (unsigned long)crc, view);
    Py_DECREF(view);
    if (res == NULL) return -1;
    unsigned long v = PyLong_AsUnsignedLong(res);
    Py_DECREF(res);
    if (v == (unsigned long)-1 && PyErr_Occurred()) return -1;
    *out = (uint32_t)v;
    return 0;
}

static inline uint32_t mask_crc(uint32_t c) { return ((c >> 15) | (c << 17)) + MASK_DELTA; }

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static inline uint64_t rd64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* ------------------------------------------------------------------ scanning */

enum { SCAN_NEED = 0, SCAN_LIMIT = 1, SCAN_EOF = 2, SCAN_BAD = 3, SCAN_MORE = 4 };

typedef struct {
    /* inputs */
    const uint8_t *buf;
    Py_ssize_t buflen;
    unsigned long long base; /* file offset of buf[0] */
    unsigned long long size; /* file size */
    unsigned long long cap;
    int has_limit;
    unsigned long long limit;
    /* state */
    Py_ssize_t rel;
    unsigned long long expected;
    PyObject *reason; /* set with SCAN_BAD */
} scan_state;

struct batch_buf;

typedef struct {
    Py_ssize_t rel, end;
    unsigned long long lsn, seq;
    long long ts;
    unsigned int flags;
    const uint8_t *sid;
    Py_ssize_t sidlen;
    /* A frame of a compressed batch that MappedScan's walk decompressed: the
       batch's buffer (rel and end are within it), the batch's own place in the
       segment, and whether this is its last frame. NULL for a segment's frame. */
    struct batch_buf *bb;
    Py_ssize_t batch_rel, batch_end;
    int last_of_batch;
} frame_info;

/* Why scan_core() stopped at a bad frame, as plain numbers: the reason's
   text is made from it with the GIL held (bad_reason), so that a scan that
   runs without the GIL (MappedScan's thread) can stop at a bad frame too. */
enum { BAD_ZERO = 1, BAD_TYPE, BAD_LENGTH, BAD_PAST_EOF, BAD_CRC, BAD_SIDLEN, BAD_LSN };
typedef struct {
    int kind;
    unsigned long long a, b; /* the numbers the reason names */
} bad_info;

/* The text of a bad frame's reason (the Python scanner's words), or NULL with an error set. */
static PyObject *bad_reason(const bad_info *bad, unsigned long long cap, unsigned long long size) {
    switch (bad->kind) {
    case BAD_ZERO:
        return PyUnicode_FromFormat("zero-filled (expected a record, type %d)", TYPE_RECORD);
    case BAD_TYPE:
        return PyUnicode_FromFormat("type byte %u (expected a record, type %d)", (unsigned int)bad->a, TYPE_RECORD);
    case BAD_LENGTH:
        return PyUnicode_FromFormat("frame length %lu out of range (expected %d..%llu bytes)", (unsigned long)bad->a, ENV_SIZE, cap);
    case BAD_PAST_EOF:
        return PyUnicode_FromFormat("frame of %llu bytes runs past end of file (%llu)", bad->a, size);
    case BAD_CRC:
        return PyUnicode_FromString("CRC mismatch");
    case BAD_SIDLEN:
        return PyUnicode_FromFormat("session-id length %u exceeds frame length %lu", (unsigned int)bad->a, (unsigned long)bad->b);
    case BAD_LSN:
        return PyUnicode_FromFormat("lsn %llu, expected %llu", bad->a, bad->b);
    }
    PyErr_Format(PyExc_SystemError, "_framecodec: unknown bad-frame kind %d", bad->kind);
    return NULL;
}

/* One step: returns -1 (Python error, only from the google_crc32c fallback,
   never with ``hw_only``), or a SCAN_* code: SCAN_MORE with *fi filled (one
   valid frame; the caller moves the state past it), SCAN_BAD with *bad
   filled. With ``hw_only`` it calls no Python and may run without the GIL
   (the caller checked that the hardware CRC is in use). */
static inline int scan_core(const scan_state *st, frame_info *fi, bad_info *bad, int hw_only) {
    if (st->has_limit && st->expected >= st->limit) return SCAN_LIMIT;
    unsigned long long off = st->base + (unsigned long long)st->rel;
    if (off >= st->size) return SCAN_EOF;
    Py_ssize_t rel = st->rel;
    if (rel + FRAME_PREFIX > st->buflen) return SCAN_NEED;
    const uint8_t *f = st->buf + rel;
    uint32_t crc = rd32(f);
    uint32_t length = rd32(f + 4);
    unsigned int typ = f[8];
    if (typ != TYPE_RECORD) {
        int zero = 0;
        if (typ == 0) {
            Py_ssize_t k = st->buflen - rel < 64 ? st->buflen - rel : 64;
            zero = 1;
            for (Py_ssize_t i = 0; i < k; i++)
                if (f[i]) {
                    zero = 0;
                    break;
                }
        }
        bad->kind = zero ? BAD_ZERO : BAD_TYPE;
        bad->a = typ;
        return SCAN_BAD;
    }
    if (length < ENV_SIZE || (unsigned long long)length > st->cap) {
        bad->kind = BAD_LENGTH;
        bad->a = length;
        return SCAN_BAD;
    }
    unsigned long long end = off + FRAME_PREFIX + length;
    if (end > st->size) {
        bad->kind = BAD_PAST_EOF;
        bad->a = (unsigned long long)FRAME_PREFIX + length;
        return SCAN_BAD;
    }
    Py_ssize_t rend = rel + FRAME_PREFIX + (Py_ssize_t)length;
    if (rend > st->buflen) return SCAN_NEED;
    uint32_t c;
    if (hw_only)
        c = ~crc_hw(~0u, f + 4, (size_t)length + 5);
    else if (crc_extend(0, f + 4, (size_t)length + 5, &c) < 0)
        return -1;
    if (mask_crc(c) != crc) {
        bad->kind = BAD_CRC;
        return SCAN_BAD;
    }
    unsigned long long lsn = rd64(f + 9);
    unsigned int sidlen = rd16(f + 34);
    if (ENV_SIZE + sidlen > length) {
        bad->kind = BAD_SIDLEN;
        bad->a = sidlen;
        bad->b = length;
        return SCAN_BAD;
    }
    if (lsn != st->expected) {
        bad->kind = BAD_LSN;
        bad->a = lsn;
        bad->b = st->expected;
        return SCAN_BAD;
    }
    fi->rel = rel;
    fi->end = rend;
    fi->lsn = lsn;
    fi->seq = rd64(f + 17);
    fi->ts = (long long)rd64(f + 25);
    fi->flags = f[33];
    fi->sid = f + SID_AT;
    fi->sidlen = sidlen;
    fi->bb = NULL;
    return SCAN_MORE;
}

/* scan_core() with the GIL held: a bad frame's reason is set in st->reason. */
static int scan_step(scan_state *st, frame_info *fi) {
    bad_info bad;
    int code = scan_core(st, fi, &bad, 0);
    if (code == SCAN_BAD) {
        st->reason = bad_reason(&bad, st->cap, st->size);
        if (st->reason == NULL) return -1;
    }
    return code;
}

/* A small cache of decoded session ids: consecutive records of a batch often
   share one, and equal ids then share one str object (as the Python scanner's
   cache does). */
#define SID_CACHE 64
typedef struct {
    PyObject *str[SID_CACHE];
    PyObject *raw[SID_CACHE]; /* bytes */
} sid_cache;

static void sid_cache_clear(sid_cache *c) {
    for (int i = 0; i < SID_CACHE; i++) {
        Py_CLEAR(c->str[i]);
        Py_CLEAR(c->raw[i]);
    }
}

/* New reference to the decoded id, NULL with UnicodeDecodeError (or another error) set. */
static PyObject *sid_decode(sid_cache *c, const uint8_t *p, Py_ssize_t n) {
    uint32_t h = 2166136261u;
    for (Py_ssize_t i = 0; i < n; i++) h = (h ^ p[i]) * 16777619u;
    int slot = (int)(h % SID_CACHE);
    PyObject *raw = c->raw[slot];
    if (raw != NULL && PyBytes_GET_SIZE(raw) == n && memcmp(PyBytes_AS_STRING(raw), p, (size_t)n) == 0) {
        Py_INCREF(c->str[slot]);
        return c->str[slot];
    }
    PyObject *s = PyUnicode_DecodeUTF8((const char *)p, n, "strict");
    if (s == NULL) return NULL;
    PyObject *b = PyBytes_FromStringAndSize((const char *)p, n);
    if (b == NULL) {
        Py_DECREF(s);
        return NULL;
    }
    Py_XSETREF(c->raw[slot], b);
    Py_INCREF(s);
    Py_XSETREF(c->str[slot], s);
    return s;
}

/* Returns the decoded id, NULL with no error set when it is not UTF-8 (the
   caller reports a bad frame), NULL with an error set otherwise. */
static PyObject *sid_or_bad(sid_cache *c, const frame_info *fi, scan_state *st) {
    PyObject *sid = sid_decode(c, fi->sid, fi->sidlen);
    if (sid == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
        st->reason = PyUnicode_FromString("session id is not UTF-8");
        if (st->reason == NULL) return NULL;
    }
    return sid;
}

/* The scanners build frames as instances of the caller's tuple subclass: -1 (TypeError naming ``who``) otherwise. */
static int check_frame_type(PyObject *ftype, const char *who) {
    if (PyType_Check(ftype) && PyType_IsSubtype((PyTypeObject *)ftype, &PyTuple_Type)) return 0;
    PyErr_Format(PyExc_TypeError, "%s: frame_type must be a tuple subclass", who);
    return -1;
}

static int parse_state(scan_state *st, Py_buffer *view, PyObject *limit_obj, Py_ssize_t rel, unsigned long long base,
                       unsigned long long size, unsigned long long expected, unsigned long long cap) {
    memset(st, 0, sizeof(*st));
    st->buf = (const uint8_t *)view->buf;
    st->buflen = view->len;
    st->base = base;
    st->size = size;
    st->cap = cap;
    st->rel = rel;
    st->expected = expected;
    if (limit_obj != Py_None) {
        st->has_limit = 1;
        st->limit = PyLong_AsUnsignedLongLong(limit_obj);
        if (st->limit == (unsigned long long)-1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
            PyErr_Clear();
            /* Negative: nothing is below it. Past 2**64: every LSN is below it. */
            PyObject *zero = PyLong_FromLong(0);
            if (zero == NULL) return -1;
            int negative = PyObject_RichCompareBool(limit_obj, zero, Py_LT);
            Py_DECREF(zero);
            if (negative < 0) return -1;
            if (negative)
                st->limit = 0;
            else
                st->has_limit = 0;
        }
    }
    if (rel < 0 || rel > view->len) {
        PyErr_Format(PyExc_ValueError, "scan: offset %zd is outside the %zd-byte buffer", rel, view->len);
        return -1;
    }
    return 0;
}

/* scan(buf, view, frame_type, rel, base, size, expected, limit, cap, max_frames)
   -> (frames, rel, expected, code, reason)

   Frames wholly inside ``buf`` (a bytes-like object whose first byte is at file
   offset ``base``), from ``rel`` on, each a ``frame_type`` (a tuple subclass:
   offset, end, lsn, session_seq, ts_ns, flags, session_id, payload) whose
   payload is a slice of ``view`` (a memoryview of buf: zero copy), or None when
   ``view`` is None (a walk that reads only the heads: recovery). code says
   why it stopped: 0 the next frame is not wholly in the buffer (``rel`` is
   where it starts), 1 ``limit`` reached, 2 end of file, 3 a bad frame at
   ``rel`` (``reason`` says why), 4 ``max_frames`` returned. */
/* The Frame (a ``tp`` of 8 items: offset, end, lsn, seq, ts, flags, sid, payload) of the
   valid frame ``fi``, its payload a slice of ``viewobj``, or None when ``viewobj`` is None
   (no payload asked for: a memoryview per frame is a quarter of a walk). Steals ``sid``, ``off`` and ``end``
   (either may be NULL after a failed allocation: then NULL is returned). NULL with an
   exception set on failure, everything given released. The one place every scanner
   builds its frames. */
static PyObject *make_frame(PyTypeObject *tp, PyObject *viewobj, const frame_info *fi, PyObject *sid, PyObject *off,
                            PyObject *end) {
    PyObject *payload = viewobj == Py_None ? Py_NewRef(Py_None) : PySequence_GetSlice(viewobj, fi->rel + SID_AT + fi->sidlen, fi->end);
    PyObject *fr = payload != NULL && off != NULL && end != NULL ? tp->tp_alloc(tp, 8) : NULL;
    if (fr == NULL) {
        Py_DECREF(sid);
        Py_XDECREF(payload);
        Py_XDECREF(off);
        Py_XDECREF(end);
        return NULL;
    }
    PyObject *vals[8] = {
        off, end, PyLong_FromUnsignedLongLong(fi->lsn), PyLong_FromUnsignedLongLong(fi->seq), PyLong_FromLongLong(fi->ts),
        PyLong_FromLong((long)fi->flags), sid, payload,
    };
    int bad = 0;
    for (int k = 0; k < 8; k++) {
        if (vals[k] == NULL) bad = 1;
        PyTuple_SET_ITEM(fr, k, vals[k]);
    }
    if (bad) {
        Py_DECREF(fr);
        return NULL;
    }
    return fr;
}

static PyObject *fc_scan(PyObject *self, PyObject *args) {
    PyObject *bufobj, *viewobj, *ftype, *limit_obj;
    Py_ssize_t rel, max_frames;
    unsigned long long base, size, expected, cap;
    if (!PyArg_ParseTuple(args, "OOOnKKKOKn:scan", &bufobj, &viewobj, &ftype, &rel, &base, &size, &expected, &limit_obj,
                          &cap, &max_frames))
        return NULL;
    if (check_frame_type(ftype, "scan") < 0) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(bufobj, &view, PyBUF_SIMPLE) < 0) return NULL;
    scan_state st;
    PyObject *frames = NULL, *result = NULL;
    sid_cache cache;
    memset(&cache, 0, sizeof(cache));
    int code = -1;
    if (parse_state(&st, &view, limit_obj, rel, base, size, expected, cap) < 0) goto done;
    frames = PyList_New(0);
    if (frames == NULL) goto done;
    PyTypeObject *tp = (PyTypeObject *)ftype;
    for (;;) {
        if (PyList_GET_SIZE(frames) >= max_frames) {
            code = SCAN_MORE;
            break;
        }
        frame_info fi;
        code = scan_step(&st, &fi);
        if (code < 0) goto done;
        if (code != SCAN_MORE) break;
        PyObject *sid = sid_or_bad(&cache, &fi, &st);
        if (sid == NULL) {
            if (st.reason == NULL) goto done;
            code = SCAN_BAD;
            break;
        }
        PyObject *fr = make_frame(tp, viewobj, &fi, sid, PyLong_FromUnsignedLongLong(st.base + (unsigned long long)fi.rel),
                                  PyLong_FromUnsignedLongLong(st.base + (unsigned long long)fi.end));
        if (fr == NULL) goto done;
        int rc = PyList_Append(frames, fr);
        Py_DECREF(fr);
        if (rc < 0) goto done;
        st.rel = fi.end;
        st.expected = fi.lsn + 1;
    }
    result = Py_BuildValue("(OnKiO)", frames, st.rel, st.expected, code, st.reason ? st.reason : Py_None);
done:
    Py_XDECREF(st.reason);
    Py_XDECREF(frames);
    sid_cache_clear(&cache);
    PyBuffer_Release(&view);
    return result;
}

/* ------------------------------------------------------------------ compressed batches, decompressed by the walk

   libzstd, loaded at import with dlopen (no build-time dependency: the
   zstandard package links its own copy privately, and most systems carry
   libzstd.so.1, which dpkg and systemd need). Without it, or with one older
   than 1.3, the walk leaves every compressed batch to the pread path, as
   before. Only the decompression is libzstd's; the layout, the checks and the
   error messages stay the Python reader's (batch_compression.read_batch):
   the walk takes a batch only when it is plainly valid, whole and below the
   scan's limit, and leaves anything else to that path, which reads it again
   and says what is wrong in its own words. */

#include <dlfcn.h>
#include <stdlib.h>

#define TYPE_BATCH 2
#define BATCH_HDR_SIZE 17 /* u64 first lsn | u32 count | u32 raw length | u8 codec */
#define BATCH_CODEC_ZSTD 1
#define BATCH_MAX_RECORDS 4096 /* format.BATCH_MAX_RECORDS: readers refuse more */
#define ZSTD_MAGIC 0xFD2FB528u /* a zstd frame (format 1.0); libzstd may also decode legacy frames, zstandard does not */
/* Decompressed bytes the walk keeps ahead of the reader, at most (one batch always may be: a
   record over 256 KiB is a batch alone, and a ring of them would otherwise hold gigabytes). */
#define HELD_BYTES_MAX (32ull << 20)

typedef struct ZSTD_DCtx_s ZSTD_DCtx;
static struct {
    ZSTD_DCtx *(*create)(void);
    size_t (*release)(ZSTD_DCtx *);
    size_t (*decompress)(ZSTD_DCtx *, void *, size_t, const void *, size_t);
    unsigned (*is_error)(size_t);
    unsigned long long (*content_size)(const void *, size_t);
    size_t (*frame_size)(const void *, size_t); /* the first frame's compressed size */
    unsigned version; /* 0: not loaded */
} zstd;

/* Load libzstd's few decompression entry points (their signatures are its stable API). */
static void zstd_load(void) {
    static const char *const names[] = {"libzstd.so.1", "libzstd.so", "libzstd.1.dylib", "libzstd.dylib", NULL};
    for (int i = 0; names[i] != NULL; i++) {
        void *h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (h == NULL) continue;
        unsigned (*version)(void) = (unsigned (*)(void))dlsym(h, "ZSTD_versionNumber");
        zstd.create = (ZSTD_DCtx * (*)(void)) dlsym(h, "ZSTD_createDCtx");
        zstd.release = (size_t(*)(ZSTD_DCtx *))dlsym(h, "ZSTD_freeDCtx");
        zstd.decompress = (size_t(*)(ZSTD_DCtx *, void *, size_t, const void *, size_t))dlsym(h, "ZSTD_decompressDCtx");
        zstd.is_error = (unsigned (*)(size_t))dlsym(h, "ZSTD_isError");
        zstd.content_size = (unsigned long long (*)(const void *, size_t))dlsym(h, "ZSTD_getFrameContentSize");
        zstd.frame_size = (size_t(*)(const void *, size_t))dlsym(h, "ZSTD_findFrameCompressedSize");
        if (version != NULL && zstd.create != NULL && zstd.release != NULL && zstd.decompress != NULL && zstd.is_error != NULL &&
            zstd.content_size != NULL && zstd.frame_size != NULL && version() >= 10300) {
            zstd.version = version();
            return; /* kept loaded for the life of the process */
        }
        dlclose(h);
    }
    memset(&zstd, 0, sizeof(zstd));
}

/* A batch the walk decompressed: its frames, in memory of its own (not
   Python's: the walk holds no GIL). The consumer wraps ``data`` in a
   BatchBytes the first time it hands out one of the batch's frames (``view``
   then holds a memoryview of it, and the payloads are slices of that) and
   releases the batch_buf with its last frame; mapped_stop() releases those
   whose last frame was never handed out. */
typedef struct batch_buf {
    uint8_t *data; /* malloc'd (not PyMem_Raw: with tracemalloc on, its hooks take the GIL); NULL once a BatchBytes owns it */
    Py_ssize_t len;
    PyObject *view;
} batch_buf;

/* Free a batch the walk made but did not note (no Python: any thread). */
static void batch_discard(batch_buf *bb) {
    free(bb->data);
    free(bb);
}

/* Release a noted batch (the GIL held): the payloads handed out keep their BatchBytes alive. */
static void batch_release(batch_buf *bb) {
    Py_XDECREF(bb->view);
    batch_discard(bb);
}

/* BatchBytes: read-only bytes-like memory that a decompressed batch's payloads view. */
typedef struct {
    PyObject_HEAD uint8_t *data;
    Py_ssize_t len;
} BatchBytes;

static int batch_bytes_getbuffer(BatchBytes *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->data, self->len, 1, flags);
}

static void batch_bytes_dealloc(BatchBytes *self) {
    free(self->data);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyBufferProcs batch_bytes_as_buffer = {.bf_getbuffer = (getbufferproc)batch_bytes_getbuffer};

static PyTypeObject BatchBytesType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "agentlog.events.log._framecodec.BatchBytes",
    .tp_basicsize = sizeof(BatchBytes),
    .tp_dealloc = (destructor)batch_bytes_dealloc,
    .tp_as_buffer = &batch_bytes_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The decompressed frames of one compressed batch (read-only; its payloads are views of it).",
};

/* The memoryview a batch's payloads slice, made with its first frame handed out (the GIL held). */
static PyObject *batch_view(batch_buf *bb) {
    if (bb->view != NULL) return bb->view;
    BatchBytes *owner = PyObject_New(BatchBytes, &BatchBytesType);
    if (owner == NULL) return NULL;
    owner->data = bb->data;
    owner->len = bb->len;
    PyObject *view = PyMemoryView_FromObject((PyObject *)owner);
    if (view == NULL) owner->data = NULL; /* the batch keeps its bytes (a take may be tried again) */
    Py_DECREF(owner);
    if (view == NULL) return NULL;
    bb->data = NULL; /* owned by the BatchBytes now */
    bb->view = view;
    return view;
}

/* Strict UTF-8 (what str.decode("utf-8") accepts): no overlong forms, no surrogates, nothing past U+10FFFF. */
static int utf8_valid(const uint8_t *p, Py_ssize_t n) {
    Py_ssize_t i = 0;
    while (i < n) {
        uint8_t c = p[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        int k;
        uint8_t lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF)
            k = 1;
        else if (c == 0xE0)
            k = 2, lo = 0xA0;
        else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF)
            k = 2;
        else if (c == 0xED)
            k = 2, hi = 0x9F;
        else if (c == 0xF0)
            k = 3, lo = 0x90;
        else if (c >= 0xF1 && c <= 0xF3)
            k = 3;
        else if (c == 0xF4)
            k = 3, hi = 0x8F;
        else
            return 0;
        if (n - i <= k || p[i + 1] < lo || p[i + 1] > hi) return 0;
        for (int j = 2; j <= k; j++)
            if ((p[i + j] & 0xC0) != 0x80) return 0;
        i += k + 1;
    }
    return 1;
}

/* The record count of the batch frame at st->rel when its header lies in the
   mapping and says 1..BATCH_MAX_RECORDS records, with its raw length in
   *raw_len; else 0 (the walk leaves it to the pread path). */
static unsigned long long batch_count(const scan_state *st, unsigned long long *raw_len) {
    if (st->rel + FRAME_PREFIX + BATCH_HDR_SIZE > st->buflen ||
        st->base + (unsigned long long)st->rel + FRAME_PREFIX + BATCH_HDR_SIZE > st->size)
        return 0;
    unsigned long long count = rd32(st->buf + st->rel + FRAME_PREFIX + 8);
    *raw_len = rd32(st->buf + st->rel + FRAME_PREFIX + 12);
    return count >= 1 && count <= BATCH_MAX_RECORDS ? count : 0;
}

/* Decompress and check the batch frame at st->rel (``count`` records and
   ``*expect_raw`` bytes raw, from batch_count()) into ``ring`` slots from ``slot`` on, as read_batch() checks
   it: length, CRC of the stored bytes, first LSN, codec, sizes, the zstd
   frame's own content size, then every inner frame as a segment's (bounds,
   CRC, LSN sequence, session id UTF-8), exactly ``count`` of them filling the
   raw bytes. No Python, no GIL. Returns the batch's end (relative to st->buf)
   once noted, or 0 when the walk leaves it to the pread path: anything short
   of that, or a batch that reaches ``st->limit``. ``*pending`` holds the batch
   while it is being read (the walk frees it if a fault jumps out). */
static Py_ssize_t walk_batch(const scan_state *st, ZSTD_DCtx *dctx, unsigned long long raw_cap, unsigned long long count,
                             const unsigned long long *expect_raw, frame_info *ring, unsigned long long slot,
                             unsigned long long ring_size, batch_buf *volatile *pending) {
    const uint8_t *f = st->buf + st->rel;
    uint32_t crc = rd32(f), length = rd32(f + 4);
    if (length <= BATCH_HDR_SIZE || (unsigned long long)length > BATCH_HDR_SIZE + raw_cap) return 0;
    Py_ssize_t rend = st->rel + FRAME_PREFIX + (Py_ssize_t)length;
    if (st->base + (unsigned long long)rend > st->size || rend > st->buflen) return 0;
    if (mask_crc(~crc_hw(~0u, f + 4, (size_t)length + 5)) != crc) return 0;
    unsigned long long first = rd64(f + FRAME_PREFIX), raw_len = rd32(f + FRAME_PREFIX + 12);
    /* The header read again under its CRC: it must still say what batch_count() read (the file is not rewritten
       under a reader in place, but the count sizes the ring slots and the size the bytes held). */
    if (rd32(f + FRAME_PREFIX + 8) != count || raw_len != *expect_raw) return 0;
    if (first != st->expected || f[FRAME_PREFIX + 16] != BATCH_CODEC_ZSTD || raw_len > raw_cap || raw_len < SID_AT) return 0;
    if (st->has_limit && first + count > st->limit) return 0; /* the pread path stops inside it and keeps the rest */
    const uint8_t *data = f + FRAME_PREFIX + BATCH_HDR_SIZE;
    size_t stored = (size_t)length - BATCH_HDR_SIZE;
    if (stored < 4 || rd32(data) != ZSTD_MAGIC || zstd.content_size(data, stored) != raw_len) return 0;
    /* One frame that ends the stored bytes, as the writer stores a batch: ZSTD_decompressDCtx would also read
       on through an empty or a skippable frame after it, which the pread path refuses. */
    size_t framed = zstd.frame_size(data, stored);
    if (zstd.is_error(framed) || framed != stored) return 0;
    batch_buf *bb = calloc(1, sizeof(batch_buf));
    if (bb == NULL) return 0;
    bb->data = malloc((size_t)raw_len);
    bb->len = (Py_ssize_t)raw_len;
    if (bb->data == NULL) {
        batch_discard(bb);
        return 0;
    }
    *pending = bb;
    size_t got = zstd.decompress(dctx, bb->data, (size_t)raw_len, data, stored);
    if (zstd.is_error(got) || got != raw_len) goto refuse;
    scan_state in;
    memset(&in, 0, sizeof(in));
    in.buf = bb->data;
    in.buflen = bb->len;
    in.size = raw_len;
    in.cap = st->cap;
    in.expected = first;
    bad_info bad;
    for (unsigned long long k = 0; k < count; k++) {
        frame_info *fi = &ring[(slot + k) % ring_size];
        if (scan_core(&in, fi, &bad, 1) != SCAN_MORE || !utf8_valid(fi->sid, fi->sidlen)) goto refuse;
        in.rel = fi->end;
        in.expected = fi->lsn + 1;
        fi->bb = bb;
        fi->batch_rel = st->rel;
        fi->batch_end = rend;
        fi->last_of_batch = k + 1 == count;
    }
    if ((unsigned long long)in.rel != raw_len) goto refuse;
    *pending = NULL;
    return rend;
refuse:
    *pending = NULL;
    batch_discard(bb);
    return 0;
}

/* ------------------------------------------------------------------ scanning a mapped segment */

/* A segment mapped into memory is read without a copy, but a file cut short
   while mapped (recovery truncating a torn tail, a repair) turns a read of the
   pages past its new end into SIGBUS. scan_mapped() therefore checks frames in
   two phases: first, under a SIGBUS guard, plain C that touches the mapping
   (bounds, CRC, LSN) and notes each valid frame; then, unguarded, it builds
   the Python objects from those notes. The second phase reads only bytes of
   frames found valid, which every truncation leaves in place (the log is cut
   at its first bad frame, never before), so a fault can only come in the
   first phase, where the guard turns it into the stop code SCAN_SHRANK. A
   compressed batch is read under a guard too: its header by scan_guarded(),
   the rest by mapped_batch(), whose frames are built from its decompressed
   copy. */

#include <setjmp.h>
#include <signal.h>

enum { SCAN_SHRANK = 5 };
#define MAPPED_FRAMES 512 /* frames scan_mapped() notes per call, at most */

static __thread sigjmp_buf *bus_guard; /* set while this thread reads a mapping */
static struct sigaction bus_previous;  /* the disposition ours replaced */

static void on_sigbus(int sig, siginfo_t *info, void *ctx) {
    sigjmp_buf *jb = bus_guard;
    if (jb != NULL) {
        bus_guard = NULL;
        siglongjmp(*jb, 1);
    }
    /* Not a read of ours: hand SIGBUS back to whoever had it; returning
       re-runs the faulting access under that disposition. */
    (void)sig;
    (void)info;
    (void)ctx;
    sigaction(SIGBUS, &bus_previous, NULL);
}

/* Make on_sigbus the SIGBUS handler (again, if someone replaced it since:
   faulthandler, the signal module). Called with the GIL held. */
static int bus_handler_installed(void) {
    struct sigaction cur;
    if (sigaction(SIGBUS, NULL, &cur) < 0) return 0;
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus) return 1;
    struct sigaction act;
    memset(&act, 0, sizeof(act));
    act.sa_sigaction = on_sigbus;
    /* SA_NODEFER: SIGBUS stays unblocked in the handler, so the jump out needs
       no saved signal mask (sigsetjmp(.., 0): no system call per scan). */
    act.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&act.sa_mask);
    return sigaction(SIGBUS, &act, &bus_previous) == 0;
}

/* What scan_guarded() saw of a compressed batch it stopped at (read under its guard, since the
   mapping may end anywhere): whether it stopped at one, and when it noted no frame before it, the
   batch's record count (0: not one the walk takes) and raw length, from batch_count(). */
typedef struct {
    int at_batch;
    unsigned long long count, raw_len;
} batch_peek;

/* Phase one: up to max_frames valid frames into fi[], under the guard, and
   with ``peek`` (not NULL) what the guard lets it read of a batch it stopped
   at. Returns the SCAN_* code (SCAN_SHRANK on a fault) or -1 with an error
   set; *n is how many frames were noted. */
static int scan_guarded(scan_state *st, frame_info *fi, Py_ssize_t max_frames, Py_ssize_t *n, batch_peek *peek) {
    sigjmp_buf jb;
    volatile Py_ssize_t got = 0;
    volatile int code = SCAN_MORE;
    if (sigsetjmp(jb, 0) != 0) {
        /* The file shrank under a read: the frames noted so far were read whole before it. */
        Py_CLEAR(st->reason); /* a stop found before the fault (a batch's type byte) is not this stop */
        *n = got;
        return SCAN_SHRANK;
    }
    bus_guard = &jb;
    while (got < max_frames) {
        code = scan_step(st, &fi[got]);
        if (code != SCAN_MORE) break;
        st->rel = fi[got].end;
        st->expected = fi[got].lsn + 1;
        got++;
    }
    if (peek != NULL && code == SCAN_BAD && st->buf[st->rel + FRAME_PREFIX - 1] == TYPE_BATCH) {
        peek->at_batch = 1;
        if (got == 0) peek->count = batch_count(st, &peek->raw_len);
    }
    bus_guard = NULL;
    *n = got;
    return code;
}

static PyObject *mapped_batch(scan_state *st, PyTypeObject *tp, unsigned long long raw_cap, const batch_peek *peek,
                              sid_cache *cache, int *shrank);

/* scan_mapped(map, view, frame_type, rel, base, size, expected, limit, cap, max_frames, batch_raw_cap=0)
   -> (frames, rel, expected, code, reason)

   scan() over a memory-mapped segment (``map``, whose first byte is at file
   offset ``base``; ``view`` a memoryview of it, or None: no payloads), safe against the file
   shrinking while mapped: code 5 (SHRANK) says it did, at ``rel``. It
   returns at most 512 frames a call, whatever ``max_frames`` says. The same
   frames, checks, codes and reasons as scan() otherwise. With ``batch_raw_cap``
   (as MappedScan takes it) and libzstd loaded, a call that starts at a
   compressed batch returns that batch's frames alone (mapped_batch()), and one
   that meets a batch after some frames stops before it (code MORE). */
static PyObject *fc_scan_mapped(PyObject *self, PyObject *args) {
    PyObject *bufobj, *viewobj, *ftype, *limit_obj;
    Py_ssize_t rel, max_frames;
    unsigned long long base, size, expected, cap, raw_cap = 0;
    if (!PyArg_ParseTuple(args, "OOOnKKKOKn|K:scan_mapped", &bufobj, &viewobj, &ftype, &rel, &base, &size, &expected,
                          &limit_obj, &cap, &max_frames, &raw_cap))
        return NULL;
    if (check_frame_type(ftype, "scan_mapped") < 0) return NULL;
    /* Noted on the stack, a bounded number per call (the caller asks again on code MORE). */
    frame_info fi[MAPPED_FRAMES];
    if (max_frames > MAPPED_FRAMES) max_frames = MAPPED_FRAMES;
    if (max_frames < 1) max_frames = 1;
    if (crc_backend != BACKEND_HW || !bus_handler_installed()) {
        /* The fallback CRC runs Python code on the mapping; no guard there. */
        PyErr_SetString(PyExc_RuntimeError, "scan_mapped: needs the hardware CRC32C backend and a SIGBUS handler");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(bufobj, &view, PyBUF_SIMPLE) < 0) return NULL;
    scan_state st;
    PyObject *frames = NULL, *result = NULL;
    sid_cache cache;
    memset(&cache, 0, sizeof(cache));
    if (parse_state(&st, &view, limit_obj, rel, base, size, expected, cap) < 0) goto done;
    Py_ssize_t n = 0;
    batch_peek peek = {0, 0, 0};
    int batches = raw_cap > 0 && zstd.version != 0;
    int code = scan_guarded(&st, fi, max_frames, &n, batches ? &peek : NULL);
    if (code < 0) goto done;
    if (code == SCAN_BAD && peek.at_batch) {
        if (n > 0) {
            code = SCAN_MORE; /* the frames before it now, the batch in the next call */
            Py_CLEAR(st.reason);
        } else if (peek.count > 0) {
            int shrank = 0;
            frames = mapped_batch(&st, (PyTypeObject *)ftype, raw_cap, &peek, &cache, &shrank);
            if (frames == NULL && PyErr_Occurred()) goto done;
            if (frames != NULL || shrank) { /* taken (st is past it), or the file shrank under it (st at it) */
                Py_CLEAR(st.reason);
                if (frames == NULL && (frames = PyList_New(0)) == NULL) goto done;
                result = Py_BuildValue("(OnKiO)", frames, st.rel, st.expected, shrank ? SCAN_SHRANK : SCAN_MORE, Py_None);
                goto done;
            }
            /* Left to the pread path: the stop and its reason stay the batch's (a bad frame's, to the scanner). */
        }
    }
    frames = PyList_New(n);
    if (frames == NULL) goto done;
    PyTypeObject *tp = (PyTypeObject *)ftype;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *later = st.reason; /* a bad frame after this one, if any */
        st.reason = NULL;
        PyObject *sid = sid_or_bad(&cache, &fi[i], &st);
        if (sid == NULL && st.reason == NULL) {
            st.reason = later;
            goto done;
        }
        if (sid != NULL) {
            st.reason = later;
        } else {
            Py_XDECREF(later);
            /* Not UTF-8: the scan stops at this frame, as scan() does. */
            if (PyList_SetSlice(frames, i, n, NULL) < 0) goto done;
            st.rel = fi[i].rel;
            st.expected = fi[i].lsn;
            code = SCAN_BAD;
            break;
        }
        PyObject *fr = make_frame(tp, viewobj, &fi[i], sid, PyLong_FromUnsignedLongLong(st.base + (unsigned long long)fi[i].rel),
                                  PyLong_FromUnsignedLongLong(st.base + (unsigned long long)fi[i].end));
        if (fr == NULL) goto done;
        PyList_SET_ITEM(frames, i, fr);
    }
    result = Py_BuildValue("(OnKiO)", frames, st.rel, st.expected, code, st.reason ? st.reason : Py_None);
done:
    Py_XDECREF(st.reason);
    Py_XDECREF(frames);
    sid_cache_clear(&cache);
    PyBuffer_Release(&view);
    return result;
}

/* scan_mapped()'s batch, in the caller's thread (one CPU, or less left of the
   segment than MappedScan needs): walk_batch() under the SIGBUS guard (every
   read of the mapping here is), then the batch's frames built as MappedScan's
   consumer builds them. ``peek``: the batch's count and raw length, read by
   scan_guarded() under its guard. Returns the list with ``st`` moved past the
   batch; NULL with no error set when the batch is left to the pread path, or
   with ``*shrank`` set when the file shrank under the read (``st`` unchanged
   either way); NULL with an error on failure. Called with the GIL held
   throughout, so one decompression context serves every call. */
static ZSTD_DCtx *mapped_dctx;

static PyObject *mapped_batch(scan_state *st, PyTypeObject *tp, unsigned long long raw_cap, const batch_peek *peek,
                              sid_cache *cache, int *shrank) {
    unsigned long long raw_len = peek->raw_len, count = peek->count;
    if (mapped_dctx == NULL && (mapped_dctx = zstd.create()) == NULL) return PyErr_NoMemory();
    frame_info *fi = PyMem_Malloc(sizeof(frame_info) * (size_t)count);
    if (fi == NULL) return PyErr_NoMemory();
    batch_buf *volatile pending = NULL;
    volatile Py_ssize_t end = 0;
    sigjmp_buf jb;
    if (sigsetjmp(jb, 0) == 0) {
        bus_guard = &jb;
        end = walk_batch(st, mapped_dctx, raw_cap, count, &raw_len, fi, 0, count, &pending);
    } else {
        if (pending != NULL) batch_discard(pending);
        *shrank = 1; /* the file shrank under the read: reported as scan_guarded() reports it */
    }
    bus_guard = NULL;
    if (end == 0) {
        PyMem_Free(fi);
        return NULL;
    }
    batch_buf *bb = fi[0].bb;
    PyObject *view = batch_view(bb), *frames = view != NULL ? PyList_New((Py_ssize_t)count) : NULL;
    for (unsigned long long k = 0; frames != NULL && k < count; k++) {
        PyObject *sid = sid_decode(cache, fi[k].sid, fi[k].sidlen); /* UTF-8: walk_batch checked it */
        PyObject *fr = sid == NULL ? NULL
                                   : make_frame(tp, view, &fi[k], sid, PyLong_FromUnsignedLongLong(st->base + (unsigned long long)st->rel),
                                                PyLong_FromUnsignedLongLong(st->base + (unsigned long long)end));
        if (fr == NULL)
            Py_CLEAR(frames);
        else
            PyList_SET_ITEM(frames, (Py_ssize_t)k, fr);
    }
    if (frames != NULL) {
        st->rel = end;
        st->expected = fi[count - 1].lsn + 1;
    } else if (!PyErr_Occurred()) {
        PyErr_NoMemory();
    }
    batch_release(bb); /* the payloads keep its bytes alive */
    PyMem_Free(fi);
    return frames;
}

/* ------------------------------------------------------------------ a mapped segment checked by a second thread */

/* MappedScan: scan_mapped() split over two threads. A thread of its own
   (no GIL, no Python) walks the mapping: bounds, CRC32C, LSN sequence,
   under the SIGBUS guard (bus_guard is per thread), and notes each valid
   frame in a ring; the caller's thread takes the noted frames (take()) and
   builds their Python objects, as scan_mapped()'s second phase does, while
   the walk goes on ahead. On a machine with two cores the CRC pass, which
   costs about as much as all the per-record Python work of a replay, then
   runs beside it instead of before it. Same frames, codes and reasons as
   scan_mapped(); the frames are handed out in order, never before the walk
   has checked them. */

#include <pthread.h>
#include <unistd.h>

#define RING_FRAMES 4096               /* frames the walk notes ahead of the consumer, at most */
/* The ring holds a whole batch (the walk notes a batch's frames together). */
typedef char ring_holds_a_batch[RING_FRAMES >= BATCH_MAX_RECORDS ? 1 : -1];
#define PUBLISH_FRAMES 16              /* the walk shows its progress after this many frames */
#define PUBLISH_BYTES (256 << 10)      /* ... or this many bytes, whichever comes first */

typedef struct {
    PyObject_HEAD
    Py_buffer view; /* the mapping, exported (so it stays mapped) while the walk may read it */
    int have_view;
    PyObject *viewobj; /* payloads are slices of it */
    PyTypeObject *ftype;
    scan_state st; /* the walk's state: its thread's alone until ``done`` */
    unsigned long long raw_cap; /* the most bytes a batch decompresses to; 0: batches are left to the pread path */
    frame_info *ring;
    pthread_t thread;
    pid_t owner; /* the process that started the thread (a forked child has none to join) */
    int started;
    /* Guarded by mu: */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    unsigned long long produced, consumed; /* frames noted by the walk / handed out */
    unsigned long long held_bytes;         /* decompressed bytes of the batches noted and not yet handed out whole */
    int done, cancel, waiting;
    int code;     /* the walk's stop code, once done */
    bad_info bad; /* with code SCAN_BAD */
    /* The consumer's (the GIL holder's) alone: */
    sid_cache cache;
    int finished; /* the stop has been handed out */
    PyObject *final; /* the last take()'s result once finished */
} MappedScan;

/* In the walk: show the frames noted so far and wait until the ring has room
   for ``need`` more, and the batches held ahead for ``bytes`` more (or none is
   held ahead). Returns 1 when the consumer cancelled the walk instead. */
static int walk_wait(MappedScan *ms, unsigned long long n, unsigned long long need, unsigned long long bytes,
                     unsigned long long *consumed) {
    pthread_mutex_lock(&ms->mu);
    __atomic_store_n(&ms->produced, n, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&ms->cv);
    while (!ms->cancel && (n + need - ms->consumed > RING_FRAMES ||
                           (bytes > 0 && ms->held_bytes + bytes > HELD_BYTES_MAX && ms->consumed < n)))
        pthread_cond_wait(&ms->cv, &ms->mu);
    *consumed = ms->consumed;
    int cancel = ms->cancel;
    pthread_mutex_unlock(&ms->mu);
    return cancel;
}

static void *mapped_walk(void *arg) {
    MappedScan *ms = (MappedScan *)arg;
    /* Signals for the process go to the other threads (Python handles them in its main thread). */
    sigset_t block;
    sigfillset(&block);
    sigdelset(&block, SIGBUS);
    sigdelset(&block, SIGSEGV);
    sigdelset(&block, SIGFPE);
    sigdelset(&block, SIGILL);
    pthread_sigmask(SIG_BLOCK, &block, NULL);
    scan_state *st = &ms->st;
    volatile unsigned long long n = 0; /* frames noted */
    volatile int code = SCAN_LIMIT;
    batch_buf *volatile pending = NULL; /* a batch being decompressed */
    ZSTD_DCtx *volatile dctx = ms->raw_cap > 0 && zstd.version != 0 ? zstd.create() : NULL;
    bad_info bad;
    memset(&bad, 0, sizeof(bad));
    sigjmp_buf jb;
    if (sigsetjmp(jb, 0) != 0) {
        /* The file shrank under a read: st->rel is the start of the frame (or batch) being read. */
        code = SCAN_SHRANK;
        goto out;
    }
    bus_guard = &jb;
    {
        unsigned long long published = 0, consumed = 0;
        size_t bytes = 0;
        for (;;) {
            if (n - consumed >= RING_FRAMES) {
                if (walk_wait(ms, n, 1, 0, &consumed)) break;
                published = n;
                bytes = 0;
            }
            frame_info *fi = &ms->ring[n % RING_FRAMES];
            int c = scan_core(st, fi, &bad, 1);
            if (c == SCAN_BAD && bad.kind == BAD_TYPE && bad.a == TYPE_BATCH && dctx != NULL) {
                /* A compressed batch: its frames go into the ring together, or it is left to the pread path. */
                unsigned long long raw_len = 0, count = batch_count(st, &raw_len);
                /* Read without the lock: only this thread raises held_bytes, so the value read is an upper bound. */
                unsigned long long held = __atomic_load_n(&ms->held_bytes, __ATOMIC_RELAXED);
                if (count > 0 && (n + count - consumed > RING_FRAMES || held + raw_len > HELD_BYTES_MAX)) {
                    if (walk_wait(ms, n, count, raw_len, &consumed)) break;
                    published = n;
                    bytes = 0;
                }
                Py_ssize_t end = count > 0 ? walk_batch(st, dctx, ms->raw_cap, count, &raw_len, ms->ring, n, RING_FRAMES, &pending) : 0;
                if (end > 0) {
                    pthread_mutex_lock(&ms->mu);
                    __atomic_add_fetch(&ms->held_bytes, raw_len, __ATOMIC_RELAXED);
                    pthread_mutex_unlock(&ms->mu);
                    bytes += (size_t)(end - st->rel);
                    st->rel = end;
                    st->expected += count;
                    __asm__ __volatile__("" ::: "memory");
                    n = n + count;
                    c = SCAN_MORE;
                }
            } else if (c == SCAN_MORE) {
                st->rel = fi->end;
                st->expected = fi->lsn + 1;
                bytes += (size_t)(fi->end - fi->rel);
                __asm__ __volatile__("" ::: "memory"); /* the frame and the state are in memory before it counts */
                n = n + 1;
            }
            if (c != SCAN_MORE) {
                code = c;
                break;
            }
            if (n - published >= PUBLISH_FRAMES || bytes >= PUBLISH_BYTES) {
                pthread_mutex_lock(&ms->mu);
                __atomic_store_n(&ms->produced, n, __ATOMIC_RELEASE);
                consumed = ms->consumed;
                int cancel = ms->cancel;
                if (ms->waiting) pthread_cond_broadcast(&ms->cv);
                pthread_mutex_unlock(&ms->mu);
                published = n;
                bytes = 0;
                if (cancel) break;
            }
        }
    }
out:
    bus_guard = NULL;
    if (pending != NULL) batch_discard(pending);
    if (dctx != NULL) zstd.release(dctx);
    pthread_mutex_lock(&ms->mu);
    __atomic_store_n(&ms->produced, n, __ATOMIC_RELEASE);
    ms->code = code;
    ms->bad = bad;
    __atomic_store_n(&ms->done, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&ms->cv);
    pthread_mutex_unlock(&ms->mu);
    return NULL;
}

/* Stop the walk and wait for its thread (idempotent). Called with the GIL held. */
static void mapped_stop(MappedScan *ms) {
    if (ms->started && ms->owner == getpid()) {
        pthread_mutex_lock(&ms->mu);
        ms->cancel = 1;
        pthread_cond_broadcast(&ms->cv);
        pthread_mutex_unlock(&ms->mu);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(ms->thread, NULL);
        Py_END_ALLOW_THREADS
        /* The batches noted but not handed out to their last frame (a reader that stopped early). */
        for (unsigned long long i = ms->consumed; i < ms->produced; i++) {
            frame_info *fi = &ms->ring[i % RING_FRAMES];
            if (fi->bb != NULL && fi->last_of_batch) {
                __atomic_sub_fetch(&ms->held_bytes, (unsigned long long)fi->bb->len, __ATOMIC_RELAXED);
                batch_release(fi->bb);
            }
        }
        ms->consumed = ms->produced;
    }
    ms->started = 0;
    if (ms->have_view) {
        PyBuffer_Release(&ms->view);
        ms->have_view = 0;
    }
    Py_CLEAR(ms->viewobj); /* frames handed out keep views of their own */
}

/* Wait up to SPIN_NS for the walk to note a frame past ``consumed`` (or stop),
   without sleeping: the walk publishes every few frames, and a futex sleep and
   wake-up per wait cost more than the short spin when the consumer is the
   faster of the two (a raw read). The caller sleeps on the condition after. */
#define SPIN_NS 200000
static void mapped_spin(MappedScan *ms, unsigned long long consumed) {
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (unsigned int i = 1;; i++) {
        if (__atomic_load_n(&ms->produced, __ATOMIC_ACQUIRE) != consumed || __atomic_load_n(&ms->done, __ATOMIC_ACQUIRE)) return;
#if defined(FC_X86)
        _mm_pause();
#endif
        if ((i & 255) == 0) {
            clock_gettime(CLOCK_MONOTONIC, &t);
            if ((t.tv_sec - t0.tv_sec) * 1000000000LL + (t.tv_nsec - t0.tv_nsec) > SPIN_NS) return;
        }
    }
}

static PyTypeObject MappedScanType;

/* MappedScan(map, view, frame_type, rel, base, size, expected, limit, cap, batch_raw_cap=0):
   scan_mapped()'s arguments but max_frames; the walk starts at once. With
   ``batch_raw_cap`` (format.batch_raw_cap(cap)) and libzstd loaded, the walk
   decompresses and checks compressed batches too (walk_batch()); a batch's
   frames then carry its place (offset, end) and their payloads view its
   decompressed bytes. */
static PyObject *ms_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *bufobj, *viewobj, *ftype, *limit_obj;
    Py_ssize_t rel;
    unsigned long long base, size, expected, cap, raw_cap = 0;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "MappedScan takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OOOnKKKOK|K:MappedScan", &bufobj, &viewobj, &ftype, &rel, &base, &size, &expected, &limit_obj,
                          &cap, &raw_cap))
        return NULL;
    if (check_frame_type(ftype, "MappedScan") < 0) return NULL;
    if (crc_backend != BACKEND_HW || !bus_handler_installed()) {
        PyErr_SetString(PyExc_RuntimeError, "MappedScan: needs the hardware CRC32C backend and a SIGBUS handler");
        return NULL;
    }
    MappedScan *ms = (MappedScan *)type->tp_alloc(type, 0);
    if (ms == NULL) return NULL;
    pthread_mutex_init(&ms->mu, NULL);
    pthread_cond_init(&ms->cv, NULL);
    if (PyObject_GetBuffer(bufobj, &ms->view, PyBUF_SIMPLE) < 0) goto fail;
    ms->have_view = 1;
    Py_INCREF(viewobj);
    ms->viewobj = viewobj;
    Py_INCREF(ftype);
    ms->ftype = (PyTypeObject *)ftype;
    if (parse_state(&ms->st, &ms->view, limit_obj, rel, base, size, expected, cap) < 0) goto fail;
    ms->raw_cap = raw_cap;
    ms->ring = PyMem_RawMalloc(sizeof(frame_info) * RING_FRAMES);
    if (ms->ring == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    ms->owner = getpid();
    int err = pthread_create(&ms->thread, NULL, mapped_walk, ms);
    if (err != 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    ms->started = 1;
    return (PyObject *)ms;
fail:
    Py_DECREF(ms);
    return NULL;
}

static void ms_dealloc(MappedScan *ms) {
    mapped_stop(ms);
    Py_XDECREF(ms->ftype);
    Py_XDECREF(ms->final);
    sid_cache_clear(&ms->cache);
    PyMem_RawFree(ms->ring);
    pthread_mutex_destroy(&ms->mu);
    pthread_cond_destroy(&ms->cv);
    Py_TYPE(ms)->tp_free((PyObject *)ms);
}

/* take(max_frames) -> (frames, rel, expected, code, reason), as scan_mapped() returns:
   the frames the walk has checked and the consumer has not had yet (at least one,
   waiting for the walk if need be, at most max_frames), then, with the last of
   them or alone, the walk's stop (code 4 MORE until then). */
static PyObject *ms_take(MappedScan *ms, PyObject *arg) {
    Py_ssize_t max_frames = PyLong_AsSsize_t(arg);
    if (max_frames == -1 && PyErr_Occurred()) return NULL;
    if (max_frames < 1) max_frames = 1;
    if (ms->finished) {
        Py_INCREF(ms->final);
        return ms->final;
    }
    if (!ms->have_view) {
        PyErr_SetString(PyExc_ValueError, "MappedScan.take: the scan was closed");
        return NULL;
    }
    if (ms->started && ms->owner != getpid()) {
        /* A forked child: the walk thread is its parent's, and a lock it held at the fork stays held
           here. Never touch the ring's lock: refuse, and the caller reads on without the thread. */
        PyErr_Format(PyExc_RuntimeError, "MappedScan.take: the walk thread runs in process %ld, not in this one "
                     "(a fork); read on with scan_mapped", (long)ms->owner);
        return NULL;
    }
    pthread_mutex_lock(&ms->mu);
    unsigned long long produced = ms->produced, consumed = ms->consumed;
    int done = ms->done;
    pthread_mutex_unlock(&ms->mu);
    if (produced == consumed && !done) {
        Py_BEGIN_ALLOW_THREADS
        mapped_spin(ms, consumed);
        pthread_mutex_lock(&ms->mu);
        ms->waiting = 1;
        while (ms->produced == ms->consumed && !ms->done) pthread_cond_wait(&ms->cv, &ms->mu);
        ms->waiting = 0;
        produced = ms->produced;
        done = ms->done;
        pthread_mutex_unlock(&ms->mu);
        Py_END_ALLOW_THREADS
    }
    Py_ssize_t n = (Py_ssize_t)(produced - consumed);
    if (n > max_frames) {
        n = max_frames;
        /* Never part of a batch: the scanner's offset and next LSN stay at a batch's end between takes (the
           walk notes a batch's frames together, so its last is there). */
        while (ms->ring[(consumed + (unsigned long long)n - 1) % RING_FRAMES].bb != NULL &&
               !ms->ring[(consumed + (unsigned long long)n - 1) % RING_FRAMES].last_of_batch)
            n++;
    }
    PyObject *frames = PyList_New(n), *reason = NULL, *result = NULL;
    if (frames == NULL) return NULL;
    scan_state *st = &ms->st; /* for base (constant) and, once done, the stop */
    Py_ssize_t rel = 0;
    unsigned long long expected = 0;
    int code = SCAN_MORE;
    for (Py_ssize_t i = 0; i < n; i++) {
        const frame_info *fi = &ms->ring[(consumed + (unsigned long long)i) % RING_FRAMES];
        scan_state bad_st; /* only its reason is used (``st`` is the walk's, still moving) */
        memset(&bad_st, 0, sizeof(bad_st));
        PyObject *sid = sid_or_bad(&ms->cache, fi, &bad_st);
        if (sid == NULL) {
            if (bad_st.reason == NULL) goto fail;
            /* Not UTF-8: the scan stops at this frame, as scan() does; in a batch (whose ids
               the walk checked, so never in practice), at the batch, which a take never splits. */
            Py_ssize_t at = i;
            while (fi->bb != NULL && at > 0 && ms->ring[(consumed + (unsigned long long)at - 1) % RING_FRAMES].bb == fi->bb) at--;
            reason = bad_st.reason;
            if (PyList_SetSlice(frames, at, n, NULL) < 0) goto fail;
            rel = fi->bb != NULL ? fi->batch_rel : fi->rel;
            expected = ms->ring[(consumed + (unsigned long long)at) % RING_FRAMES].lsn;
            code = SCAN_BAD;
            n = at;
            break;
        }
        /* A batch's frame: its payload views the batch's bytes, its place is the batch's. */
        PyObject *viewobj = fi->bb != NULL ? batch_view(fi->bb) : ms->viewobj;
        Py_ssize_t at = fi->bb != NULL ? fi->batch_rel : fi->rel, end = fi->bb != NULL ? fi->batch_end : fi->end;
        if (viewobj == NULL) {
            Py_DECREF(sid);
            goto fail;
        }
        PyObject *fr = make_frame(ms->ftype, viewobj, fi, sid, PyLong_FromUnsignedLongLong(st->base + (unsigned long long)at),
                                  PyLong_FromUnsignedLongLong(st->base + (unsigned long long)end));
        if (fr == NULL) goto fail;
        PyList_SET_ITEM(frames, i, fr);
        rel = end;
        expected = fi->lsn + 1;
    }
    unsigned long long released = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const frame_info *fi = &ms->ring[(consumed + (unsigned long long)i) % RING_FRAMES];
        if (fi->bb != NULL && fi->last_of_batch) { /* handed out whole */
            released += (unsigned long long)fi->bb->len;
            batch_release(fi->bb);
        }
    }
    pthread_mutex_lock(&ms->mu);
    __atomic_sub_fetch(&ms->held_bytes, released, __ATOMIC_RELAXED); /* atomic: the walk reads it without the lock */
    ms->consumed = consumed + (unsigned long long)n;
    int all_taken = ms->consumed == ms->produced;
    pthread_cond_broadcast(&ms->cv); /* room in the ring */
    pthread_mutex_unlock(&ms->mu);
    if (code == SCAN_BAD) {
        mapped_stop(ms);
    } else if (done && all_taken) {
        /* The walk is over and everything it noted is handed out: its stop goes with them. */
        code = ms->code;
        rel = st->rel;
        expected = st->expected;
        if (code == SCAN_BAD) {
            reason = bad_reason(&ms->bad, st->cap, st->size);
            if (reason == NULL) goto fail;
        }
        mapped_stop(ms);
    }
    result = Py_BuildValue("(OnKiO)", frames, rel, expected, code, reason ? reason : Py_None);
    if (result != NULL && code != SCAN_MORE) {
        ms->finished = 1;
        PyObject *empty = PyList_New(0);
        ms->final = empty ? Py_BuildValue("(OnKiO)", empty, rel, expected, code, reason ? reason : Py_None) : NULL;
        Py_XDECREF(empty);
        if (ms->final == NULL) Py_CLEAR(result);
    }
fail:
    Py_XDECREF(reason);
    Py_DECREF(frames);
    return result;
}

/* close(): stop the walk, wait for its thread and let go of the mapping (idempotent). */
static PyObject *ms_close(MappedScan *ms, PyObject *noargs) {
    mapped_stop(ms);
    Py_RETURN_NONE;
}

/* held_bytes() -> int: decompressed bytes of the batches the walk holds ahead of the reader (at most 32 MiB, or one batch). */
static PyObject *ms_held_bytes(MappedScan *ms, PyObject *noargs) {
    pthread_mutex_lock(&ms->mu);
    unsigned long long held = ms->held_bytes;
    pthread_mutex_unlock(&ms->mu);
    return PyLong_FromUnsignedLongLong(held);
}

static PyMethodDef ms_methods[] = {
    {"take", (PyCFunction)ms_take, METH_O, "The next checked frames: (frames, rel, expected, code, reason)."},
    {"held_bytes", (PyCFunction)ms_held_bytes, METH_NOARGS, "Decompressed bytes of the batches held ahead of the reader."},
    {"close", (PyCFunction)ms_close, METH_NOARGS, "Stop the walk and wait for its thread."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MappedScanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "agentlog.events.log._framecodec.MappedScan",
    .tp_basicsize = sizeof(MappedScan),
    .tp_dealloc = (destructor)ms_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "scan_mapped() with the walk (bounds, CRC, LSNs) in a second thread; see the C source.",
    .tp_methods = ms_methods,
    .tp_new = ms_new,
};

/* scan_batch(raw, frame_type, first, count, offset, end, cap) -> (frames, at, reason)

   The frames of a decompressed batch (``raw``, a bytes object of frames
   numbered from ``first``), checked as scan() checks a segment's, at most
   count + 1 of them, each a ``frame_type`` carrying the batch's ``offset``
   and ``end`` (where the batch lies in its segment) and a payload viewing
   ``raw``. ``frames`` is last first (how the scanner keeps a batch's
   frames); ``at`` is where the walk stopped in ``raw``; ``reason`` says why
   it stopped at a bad frame, else None. */
static PyObject *fc_scan_batch(PyObject *self, PyObject *args) {
    PyObject *raw, *ftype;
    unsigned long long first, offset, end, cap;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "SOKnKKK:scan_batch", &raw, &ftype, &first, &count, &offset, &end, &cap)) return NULL;
    if (check_frame_type(ftype, "scan_batch") < 0) return NULL;
    PyTypeObject *tp = (PyTypeObject *)ftype;
    scan_state st;
    memset(&st, 0, sizeof(st));
    st.buf = (const uint8_t *)PyBytes_AS_STRING(raw);
    st.buflen = PyBytes_GET_SIZE(raw);
    st.size = (unsigned long long)st.buflen;
    st.cap = cap;
    st.expected = first;
    PyObject *frames = PyList_New(0), *view = PyMemoryView_FromObject(raw), *off_o = PyLong_FromUnsignedLongLong(offset),
             *end_o = PyLong_FromUnsignedLongLong(end), *result = NULL;
    sid_cache cache;
    memset(&cache, 0, sizeof(cache));
    if (frames == NULL || view == NULL || off_o == NULL || end_o == NULL) goto done;
    while (PyList_GET_SIZE(frames) <= count) {
        frame_info fi;
        int code = scan_step(&st, &fi);
        if (code < 0) goto done;
        if (code != SCAN_MORE) break;
        PyObject *sid = sid_or_bad(&cache, &fi, &st);
        if (sid == NULL) {
            if (st.reason == NULL) goto done;
            break;
        }
        Py_INCREF(off_o);
        Py_INCREF(end_o);
        PyObject *fr = make_frame(tp, view, &fi, sid, off_o, end_o); /* every frame of a batch carries its place */
        if (fr == NULL) goto done;
        int rc = PyList_Append(frames, fr);
        Py_DECREF(fr);
        if (rc < 0) goto done;
        st.rel = fi.end;
        st.expected = fi.lsn + 1;
    }
    if (PyList_Reverse(frames) < 0) goto done;
    result = Py_BuildValue("(OnO)", frames, st.rel, st.reason ? st.reason : Py_None);
done:
    Py_XDECREF(st.reason);
    Py_XDECREF(frames);
    Py_XDECREF(view);
    Py_XDECREF(off_o);
    Py_XDECREF(end_o);
    sid_cache_clear(&cache);
    return result;
}

/* ------------------------------------------------------------------ encoding */

static void put_head(uint8_t *f, uint32_t length, unsigned long long lsn, unsigned long long seq, long long ts,
                     unsigned int flags, uint16_t sidlen) {
    memcpy(f + 4, &length, 4);
    f[8] = TYPE_RECORD;
    memcpy(f + 9, &lsn, 8);
    memcpy(f + 17, &seq, 8);
    memcpy(f + 25, &ts, 8);
    f[33] = (uint8_t)flags;
    memcpy(f + 34, &sidlen, 2);
}

static int check_sizes(Py_ssize_t sidlen, Py_ssize_t plen) {
    if (sidlen > 0xffff) {
        PyErr_Format(PyExc_ValueError, "session id of %zd bytes: at most 65535 fit in a frame", sidlen);
        return -1;
    }
    if ((unsigned long long)ENV_SIZE + (unsigned long long)sidlen + (unsigned long long)plen > 0xffffffffull) {
        PyErr_Format(PyExc_ValueError, "record of %zd payload bytes does not fit a frame (u32 length)", plen);
        return -1;
    }
    return 0;
}

/* Encode one frame at f (room for SID_AT + sid + payload bytes, or only for
   the prefix SID_AT + sid when ``prefix_only``: the CRC still covers the payload). */
static int encode_at(uint8_t *f, unsigned long long lsn, unsigned long long seq, long long ts, unsigned int flags,
                     const Py_buffer *sid, const Py_buffer *payload, int prefix_only) {
    uint32_t length = (uint32_t)(ENV_SIZE + sid->len + payload->len);
    put_head(f, length, lsn, seq, ts, flags, (uint16_t)sid->len);
    memcpy(f + SID_AT, sid->buf, (size_t)sid->len);
    uint32_t c;
    if (prefix_only) {
        if (crc_extend(0, f + 4, (size_t)(SID_AT - 4 + sid->len), &c) < 0) return -1;
        if (crc_extend(c, (const uint8_t *)payload->buf, (size_t)payload->len, &c) < 0) return -1;
    } else {
        memcpy(f + SID_AT + sid->len, payload->buf, (size_t)payload->len);
        if (crc_extend(0, f + 4, (size_t)(length + 5), &c) < 0) return -1;
    }
    uint32_t m = mask_crc(c);
    memcpy(f, &m, 4);
    return 0;
}

/* encode_frame(lsn, seq, ts_ns, flags, sid, payload, prefix_only=False) -> bytes */
static PyObject *fc_encode_frame(PyObject *self, PyObject *args) {
    unsigned long long lsn, seq;
    long long ts;
    unsigned int flags;
    Py_buffer sid, payload;
    int prefix_only = 0;
    if (!PyArg_ParseTuple(args, "KKLIy*y*|p:encode_frame", &lsn, &seq, &ts, &flags, &sid, &payload, &prefix_only))
        return NULL;
    PyObject *out = NULL;
    if (flags > 255) {
        PyErr_Format(PyExc_ValueError, "flags %u do not fit a byte", flags);
        goto done;
    }
    if (check_sizes(sid.len, payload.len) < 0) goto done;
    out = PyBytes_FromStringAndSize(NULL, SID_AT + sid.len + (prefix_only ? 0 : payload.len));
    if (out == NULL) goto done;
    if (encode_at((uint8_t *)PyBytes_AS_STRING(out), lsn, seq, ts, flags, &sid, &payload, prefix_only) < 0) Py_CLEAR(out);
done:
    PyBuffer_Release(&sid);
    PyBuffer_Release(&payload);
    return out;
}

/* The four fields of record i of a batch (borrowed references), or -1 with
   an exception set: how encode_batch's tuples and encode_columns's lists are
   read by the one encoder below. */
typedef int (*record_fields_fn)(void *src, Py_ssize_t i, PyObject **sid, PyObject **seq, PyObject **flags, PyObject **payload);

/* Frames of n records from lsn on, with one timestamp, in one buffer: the
   tuple (bytes, ends) where ends[i] is where frame i ends. ``who`` names the
   entry point in errors. */
static PyObject *encode_records(const char *who, Py_ssize_t n, record_fields_fn fields, void *src, unsigned long long lsn,
                                long long ts) {
    PyObject *out = NULL, *ends = NULL, *result = NULL;
    Py_buffer *sids = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    Py_buffer *pls = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    unsigned long long *seqs = PyMem_Calloc((size_t)n + 1, sizeof(unsigned long long));
    unsigned int *flags = PyMem_Calloc((size_t)n + 1, sizeof(unsigned int));
    Py_ssize_t got = 0, total = 0;
    if (!sids || !pls || !seqs || !flags) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        PyObject *sid_o, *seq_o, *flag_o, *pl_o;
        if (fields(src, got, &sid_o, &seq_o, &flag_o, &pl_o) < 0) goto done;
        if (PyObject_GetBuffer(sid_o, &sids[got], PyBUF_SIMPLE) < 0) goto done;
        if (PyObject_GetBuffer(pl_o, &pls[got], PyBUF_SIMPLE) < 0) {
            PyBuffer_Release(&sids[got]);
            goto done;
        }
        seqs[got] = PyLong_AsUnsignedLongLong(seq_o);
        unsigned long fl = PyLong_AsUnsignedLong(flag_o);
        if (PyErr_Occurred() || fl > 255 || check_sizes(sids[got].len, pls[got].len) < 0) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s: record %zd: flags %lu do not fit a byte", who, got, fl);
            got++;
            goto done;
        }
        flags[got] = (unsigned int)fl;
        total += SID_AT + sids[got].len + pls[got].len;
    }
    out = PyBytes_FromStringAndSize(NULL, total);
    ends = PyList_New(n);
    if (out == NULL || ends == NULL) goto done;
    uint8_t *f = (uint8_t *)PyBytes_AS_STRING(out);
    Py_ssize_t pos = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (encode_at(f + pos, lsn + (unsigned long long)i, seqs[i], ts, flags[i], &sids[i], &pls[i], 0) < 0) goto done;
        pos += SID_AT + sids[i].len + pls[i].len;
        PyObject *e = PyLong_FromSsize_t(pos);
        if (e == NULL) goto done;
        PyList_SET_ITEM(ends, i, e);
    }
    result = PyTuple_Pack(2, out, ends);
done:
    for (Py_ssize_t i = 0; i < got; i++) {
        if (sids[i].obj) PyBuffer_Release(&sids[i]);
        if (pls[i].obj) PyBuffer_Release(&pls[i]);
    }
    PyMem_Free(sids);
    PyMem_Free(pls);
    PyMem_Free(seqs);
    PyMem_Free(flags);
    Py_XDECREF(out);
    Py_XDECREF(ends);
    return result;
}

static int tuple_fields(void *src, Py_ssize_t i, PyObject **sid, PyObject **seq, PyObject **flags, PyObject **payload) {
    PyObject *it = ((PyObject **)src)[i];
    if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) != 4) {
        PyErr_Format(PyExc_TypeError, "encode_batch: record %zd: expected a (sid, seq, flags, payload) tuple", i);
        return -1;
    }
    *sid = PyTuple_GET_ITEM(it, 0);
    *seq = PyTuple_GET_ITEM(it, 1);
    *flags = PyTuple_GET_ITEM(it, 2);
    *payload = PyTuple_GET_ITEM(it, 3);
    return 0;
}

/* encode_batch(records, lsn, ts_ns) -> (bytes, ends)

   ``records``: a sequence of (sid bytes, seq, flags, payload) tuples; the
   frames get LSNs lsn, lsn+1, ... and one timestamp, all in one buffer;
   ends[i] is where frame i ends in it. */
static PyObject *fc_encode_batch(PyObject *self, PyObject *args) {
    PyObject *records;
    unsigned long long lsn;
    long long ts;
    if (!PyArg_ParseTuple(args, "OKL:encode_batch", &records, &lsn, &ts)) return NULL;
    PyObject *seq = PySequence_Fast(records, "encode_batch: records must be a sequence");
    if (seq == NULL) return NULL;
    PyObject *result = encode_records("encode_batch", PySequence_Fast_GET_SIZE(seq), tuple_fields, PySequence_Fast_ITEMS(seq), lsn, ts);
    Py_DECREF(seq);
    return result;
}

static int column_fields(void *src, Py_ssize_t i, PyObject **sid, PyObject **seq, PyObject **flags, PyObject **payload) {
    PyObject **lists = (PyObject **)src; /* sids, seqs, flags, payloads */
    *sid = PyList_GET_ITEM(lists[0], i);
    *seq = PyList_GET_ITEM(lists[1], i);
    *flags = PyList_GET_ITEM(lists[2], i);
    *payload = PyList_GET_ITEM(lists[3], i);
    return 0;
}

/* encode_columns(sids, seqs, flags, payloads, lsn, ts_ns) -> (bytes, ends)

   encode_batch over a batch held as four lists of one length (session ids as
   bytes, seqs, flag ints, payloads as buffers), so that the caller builds no
   tuple per record: the same frames, in one buffer, with their ends. */
static PyObject *fc_encode_columns(PyObject *self, PyObject *args) {
    PyObject *lists[4];
    unsigned long long lsn;
    long long ts;
    if (!PyArg_ParseTuple(args, "O!O!O!O!KL:encode_columns", &PyList_Type, &lists[0], &PyList_Type, &lists[1], &PyList_Type,
                          &lists[2], &PyList_Type, &lists[3], &lsn, &ts))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(lists[0]);
    if (PyList_GET_SIZE(lists[1]) != n || PyList_GET_SIZE(lists[2]) != n || PyList_GET_SIZE(lists[3]) != n) {
        PyErr_Format(PyExc_ValueError, "encode_columns: columns of %zd, %zd, %zd and %zd records: expected one length", n,
                     PyList_GET_SIZE(lists[1]), PyList_GET_SIZE(lists[2]), PyList_GET_SIZE(lists[3]));
        return NULL;
    }
    return encode_records("encode_columns", n, column_fields, lists, lsn, ts);
}

/* ------------------------------------------------------------------ CRC entry points */

/* crc32c(data, crc=0) -> int: google_crc32c.extend(crc, data) through the selected backend. */
static PyObject *fc_crc32c(PyObject *self, PyObject *args) {
    Py_buffer data;
    unsigned long crc = 0;
    if (!PyArg_ParseTuple(args, "y*|k:crc32c", &data, &crc)) return NULL;
    uint32_t c;
    int rc = crc_extend((uint32_t)crc, (const uint8_t *)data.buf, (size_t)data.len, &c);
    PyBuffer_Release(&data);
    if (rc < 0) return NULL;
    return PyLong_FromUnsignedLong(c);
}

static PyObject *fc_set_crc_backend(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    int fold = strcmp(name, "hardware") == 0 ? FOLD_BEST : strcmp(name, "hardware-streams") == 0 ? FOLD_OFF
             : strcmp(name, "hardware-fold256") == 0 ? FOLD_256 : -1;
    if (fold >= 0) {
        if (!hw_available) {
            PyErr_SetString(PyExc_RuntimeError, "this CPU has no CRC32C instruction (SSE4.2 / ARMv8 CRC)");
            return NULL;
        }
        if (fold == FOLD_256 && !FOLD256_AVAILABLE) {
            PyErr_SetString(PyExc_RuntimeError, "crc backend 'hardware-fold256': this CPU has no AVX2 with VPCLMULQDQ (or its OS has not enabled the AVX registers)");
            return NULL;
        }
        crc_backend = BACKEND_HW;
        crc_fold = fold;
    } else if (strcmp(name, "python") == 0) {
        crc_backend = BACKEND_PY;
    } else {
        PyErr_Format(PyExc_ValueError, "crc backend %R: expected 'hardware', 'hardware-streams', 'hardware-fold256' or 'python'", arg);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *fc_crc_backend(PyObject *self, PyObject *noargs) {
    if (crc_backend != BACKEND_HW) return PyUnicode_FromString("python");
    return PyUnicode_FromString(crc_fold == FOLD_BEST ? "hardware" : crc_fold == FOLD_256 ? "hardware-fold256" : "hardware-streams");
}

/* zstd_version() -> int | None: the version of the libzstd the walk decompresses batches with (e.g. 10504), None without one. */
static PyObject *fc_zstd_version(PyObject *self, PyObject *noargs) {
    if (zstd.version == 0) Py_RETURN_NONE;
    return PyLong_FromUnsignedLong(zstd.version);
}

/* ------------------------------------------------------------------ Bloom filter probes */

/* bloom_probe(bits, m, h1, h2, k, set) -> bool

   The k bit probes of the reducers' id filter (reducers.lifecycle.IdFilter) in
   one call: bits (h1 + i*h2) mod m for i < k, bit b at byte b >> 3, mask
   1 << (b & 7). Returns whether every one was set; with ``set`` (a writable
   buffer), sets them all too. Exactly the Python loop's positions: h1 and h2
   are < 2**64, and (h1 + i*h2) mod m is walked as a + i*b with a = h1 mod m,
   b = h2 mod m, each step reduced once (a, b < m < 2**63: no overflow). */
static PyObject *fc_bloom_probe(PyObject *self, PyObject *args) {
    PyObject *bits_obj, *h1_obj, *h2_obj;
    unsigned long long m;
    int k, set;
    if (!PyArg_ParseTuple(args, "OKOOip:bloom_probe", &bits_obj, &m, &h1_obj, &h2_obj, &k, &set)) return NULL;
    unsigned long long h1 = PyLong_AsUnsignedLongLong(h1_obj);
    if (h1 == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    unsigned long long h2 = PyLong_AsUnsignedLongLong(h2_obj);
    if (h2 == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(bits_obj, &view, set ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return NULL;
    if (m == 0 || m > (1ULL << 62) || m > (unsigned long long)view.len * 8 || k < 0) {
        PyErr_Format(PyExc_ValueError, "bloom_probe: %llu bits over a %zd-byte array with %d probes: expected 0 < bits <= 8 * bytes "
                     "and probes >= 0", m, view.len, k);
        PyBuffer_Release(&view);
        return NULL;
    }
    uint8_t *bytes = (uint8_t *)view.buf;
    unsigned long long idx = h1 % m, step = h2 % m;
    int all = 1;
    for (int i = 0; i < k; i++) {
        uint8_t mask = (uint8_t)(1u << (idx & 7));
        if (!(bytes[idx >> 3] & mask)) {
            all = 0;
            if (!set) break;
            bytes[idx >> 3] |= mask;
        }
        idx += step;
        if (idx >= m) idx -= m;
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(all);
}

/* recovery_note(frames, entries, last_off, every, state, terminal) -> last_off: crash recovery's
   per-frame step (events/log/recovery.py, whose note_frames is the same loop in Python) over one list
   or tuple of frames as the scanner builds them, each a tuple of 8 (frame_at, end, lsn, seq, ts_ns,
   flags, session_id, payload) with offsets in [0, 2**63):
   - when frame_at is ``every`` bytes or more past ``last_off``, append (lsn, frame_at) to ``entries``
     (the segment's sparse index) and move ``last_off`` there;
   - a terminal frame (flags & terminal) removes its session from ``state`` (none there: nothing to
     remove, as dict.pop(sid, None)); any other sets state[session_id] = seq + 1 (its next session_seq).
   Returns the new last_off. ``entries`` must be a list and ``state`` a dict (not subclasses: their
   overridden methods would be bypassed); anything else, a frame that is not such a tuple, or an offset
   out of range raises TypeError, ValueError or OverflowError, as the Python loop would raise or
   never be given. The frames are walked from a tuple of them (the very one, or a copy of the list),
   so code a session id's hash or comparison runs cannot change what is walked. */
static PyObject *fc_recovery_note(PyObject *self, PyObject *args) {
    PyObject *frames_obj, *entries, *state;
    long long last_off, every;
    unsigned long long terminal;
    if (!PyArg_ParseTuple(args, "OOLLOK:recovery_note", &frames_obj, &entries, &last_off, &every, &state, &terminal))
        return NULL;
    if (!PyList_Check(frames_obj) && !PyTuple_Check(frames_obj)) {
        PyErr_Format(PyExc_TypeError, "recovery_note: frames is a %.100s, expected a list or tuple of frames",
                     Py_TYPE(frames_obj)->tp_name);
        return NULL;
    }
    if (!PyList_CheckExact(entries) || !PyDict_CheckExact(state)) {
        PyErr_Format(PyExc_TypeError, "recovery_note: entries is a %.100s and state a %.100s, expected a list and a dict",
                     Py_TYPE(entries)->tp_name, Py_TYPE(state)->tp_name);
        return NULL;
    }
    if (last_off < 0 || every < 0) {
        PyErr_Format(PyExc_ValueError, "recovery_note: last_off %lld and every %lld, expected offsets >= 0", last_off, every);
        return NULL;
    }
    PyObject *frames = PySequence_Tuple(frames_obj); /* a tuple: the same one, or the list's items copied */
    if (frames == NULL) return NULL;
    PyObject *one = PyLong_FromLong(1);
    if (one == NULL) goto fail;
    Py_ssize_t n = PyTuple_GET_SIZE(frames);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *fr = PyTuple_GET_ITEM(frames, i); /* held by ``frames``; its items by the frame, a tuple */
        if (!PyTuple_Check(fr) || PyTuple_GET_SIZE(fr) != 8) {
            PyErr_Format(PyExc_TypeError, "recovery_note: frames[%zd] is a %.100s, expected a frame tuple of 8 "
                         "(frame_at, end, lsn, seq, ts_ns, flags, session_id, payload)", i, Py_TYPE(fr)->tp_name);
            goto fail;
        }
        long long at = PyLong_AsLongLong(PyTuple_GET_ITEM(fr, 0));
        if (at == -1 && PyErr_Occurred()) goto fail;
        if (at < 0) {
            PyErr_Format(PyExc_ValueError, "recovery_note: frames[%zd] is at offset %lld, expected an offset >= 0", i, at);
            goto fail;
        }
        if (at - last_off >= every) { /* both in [0, 2**63): no overflow */
            PyObject *entry = PyTuple_Pack(2, PyTuple_GET_ITEM(fr, 2), PyTuple_GET_ITEM(fr, 0));
            if (entry == NULL) goto fail;
            int added = PyList_Append(entries, entry);
            Py_DECREF(entry);
            if (added < 0) goto fail;
            last_off = at;
        }
        unsigned long long flags = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(fr, 5));
        if (flags == (unsigned long long)-1 && PyErr_Occurred()) goto fail;
        PyObject *sid = PyTuple_GET_ITEM(fr, 6);
        if (flags & terminal) {
            PyObject *held = PyDict_GetItemWithError(state, sid);
            if (held == NULL ? PyErr_Occurred() != NULL : PyDict_DelItem(state, sid) < 0) goto fail;
        } else {
            PyObject *next = PyNumber_Add(PyTuple_GET_ITEM(fr, 3), one);
            if (next == NULL) goto fail;
            int set = PyDict_SetItem(state, sid, next);
            Py_DECREF(next);
            if (set < 0) goto fail;
        }
    }
    Py_DECREF(one);
    Py_DECREF(frames);
    return PyLong_FromLongLong(last_off);
fail:
    Py_XDECREF(one);
    Py_DECREF(frames);
    return NULL;
}

static PyMethodDef methods[] = {
    {"scan", fc_scan, METH_VARARGS, "Walk the frames wholly inside a buffer (see the C source)."},
    {"scan_mapped", fc_scan_mapped, METH_VARARGS, "scan() over a memory-mapped segment, safe if the file shrinks."},
    {"scan_batch", fc_scan_batch, METH_VARARGS, "The frames of a decompressed batch, last first (see the C source)."},
    {"encode_frame", fc_encode_frame, METH_VARARGS, "One framed record (or its prefix, with prefix_only)."},
    {"encode_batch", fc_encode_batch, METH_VARARGS, "Frames of a batch in one buffer, with their ends."},
    {"encode_columns", fc_encode_columns, METH_VARARGS, "encode_batch over four lists: sids, seqs, flags, payloads."},
    {"crc32c", fc_crc32c, METH_VARARGS, "google_crc32c.extend(crc, data) through the selected backend."},
    {"set_crc_backend", fc_set_crc_backend, METH_O, "'hardware' (the CPU's fastest: folding, else the instruction), 'hardware-streams' (the instruction only), 'hardware-fold256' (folding on 256-bit registers) or 'python' (google_crc32c)."},
    {"crc_backend", fc_crc_backend, METH_NOARGS, "The CRC32C backend in use."},
    {"recovery_note", fc_recovery_note, METH_VARARGS, "Crash recovery's per-frame step over a list of frames (see the C source)."},
    {"bloom_probe", fc_bloom_probe, METH_VARARGS, "The id filter's k bit probes (see the C source): all set?, setting them with set."},
    {"zstd_version", fc_zstd_version, METH_NOARGS, "The libzstd MappedScan decompresses batches with (its version number), or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_framecodec", "The compiled frame codec of the file log.", -1,
                                       methods};


PyMODINIT_FUNC PyInit__framecodec(void) {
    PyObject *crcmod = PyImport_ImportModule("google_crc32c");
    if (crcmod == NULL) return NULL;
    py_extend = PyObject_GetAttrString(crcmod, "extend");
    Py_DECREF(crcmod);
    if (py_extend == NULL) return NULL;
    hw_available = detect_hw();
    crc_backend = hw_available ? BACKEND_HW : BACKEND_PY;
    if (PyType_Ready(&MappedScanType) < 0 || PyType_Ready(&BatchBytesType) < 0) return NULL;
    zstd_load();
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    Py_INCREF(&MappedScanType);
    if (PyModule_AddObject(m, "MappedScan", (PyObject *)&MappedScanType) < 0) {
        Py_DECREF(&MappedScanType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "HW_AVAILABLE", hw_available) < 0 ||
        PyModule_AddIntConstant(m, "FOLD256_AVAILABLE", FOLD256_AVAILABLE) < 0 || PyModule_AddIntConstant(m, "NEED", SCAN_NEED) < 0 ||
        PyModule_AddIntConstant(m, "LIMIT", SCAN_LIMIT) < 0 || PyModule_AddIntConstant(m, "EOF", SCAN_EOF) < 0 ||
        PyModule_AddIntConstant(m, "BAD", SCAN_BAD) < 0 || PyModule_AddIntConstant(m, "MORE", SCAN_MORE) < 0 ||
        PyModule_AddIntConstant(m, "SHRANK", SCAN_SHRANK) < 0 ||
        /* framecodec.API: raised with every change to what this module exports (a stale build is then not used). */
        PyModule_AddIntConstant(m, "API", 7) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
