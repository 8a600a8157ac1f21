"""The fused dQ of the shared-fragment dK/dV kernel (head dims 64 and 128, no
logit features; src/ops/attention/cuda_backward_dkdv_shared.cuh, kFuseDq) replayed
in float64 on the cpu: the stores of dS^T from the S^T/dP^T accumulators into
the swizzled, double-buffered shared tile, the lanes' ldmatrix(.trans)
addresses on dS^T and K, the m16n8k16 A/B/C fragment layouts and the
addresses of the vector atomics into the fp32 workspace, for one CTA (128
keys, 8 warps) over several query tiles of two query heads, with a partial
key block and a partial last query tile. The result must equal dS K of every
tile; each layout mutated must not. No GPU is needed: this checks the index
algebra the kernel's expressions encode (the GPU tests check the kernel)."""
import numpy as np
import pytest

BN, BM = 128, 64   # keys per CTA, query rows per tile
HEAD_DIMS = [64, 128]
WARP_KEYS, WARP_ROWS = 32, BM // 2
DQ_ROWS = BM // 2   # the dQ warp grid: 2 x 4 of DQ_ROWS x head dim / 4
LANES = np.arange(32)
G, T = LANES >> 2, LANES & 3


def swizzle(r, c, width):
    """Element offset of 16-byte chunk c of row r in a swizzled tile (the
    kernel's swizzle<width>)."""
    return r * width + ((c ^ (r & 7)) << 3)


def ldsm_x4(smem, addr, trans):
    """ldmatrix.x4 (.trans): lane l gives the row address of row l & 7 of
    matrix l >> 3; returns (lane, register, half) of the 16-bit pairs."""
    m = smem[addr[:, None] + np.arange(8)].reshape(4, 8, 8)
    if trans:
        return np.stack([m[:, 2 * T, G], m[:, 2 * T + 1, G]], axis=-1).transpose(1, 0, 2)
    return np.stack([m[:, G, 2 * T], m[:, G, 2 * T + 1]], axis=-1).transpose(1, 0, 2)


def mma(c, a, b):
    """m16n8k16: c (lane, 4) += A (16 x 16, fragments a) B (16 x 8, b)."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for h in range(2):
        A[G, 2 * T + h] = a[:, 0, h]
        A[G + 8, 2 * T + h] = a[:, 1, h]
        A[G, 2 * T + 8 + h] = a[:, 2, h]
        A[G + 8, 2 * T + 8 + h] = a[:, 3, h]
        B[2 * T + h, G] = b[:, 0, h]
        B[2 * T + 8 + h, G] = b[:, 1, h]
    C = A @ B
    c[:, 0] += C[G, 2 * T]
    c[:, 1] += C[G, 2 * T + 1]
    c[:, 2] += C[G + 8, 2 * T]
    c[:, 3] += C[G + 8, 2 * T + 1]


def replay(ds_tiles, k_block, sq, heads, m_tiles, mutate=None):
    """The kernel's dQ path for one CTA (batch 0, kv head 0, key block n0 =
    0): `ds_tiles[it]` is dS of tile it (BM rows x BN keys; 0 past the
    sequence, as the kernel's P), k_block the CTA's K rows (zero past the
    keys; its width is the head dim DB). Returns the fp32 workspace (sq rows
    x heads x DB) as float64."""
    mutate = mutate or set()
    DB = k_block.shape[1]
    DQ_COLS = DB // 4
    sK = np.zeros(BN * DB)
    for r in range(BN):
        for c in range(DB // 8):
            sK[swizzle(r, c, DB) + np.arange(8)] = k_block[r, 8 * c:8 * c + 8]
    sdS = np.full(2 * BN * BM, np.nan)   # two buffers
    sr, sh = heads * DB, DB              # workspace strides (rows x heads x DB)
    accum = np.zeros(sq * heads * DB)
    # ldmatrix lane addresses, as in the kernel.
    b_row, b_chunk = (LANES & 7) + (LANES >> 4) * 8, (LANES >> 3) & 1
    bt_row, bt_chunk = (LANES & 7) + ((LANES >> 3) & 1) * 8, LANES >> 4
    if "dq_a_rows" in mutate:   # the A-fragment pattern instead of the B one
        b_row, b_chunk = bt_row, bt_chunk

    def store_ds(it, buf):
        """S^T/dP^T accumulators -> dS^T (keys x rows) of buffer buf: element
        e of tile (mt, nt) of warp (kg, half) is key key_row0 + 16 mt + g +
        8 (e >> 1), row q_row0 + 8 nt + 2 t + (e & 1)."""
        ds = ds_tiles[it]
        base = buf * BN * BM
        for warp in range(8):
            kg, half = warp % 4, warp // 4
            key_row0, q_row0 = kg * WARP_KEYS, half * WARP_ROWS
            for mt in range(WARP_KEYS // 16):
                for nt in range(WARP_ROWS // 8):
                    c = q_row0 + nt * 8 + 2 * T
                    row = key_row0 + mt * 16 + G
                    for e in range(4):
                        key = row + 8 * (e >> 1)
                        val = ds[c + (e & 1), key]
                        sdS[base + swizzle(key, c // 8, BM) + 2 * T + (e & 1)] = val

    def dq_product(done, buf):
        hq, m0 = done // m_tiles, (done % m_tiles) * BM
        base = buf * BN * BM
        for warp in range(8):
            kg, half = warp % 4, warp // 4
            q_row0, dq_chunk0 = half * WARP_ROWS, kg * (DQ_COLS // 8)
            acc = np.zeros((DQ_ROWS // 16, DQ_COLS // 8, 32, 4))
            for kk in range(BN // 16):
                da = [ldsm_x4(sdS, base + swizzle(kk * 16 + b_row, (q_row0 + rt * 16) // 8 + b_chunk, BM),
                              trans="dq_a_plain" not in mutate)
                      for rt in range(DQ_ROWS // 16)]
                for d2 in range(DQ_COLS // 16):
                    chunk = dq_chunk0 + 2 * d2 + bt_chunk
                    if "k_unswizzled" in mutate:
                        addr = (kk * 16 + bt_row) * DB + chunk * 8
                    else:
                        addr = swizzle(kk * 16 + bt_row, chunk, DB)
                    kf = ldsm_x4(sK, addr, trans=True)
                    for rt in range(DQ_ROWS // 16):
                        mma(acc[rt, 2 * d2], da[rt], kf[:, 0:2])
                        mma(acc[rt, 2 * d2 + 1], da[rt], kf[:, 2:4])
            # The atomics: red.global.add.v2.f32 of (c0, c1) at row g and of
            # (c2, c3) at row g + 8, columns 2 t, 2 t + 1 of each 8-column tile.
            col_t = 2 * T if "atomic_cols" not in mutate else T
            out = m0 * sr + hq * sh + dq_chunk0 * 8 + col_t
            for rt in range(DQ_ROWS // 16):
                r = q_row0 + rt * 16 + G
                for ct in range(DQ_COLS // 8):
                    for rr, e0 in ((r, 0), (r + 8, 2)):
                        ok = m0 + rr < sq
                        for h in range(2):
                            np.add.at(accum, (out + rr * sr + ct * 8 + h)[ok], acc[rt, ct][ok, e0 + h])

    # Between the tile's first barrier and the next one, some warps read the
    # previous tile's dS^T (dq_product) while others store this tile's: the
    # replay takes the adversarial order, stores first.
    n_tiles = len(ds_tiles)
    one = "single_buffer" in mutate
    for it in range(n_tiles):
        buf = 0 if one else it & 1
        store_ds(it, buf)
        if it > 0:
            dq_product(it - 1, buf if "same_buffer" in mutate or one else buf ^ 1)
    dq_product(n_tiles - 1, 0 if one else (n_tiles - 1) & 1)   # after a CTA barrier
    return accum.reshape(sq, heads, DB)


def make_case(seed, sq=150, cols=100, heads=2, DB=128):
    """dS of every (head, tile) (zero past sq or past the keys) and K."""
    rng = np.random.default_rng(seed)
    m_tiles = (sq + BM - 1) // BM
    k_block = np.zeros((BN, DB))
    k_block[:cols] = rng.standard_normal((cols, DB))
    ds_tiles = []
    for it in range(heads * m_tiles):
        m0 = (it % m_tiles) * BM
        ds = rng.standard_normal((BM, BN))
        ds[max(0, sq - m0):] = 0
        ds[:, cols:] = 0
        ds_tiles.append(ds)
    want = np.zeros((sq, heads, DB))
    for it, ds in enumerate(ds_tiles):
        hq, m0 = it // m_tiles, (it % m_tiles) * BM
        rows = min(BM, sq - m0)
        want[m0:m0 + rows, hq] = ds[:rows] @ k_block
    return ds_tiles, k_block, want, m_tiles


@pytest.mark.parametrize("DB", HEAD_DIMS)
@pytest.mark.parametrize("seed,sq,cols", [(0, 150, 100), (1, 64, 128), (2, 200, 7)])
def test_fused_dq_replay_equals_ds_k(seed, sq, cols, DB):
    ds_tiles, k_block, want, m_tiles = make_case(seed, sq, cols, DB=DB)
    got = replay(ds_tiles, k_block, sq, 2, m_tiles)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= 1e-12 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("DB", HEAD_DIMS)
@pytest.mark.parametrize("mutation", ["dq_a_rows", "dq_a_plain", "k_unswizzled", "atomic_cols",
                                      "same_buffer", "single_buffer"])
def test_fused_dq_replay_fails_when_a_layout_is_mutated(mutation, DB):
    """The check is sharp: each layout mutated (dS lane addresses, dS without
    .trans, K without the swizzle, the atomics' columns, reading the buffer
    being written, one dS^T buffer) gives a wrong dQ (or reads a NaN)."""
    ds_tiles, k_block, want, m_tiles = make_case(3, DB=DB)
    with np.errstate(invalid="ignore"):
        got = replay(ds_tiles, k_block, 150, 2, m_tiles, mutate={mutation})
    assert not (np.abs(got - want).max() <= 1e-6 * np.abs(want).max())
