"""Float64 replay of one CTA of the keys-major decode attention kernel
(keys_major_kernel in src/ops/attention/decode_cuda.cu), lane by lane.

Every index formula of the kernel that places data is written here as in the
kernel: the chunk -> (row, column) map of the cp.async issue, the ldmatrix
lane addresses of K (A operand of S^T = K Q^T) and V^T (.trans, A operand of
O^T += V^T P^T), the Q^T B fragments, the m16n8k16 A/B/C layouts, the
movmatrix transpose of P^T, the per-column maximum over lanes of one t, the
edge masks, and the cross-warp merge through shared memory (whose stores are
checked free of bank conflicts). The replay walks
a few tiles of one split (edges inside the first and last tile, a window, 4
real query vectors of 8) and compares with softmax(q k^T) v in float64.

The order of its pipeline (row-address slots, cp.async stages and groups,
barriers) is replayed too, for 3 and 4 stages.

    python bench/decode_fragment_replay.py              # replay; then every mutation must fail
    python bench/decode_fragment_replay.py --mutate k_lane
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

MUTATIONS = ("k_lane", "v_lane", "no_movmatrix", "q_frag", "max_lanes", "merge_index",
             "issue_rows", "logit_key", "block_vector", "issue_unswizzled", "read_unswizzled",
             "sum_rescale")


def tile_offset(DB, row, chunk, swizzled=True):
    """KeysMajor::offset: element offset of 16-byte chunk `chunk` of K or V tile
    row `row`: packed rows with the chunk XOR-swizzled by the row's low three
    bits from head dim 64 on, else rows padded to DB + 8."""
    if DB >= 64:
        return row * DB + ((chunk ^ (row & 7)) if swizzled else chunk) * 8
    return row * (DB + 8) + chunk * 8


def ldmatrix_conflicts(addrs):
    """The most row addresses of one 8x8 matrix (8 lanes) that fall in the same
    16-byte group of banks (elements of 2 bytes): 1 is conflict-free."""
    worst = 1
    for m in range(4):
        groups = [(addrs[8 * m + r] * 2 // 16) % 8 for r in range(8)]
        worst = max(worst, max(groups.count(x) for x in groups))
    return worst


def copy_wavefronts(dsts):
    """Shared-memory wavefronts of one warp's 16-byte copies (element offsets):
    the most chunks on one 16-byte group of banks."""
    groups = [(x * 2 // 16) % 8 for x in dsts]
    return max(groups.count(x) for x in groups)
PIPELINE_MUTATIONS = ("store_slot", "issue_stage", "wait_depth")


def merge_store_conflicts(DB, acc_ld, NB=1):
    """The most lanes of one warp that share a shared-memory bank in one of the
    merge's s_acc stores (row 8 n + 2 t + h, column mt * 16 + g (+ 8); 4-byte
    words): 1 is conflict-free."""
    worst = 1
    for n in range(NB):
        for h in range(2):
            for mt in range(DB // 16):
                for half in (0, 8):
                    banks = [((8 * n + 2 * (lane & 3) + h) * acc_ld + mt * 16 + (lane >> 2) + half) % 32
                             for lane in range(32)]
                    worst = max(worst, max(banks.count(x) for x in set(banks)))
    return worst


def pipeline(stages, n_tiles, mut=None):
    """The kernel's order of row-slot writes (store_row), copies (issue) and
    reads (the tile's products) between barriers, replayed for n_tiles tiles:
    the problems found (a slot or stage read while another tile's data is in
    it, or written in the segment where another warp reads it)."""
    S = stages
    slot = [None] * S        # tile whose row addresses the slot holds
    stage = [None] * S       # tile whose copies the stage holds
    landed = set()           # copy groups complete (group = tile issued)
    issued = []              # tiles in commit order (one group each)
    problems = []
    segment = {"read_slots": set(), "written_slots": set(), "read_stages": set(), "written_stages": set()}

    def barrier():
        for k in segment:
            segment[k] = set()

    def store_row(tile, sl):
        if sl in segment["read_slots"]:
            problems.append(f"slot {sl} written in the segment it is read (tile {tile})")
        slot[sl] = tile
        segment["written_slots"].add(sl)

    def issue(tile, st):
        if tile < n_tiles:
            if st in segment["read_stages"]:
                problems.append(f"stage {st} overwritten in the segment it is read (tile {tile})")
            if slot[st] != tile:   # the kernel reads row_src[stage]
                problems.append(f"tile {tile} issued from the row slot of tile {slot[st]}")
            if st in segment["written_slots"]:
                problems.append(f"slot {st} read in the segment it is written (tile {tile})")
            segment["read_slots"].add(st)
            stage[st] = tile
            segment["written_stages"].add(st)
        issued.append(tile)

    def wait(pending):
        done = issued[:max(0, len(issued) - pending)]
        landed.update(done)

    for s_ in range(S):                                  # store_row(s, s, ids[s])
        store_row(s_, (s_ + 1) % S if mut == "store_slot" else s_)
    barrier()
    for s_ in range(S - 1):
        issue(s_, s_)
    st = 0
    for tile in range(n_tiles):
        wait(S - 1 if mut == "wait_depth" else S - 2)
        barrier()
        write = (st - 1) % S if mut != "issue_stage" else st
        issue(tile + S - 1, write)
        store_row(tile + S, (st + 1) % S if mut == "store_slot" else st)
        if stage[st] != tile or tile not in landed:
            problems.append(f"tile {tile} computed from stage {st} holding tile {stage[st]}"
                            f"{'' if tile in landed else ' before its copies landed'}")
        segment["read_stages"].add(st)
        st = st + 1 if st + 1 < S else 0
    return problems


def ldmatrix_x4(smem, addr, trans):
    """Per lane 4 registers of 2 elements: lane i gives the row address of
    matrix i // 8, row i % 8; thread (g, t) receives row g, columns 2t, 2t+1
    of each matrix (of its transpose with .trans)."""
    mats = [np.stack([smem[addr[8 * m + r]:addr[8 * m + r] + 8] for r in range(8)]) for m in range(4)]
    if trans:
        mats = [x.T for x in mats]
    return [[(mats[m][lane >> 2, 2 * (lane & 3)], mats[m][lane >> 2, 2 * (lane & 3) + 1]) for m in range(4)]
            for lane in range(32)]


def movmatrix(frag):
    """frag[lane] = (M[g][2t], M[g][2t+1]) -> the same layout of M^T."""
    m = np.zeros((8, 8))
    for lane in range(32):
        m[lane >> 2, 2 * (lane & 3)], m[lane >> 2, 2 * (lane & 3) + 1] = frag[lane]
    m = m.T
    return [(m[lane >> 2, 2 * (lane & 3)], m[lane >> 2, 2 * (lane & 3) + 1]) for lane in range(32)]


def mma(c, a, b):
    """D (16x8) += A (16x16) B (16x8) from per-lane fragments (cuda_common.cuh layout)."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for h, (r, k) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            A[r, k], A[r, k + 1] = a[lane][h]
        B[2 * t, g], B[2 * t + 1, g] = b[lane][0]
        B[2 * t + 8, g], B[2 * t + 9, g] = b[lane][1]
    D = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c[lane] += np.array([D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]])


def replay(mut=None, DB=128, d=128, warps=8, NB=1, sq=1, seed=0, spread=1.0):
    """Max |error| of one CTA's outputs (NB n8 blocks of query vectors, sq
    query rows of GQA group 4, causal with a left window) against float64;
    `spread` scales the queries (logits of standard deviation `spread`), so
    that running maxima move by large steps and a missed rescale shows."""
    rng = np.random.default_rng(seed)
    NV, TN, LD, NT = 8 * NB, 16 * warps, DB + 8, 32 * warps
    group = 4
    n_vec = min(sq * group, NV)
    sk = 5 * TN - 37                          # keys in the cache
    k_lo, k_hi = 19, sk                       # the split's keys: edges inside the first and last tile
    win_left = sk - 3 * TN                    # a window: one more edge for every vector
    K = rng.standard_normal((sk, d))
    V = rng.standard_normal((sk, d))
    Q = rng.standard_normal((NV, d)) * spread
    Q[n_vec:] = 0.0                           # vectors past n_vec are zero (never written)
    scale = d ** -0.5

    def visible(vec):                         # causal, window (win_left, 0): detail::visible_keys
        diag = vec // group + sk - sq
        return max(0, diag - win_left), min(sk, diag + 1)

    sQ = np.zeros(NV * LD)
    for v in range(NV):
        sQ[v * LD:v * LD + d] = Q[v]
    t_begin = k_lo // TN * TN
    n_tiles = (k_hi - t_begin + TN - 1) // TN
    open_lo = max(visible(v)[0] for v in range(n_vec))
    open_hi = min(visible(v)[1] for v in range(n_vec))

    # Q^T as the B operand: load_b(q_frag[n][kk], sQ, LD, 8 n, kk * 16, lane).
    q_frag = [[None] * (DB // 16) for _ in range(NB)]
    for n in range(NB):
        for kk in range(DB // 16):
            per_lane = []
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                if mut == "q_frag":
                    g, t = t, g
                row, col = 8 * n + g, kk * 16 + 2 * t
                per_lane.append(((sQ[row * LD + col], sQ[row * LD + col + 1]),
                                 (sQ[row * LD + col + 8], sQ[row * LD + col + 9])))
            q_frag[n][kk] = per_lane

    def vector(n, t, h):                      # the CTA vector of a thread's u = 2 n + h
        return 8 * n + 2 * t + h if mut != "block_vector" else 2 * t + h + 8 * (1 - n) * (NB - 1)

    acc = [[[[np.zeros(4) for _ in range(DB // 16)] for _ in range(32)] for _ in range(NB)]
           for _ in range(warps)]             # [warp][n][lane][mt]
    row_max = np.full((warps, 32, 2 * NB), -np.inf)
    row_sum = np.zeros((warps, 32, 2 * NB))
    RE = DB if DB >= 64 else DB + 8           # KeysMajor::kRowElems
    for tile in range(n_tiles):
        # The issue: thread tid copies chunk `chunk` of rows chunk_row0 + r * kRowStride
        # to KeysMajor::offset(row, chunk).
        sK = np.full(TN * RE, np.nan)
        sV = np.full(TN * RE, np.nan)
        row_stride = NT // (DB // 8)
        dsts = {}                              # (warp, r) -> element offsets of its 32 copies
        for tid in range(NT):
            chunk_row0, chunk = tid // (DB // 8), tid % (DB // 8)
            if mut == "issue_rows":
                chunk_row0 = tid % row_stride
            for r in range(TN * DB // 8 // NT):
                row = chunk_row0 + r * row_stride
                at = tile_offset(DB, row, chunk, swizzled=mut != "issue_unswizzled")
                dsts.setdefault((tid // 32, r), []).append(at)
                j = t_begin + tile * TN + row
                real = k_lo <= j < k_hi
                for i in range(8):
                    c = chunk * 8 + i
                    ok = real and c < d
                    sK[at + i] = K[j, c] if ok else 0.0
                    sV[at + i] = V[j, c] if ok else 0.0
        if tile == 0 and mut is None:
            worst = max(copy_wavefronts(x) for x in dsts.values())
            if worst != 4:
                raise AssertionError(f"copies of one warp take {worst} wavefronts (4 ideal) at DB {DB}")
        for warp in range(warps):
            j0 = t_begin + tile * TN + warp * 16
            # ldmatrix rows and chunks of each lane (k_row, k_chunk; v_row, v_chunk),
            # the chunk of block kk (mt) being 2 kk + the lane's.
            k_rc, v_rc = [], []
            for lane in range(32):
                k_row, k_chunk = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4
                v_row, v_chunk = warp * 16 + (lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1
                if mut == "k_lane":
                    k_row, k_chunk = warp * 16 + (lane & 7) + (lane >> 4) * 8, (lane >> 3) & 1
                if mut == "v_lane":
                    v_row, v_chunk = warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), lane >> 4
                k_rc.append((k_row, k_chunk))
                v_rc.append((v_row, v_chunk))
            swz = mut != "read_unswizzled"

            def lane_addrs(rc, kk):
                return [tile_offset(DB, row, 2 * kk + c, swz) for row, c in rc]

            if tile == 0 and mut is None:
                worst = max(ldmatrix_conflicts(lane_addrs(rc, kk)) for rc in (k_rc, v_rc)
                            for kk in range(DB // 16))
                if worst != 1:
                    raise AssertionError(f"ldmatrix reads {worst}-way conflicted at DB {DB}")
            s = [[np.zeros(4) for _ in range(32)] for _ in range(NB)]
            s_odd = [[np.zeros(4) for _ in range(32)] for _ in range(NB)]
            for kk in range(DB // 16):
                a = ldmatrix_x4(sK, lane_addrs(k_rc, kk), trans=False)
                for n in range(NB):
                    mma(s_odd[n] if kk & 1 else s[n], a, q_frag[n][kk])
            x = np.zeros((NB, 32, 4))
            for n in range(NB):
                for lane in range(32):
                    for e in range(4):
                        x[n, lane, e] = (s[n][lane][e] + s_odd[n][lane][e]) * scale
            inside = j0 >= k_lo and j0 + 16 <= k_hi and j0 >= open_lo and j0 + 16 <= open_hi
            if not inside:
                for n in range(NB):
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        for e in range(4):
                            j = j0 + g + 8 * (e >> 1)
                            if mut == "logit_key":
                                j = j0 + 2 * t + (e & 1) + 8 * (e >> 1)
                            vec = vector(n, t, e & 1)
                            lo, hi = visible(vec) if vec < n_vec else (0, 0)
                            if j < k_lo or j >= k_hi or j < lo or j >= hi:
                                x[n, lane, e] = -np.inf
            rescale = np.zeros((32, 2 * NB))
            base = np.zeros((32, 2 * NB))
            for u in range(2 * NB):
                n, h = u >> 1, u & 1
                m = np.maximum(x[n, :, h], x[n, :, h + 2])
                for off in ((4, 8, 16) if mut != "max_lanes" else (1, 2, 16)):
                    m = np.maximum(m, m[np.arange(32) ^ off])
                for lane in range(32):
                    old = row_max[warp, lane, u]
                    m_new = max(old, m[lane])
                    rescale[lane, u] = 0.0 if old == -np.inf else np.exp(old - m_new)
                    base[lane, u] = 0.0 if m_new == -np.inf else m_new
                    row_max[warp, lane, u] = m_new
                    if mut != "sum_rescale":
                        row_sum[warp, lane, u] *= rescale[lane, u]
            for n in range(NB):
                for lane in range(32):
                    for mt in range(DB // 16):
                        acc[warp][n][lane][mt] *= rescale[lane, [2 * n, 2 * n + 1, 2 * n, 2 * n + 1]]
            pb = []
            for n in range(NB):
                p = np.zeros((32, 4))
                for lane in range(32):
                    for e in range(4):
                        u = 2 * n + (e & 1)
                        p[lane, e] = np.exp(x[n, lane, e] - base[lane, u])
                        row_sum[warp, lane, u] += p[lane, e]
                lo_half = [(p[lane, 0], p[lane, 1]) for lane in range(32)]
                hi_half = [(p[lane, 2], p[lane, 3]) for lane in range(32)]
                if mut != "no_movmatrix":
                    lo_half, hi_half = movmatrix(lo_half), movmatrix(hi_half)
                pb.append([(lo_half[lane], hi_half[lane]) for lane in range(32)])
            for mt in range(DB // 16):
                a = ldmatrix_x4(sV, lane_addrs(v_rc, mt), trans=True)
                for n in range(NB):
                    mma([acc[warp][n][lane][mt] for lane in range(32)], a, pb[n])

    # The merge through shared memory, as the kernel indexes it (rows of
    # ACC_LD = DB + 4 floats; the warps' weights once per vector, in place of
    # s_max; then each element a sum of weighted rows).
    ACC_LD = DB + 4
    s_acc = np.full(warps * NV * ACC_LD, np.nan)
    s_max = np.full(warps * NV, np.nan)
    s_sum = np.full(warps * NV, np.nan)
    for warp in range(warps):
        for u in range(2 * NB):
            n, h = u >> 1, u & 1
            tot = row_sum[warp, :, u].copy()
            for off in (4, 8, 16):
                tot = tot + tot[np.arange(32) ^ off]
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                r = vector(n, t, h)
                for mt in range(DB // 16):
                    gg = t if mut == "merge_index" else g
                    s_acc[(warp * NV + r) * ACC_LD + mt * 16 + gg] = acc[warp][n][lane][mt][h]
                    s_acc[(warp * NV + r) * ACC_LD + mt * 16 + gg + 8] = acc[warp][n][lane][mt][h + 2]
                if g == 0:
                    s_max[warp * NV + r] = row_max[warp, lane, u]
                    s_sum[warp * NV + r] = tot[lane]
    for m in range(NV):
        gmax = max(s_max[w * NV + m] for w in range(warps))
        f = [0.0 if s_max[w * NV + m] == -np.inf else np.exp(s_max[w * NV + m] - gmax) for w in range(warps)]
        tot = sum(s_sum[w * NV + m] * f[w] for w in range(warps))
        for w in range(warps):
            s_max[w * NV + m] = f[w] / tot if tot > 0 else 0.0
    out = np.full((NV, d), np.nan)
    for idx in range(NV * DB):
        m, c = idx // DB, idx % DB
        if m >= n_vec or c >= d:
            continue
        out[m, c] = sum(s_acc[(w * NV + m) * ACC_LD + c] * s_max[w * NV + m] for w in range(warps))

    errs = []  # np.max, not max(): a NaN (an element never written) must come through
    for vec in range(n_vec):
        lo, hi = visible(vec)
        keys = np.arange(max(lo, k_lo), min(hi, k_hi))
        logits = K[keys] @ Q[vec] * scale
        w = np.exp(logits - logits.max())
        ref = (w / w.sum()) @ V[keys]
        errs.append(np.abs(out[vec] - ref).max())
    return np.max(errs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mutate", choices=MUTATIONS)
    args = parser.parse_args()
    cases = [dict(DB=128, d=128, warps=8, NB=2, sq=3), dict(DB=128, d=128, warps=8),
             dict(DB=64, d=40, warps=8, NB=2, sq=5), dict(DB=256, d=256, warps=4, sq=2),
             dict(DB=128, d=96, warps=4), dict(DB=32, d=24, warps=8),
             dict(DB=128, d=128, warps=4, NB=2, sq=2, spread=8.0)]
    if args.mutate:
        err = replay(args.mutate, **(cases[-1] if args.mutate == "sum_rescale" else cases[0]))
        print(f"mutation {args.mutate}: max |err| {err:.3e}")
        return 0
    for c in cases:
        err = replay(None, **c)
        print(f"replay {c}: max |err| vs float64 reference {err:.3e}")
        if not err < 1e-12:
            print("FAILED")
            return 1
    for mut in MUTATIONS:
        err = replay(mut, **(cases[-1] if mut == "sum_rescale" else cases[0]))
        caught = not err < 1e-6  # NaN (an unwritten element read) counts as caught
        print(f"mutation {mut}: max |err| {err:.3e} -> {'caught' if caught else 'NOT CAUGHT'}")
        if not caught:
            return 1
    for S in (3, 4):
        for n in range(0, 9):
            found = pipeline(S, n)
            if found:
                print(f"pipeline, {S} stages, {n} tiles: {found[0]}")
                return 1
    print("pipeline: row slots, stages and copy groups in order for 3 and 4 stages, 0-8 tiles")
    for mut in PIPELINE_MUTATIONS:
        caught = bool(pipeline(3, 6, mut))
        print(f"pipeline mutation {mut}: {'caught' if caught else 'NOT CAUGHT'}")
        if not caught:
            return 1
    for DB in (32, 64, 128, 256):
        for NB in (1, 2):
            if merge_store_conflicts(DB, DB + 4, NB) != 1:
                print(f"merge stores: bank conflicts at head dim {DB}, {NB} n8 blocks")
                return 1
    print(f"merge stores: conflict-free with rows of DB + 4 floats (rows of DB: "
          f"{merge_store_conflicts(128, 128)}-way at head dim 128)")
    print("ok: the layouts replay exactly and every mutation is caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
