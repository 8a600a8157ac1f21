"""The lean pipelined forward's addresses (src/ops/attention/cuda_forward_pipelined.cuh,
kLean) replayed on the cpu against those of the forward before it: each lane's
ldmatrix row address of Q, K and V for every fragment (a lane base plus
`chunk_pair_offset`, an XOR with the chunk pair, instead of the swizzle
recomputed), and the cp.async destinations, source rows and zero-fill flags
of `load_tile_stepped` against `load_tile`, at head dims 64, 128 and 256 with
their tile shapes; and its softmax recurrence (a row's base moved only past
2^8, the accumulator rescaled only then) in float32 against the exact
softmax. No GPU is needed: this checks the algebra the kernel's expressions
encode (the GPU tests check the kernel)."""
import numpy as np
import pytest

ELEM = 2  # bytes of a bf16 / fp16 element
# (head dim, 16-row tiles per warp, keys per tile, threads) of PipelinedFwdConfig
SHAPES = [(64, 2, 64, 128), (128, 2, 32, 128), (256, 1, 32, 256)]


def swizzle(r, c, width):
    """Element offset of 16-byte chunk c of row r (the kernel's swizzle<DB>)."""
    return r * width + ((c ^ (r & 7)) << 3)


def chunk_pair_offset(lane_off, kk, shift=5):
    return lane_off ^ (kk << shift)


def lean_addresses(DB, MT, BN, NT, shift=5):
    """{(operand, warp, lane, indices): byte address} by the kLean formulas."""
    rb, out = DB * ELEM, {}
    for warp in range(NT // 32):
        for lane in range(32):
            q_row = warp * 16 * MT + (lane & 7) + ((lane >> 3) & 1) * 8
            q_lane, q_off = q_row * rb, ((lane >> 4) ^ (q_row & 7)) << 4
            k_lane, k_off = ((lane & 7) + (lane >> 4) * 8) * rb, (((lane >> 3) & 1) ^ (lane & 7)) << 4
            v_lane, v_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * rb, ((lane >> 4) ^ (lane & 7)) << 4
            for buf in (0, 1):
                for kk in range(DB // 16):
                    for mt in range(MT):
                        out["q", warp, lane, buf, kk, mt] = q_lane + 16 * mt * rb + chunk_pair_offset(q_off, kk, shift)
                    for n in range(BN // 16):
                        out["k", warp, lane, buf, kk, n] = (k_lane + (buf * BN + n * 16) * rb
                                                            + chunk_pair_offset(k_off, kk, shift))
                for kk in range(BN // 16):
                    for dp in range(DB // 16):
                        out["v", warp, lane, buf, kk, dp] = (v_lane + (buf * BN + kk * 16) * rb
                                                             + chunk_pair_offset(v_off, dp, shift))
    return out


def previous_addresses(DB, MT, BN, NT):
    """The same by the swizzle expressions of the forward before kLean."""
    out = {}
    for warp in range(NT // 32):
        for lane in range(32):
            q_row = warp * 16 * MT + (lane & 7) + ((lane >> 3) & 1) * 8
            for buf in (0, 1):
                for kk in range(DB // 16):
                    for mt in range(MT):
                        out["q", warp, lane, buf, kk, mt] = ELEM * swizzle(q_row + 16 * mt, 2 * kk + (lane >> 4), DB)
                    for n in range(BN // 16):
                        r, c = n * 16 + (lane & 7) + (lane >> 4) * 8, 2 * kk + ((lane >> 3) & 1)
                        out["k", warp, lane, buf, kk, n] = ELEM * (buf * BN * DB + swizzle(r, c, DB))
                for kk in range(BN // 16):
                    for dp in range(DB // 16):
                        r, c = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, 2 * dp + (lane >> 4)
                        out["v", warp, lane, buf, kk, dp] = ELEM * (buf * BN * DB + swizzle(r, c, DB))
    return out


def stepped_loads(DB, BN, NT, valid_rows, step_bytes=None):
    """Per thread, load_tile_stepped's (shared byte offset, (row, chunk) or None)."""
    chunks = DB // 8
    step = NT // chunks
    assert NT % chunks == 0 and step % 8 == 0 and BN % step == 0
    step_bytes = step * DB * ELEM if step_bytes is None else step_bytes
    loads = []
    for tid in range(NT):
        r0, c = tid // chunks, tid % chunks
        loads.append([(ELEM * swizzle(r0, c, DB) + it * step_bytes,
                       (r0 + it * step, c) if r0 + it * step < valid_rows else None)
                      for it in range(BN // step)])
    return loads


def tile_loads(DB, BN, NT, valid_rows):
    """The same for load_tile (round `it` takes chunk index tid + it * NT)."""
    chunks, loads = DB // 8, []
    for tid in range(NT):
        rounds = []
        for it in range(BN * chunks // NT):
            r, c = divmod(tid + it * NT, chunks)
            rounds.append((ELEM * swizzle(r, c, DB), (r, c) if r < valid_rows else None))
        loads.append(rounds)
    return loads


@pytest.mark.parametrize("DB,MT,BN,NT", SHAPES)
def test_lean_ldmatrix_addresses_match_the_swizzle(DB, MT, BN, NT):
    want = previous_addresses(DB, MT, BN, NT)
    assert lean_addresses(DB, MT, BN, NT) == want
    # a mutated offset (the chunk pair one chunk, not two, apart) must not match
    assert lean_addresses(DB, MT, BN, NT, shift=4) != want


@pytest.mark.parametrize("DB,MT,BN,NT", SHAPES)
def test_stepped_tile_loads_match_load_tile(DB, MT, BN, NT):
    for valid_rows in (1, 5, 8, 17, BN - 1, BN, BN + 3):
        want = tile_loads(DB, BN, NT, valid_rows)
        assert stepped_loads(DB, BN, NT, valid_rows) == want, valid_rows
        assert stepped_loads(DB, BN, NT, valid_rows, step_bytes=DB * ELEM) != want, valid_rows


def lean_softmax_rows(s, v, scale, tile, rescale_acc=True, P=np.float32):
    """The kLean recurrence per row over key tiles (float32 like the kernel;
    masked scores are -inf): raw max, base moved only when the tile's max
    passes it by more than 8 (log2), accumulator rescaled only then (not at
    all with rescale_acc=False, a mutation), p = 2^(s * scale * log2 e - base).
    Returns out, lse and the largest p."""
    c = P(scale * np.log2(np.e))
    rows, keys = s.shape
    base = np.full(rows, -np.inf, P)
    total = np.zeros(rows, P)
    acc = np.zeros((rows, v.shape[1]), P)
    p_max = P(0)
    for n0 in range(0, keys, tile):
        st = s[:, n0:n0 + tile].astype(P)
        tile_m = st.max(axis=1) * c
        new = np.where(tile_m > base + P(8), tile_m, base)
        b = np.where(new == -np.inf, P(0), new)
        with np.errstate(invalid="ignore"):
            factor = np.exp2(base - b)
        moved = new != base
        total *= factor
        if moved.any() and rescale_acc:  # the warp vote: rows that did not move have factor 1
            acc *= factor[:, None]
        base = new
        p = np.exp2(st * c - b[:, None])
        p_max = max(p_max, p.max())
        total += p.sum(axis=1)
        acc += p @ v[n0:n0 + tile].astype(P)
    out = np.where(total[:, None] > 0, acc / np.where(total > 0, total, 1)[:, None], 0)
    lse = np.where(total > 0, base * P(np.log(2)) + np.log(np.where(total > 0, total, 1)), -np.inf)
    return out, lse, p_max


@pytest.mark.parametrize("tile", [32, 64])
def test_stale_base_softmax_matches_the_exact_one(tile):
    """Rows with growing scores (the base moves several times), a row whose
    first visible key comes late, a fully masked row and plain random rows,
    against the float64 softmax: out and lse agree to float32 rounding."""
    rng = np.random.default_rng(tile)
    rows, keys, d = 6, 300, 16
    s = rng.standard_normal((rows, keys)) * 3
    s[0] += np.linspace(0, 60, keys)          # the max keeps climbing
    s[1, :170] = -np.inf                       # nothing visible until key 170
    s[2, :] = -np.inf                          # no visible key
    s[3, 250] = 40.0                           # one late outlier
    v = rng.standard_normal((keys, d))
    scale = 0.7
    out, lse, p_max = lean_softmax_rows(s, v, scale, tile)
    assert p_max <= 2.0 ** 8 * (1 + 1e-6)
    with np.errstate(invalid="ignore"):
        m = np.max(s, axis=1, keepdims=True)
        w = np.exp((s - m) * scale)
    for r in range(rows):
        if np.isneginf(m[r, 0]):
            assert np.all(out[r] == 0) and lse[r] == -np.inf
            continue
        want = w[r] @ v / w[r].sum()
        want_lse = m[r, 0] * scale + np.log(w[r].sum())
        assert np.abs(out[r] - want).max() < 1e-5 * max(1.0, np.abs(want).max()), r
        assert abs(lse[r] - want_lse) < 1e-5 * max(1.0, abs(want_lse)), r
    # without the accumulator's rescale the climbing row must come out wrong
    bad, _, _ = lean_softmax_rows(s, v, scale, tile, rescale_acc=False)
    assert np.abs(bad[0] - out[0]).max() > 1e-2
