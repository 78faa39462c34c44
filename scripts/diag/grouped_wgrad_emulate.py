#!/usr/bin/env python3
# Byte-level host emulation of src/kernels/hopper/grouped_wgrad_wgmma.cu's index math for one block
# tile (M = 256, N = 512 with padded strides; block tile m 1, n 1; 150 rows: two full K steps and a
# 22-row tail): the producer's load_rows_sw128_producer into a NaN-initialised shared-memory image
# with the 128-byte swizzle applied, the consumers' MN-major descriptors read back through the
# canonical layout ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)) (the formula test_wgmma's sw128 placement
# verified on the H200 for B), summed as the wgmmas would, against numpy's A^T B. It checks our
# indexing against our reading of the ISA, not the hardware (imm-trans-a for A is assumed to read
# A exactly as MN-major B is read). Swapping B's LBO/SBO or misplacing warpgroup 1's A half makes
# it fail. Needs numpy; ~10 s.
import numpy as np
rng = np.random.default_rng(0)
M, N, rows, lda, ldb = 256, 512, 150, 264, 520
m0, n0 = 128, 256          # the block tile (m tile 1, n tile 1)
A = rng.standard_normal((rows, lda)).astype(np.float32)
B = rng.standard_normal((rows, ldb)).astype(np.float32)
kBK, kHalf, kATile = 64, 64 * 128, 64 * 128 * 2

def swz(x):  # physical = logical ^ (((logical >> 7) & 7) << 4)
    return x ^ (((x >> 7) & 7) << 4)

def loader(smem, tile, mat, col0, row0, row_end, ROWS=64):
    # load_rows_sw128_producer: thread tid copies chunk tid%8 of rows 16i + tid/8, both halves
    for tid in range(128):
        chunk, row = tid & 7, tid >> 3
        dst = tile + row * 128 + ((chunk ^ (row & 7)) << 4)
        r = row0 + row
        for i in range(ROWS // 16):
            for h in range(2):
                d = dst + h * ROWS * 128
                vals = mat[r, col0 + 64 * h + chunk * 8: col0 + 64 * h + chunk * 8 + 8] if r < row_end else np.zeros(8, np.float32)
                smem[d // 2: d // 2 + 8] = vals   # store as "elements" at byte offset d (2 bytes each)
            r += 16
            dst += 16 * 128

def read_mn(smem, start, lbo, sbo, mn, k):
    # MN-major SW128 canonical: ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)) in 16-byte units
    logical = start + (mn // 64) * lbo + (k // 8) * sbo + (k % 8) * 128 + (mn % 64) * 2
    phys_chunk = swz(logical & ~15)   # the 16-byte chunk is swizzled, bytes inside kept
    return smem[(phys_chunk + (logical & 15)) // 2]

C = np.zeros((128, 256), np.float64)
smem = np.full(4 * (kATile + 64 * 256 * 2) // 2, np.nan, np.float32)  # stage images (element view)
for k0 in range(0, rows, kBK):
    st = 0
    smem[:] = np.nan
    loader(smem, st, A, m0, k0, rows)
    loader(smem, st + kATile, B, n0, k0, rows)
    loader(smem, st + kATile + 2 * kHalf, B, n0 + 128, k0, rows)
    for wg in range(2):
        a_st = st + wg * kHalf
        b_st = st + kATile
        for kk in range(4):
            for m in range(64):
                for k in range(16):
                    av = read_mn(smem, a_st + kk * 2048, kHalf, 1024, m, k)
                    if np.isnan(av): raise SystemExit(f"A read of unwritten smem m={m} k={k}")
                    for half in range(2):
                        bst = b_st + half * 2 * kHalf + kk * 2048
                        bvec = np.array([read_mn(smem, bst, kHalf, 1024, n, k) for n in range(128)])
                        if np.isnan(bvec).any(): raise SystemExit("B read of unwritten smem")
                        C[64 * wg + m, 128 * half: 128 * half + 128] += av * bvec
want = A[:, m0:m0 + 128].astype(np.float64).T @ B[:, n0:n0 + 256].astype(np.float64)
err, scale = np.abs(C - want).max(), np.abs(want).max()
print(("PASS" if err < 1e-4 * scale else "FAIL") + f": max abs err {err:.3g}, largest |C| {scale:.3g}")
raise SystemExit(0 if err < 1e-4 * scale else 1)
