"""Decode reference: cuDNN's fused attention reading the paged cache in place, next to
ours and torch SDPA over the cache gathered dense (which runs cuDNN's dense kernel).

Shows how much the paged layout itself costs a vendor kernel: the same cuDNN
graph over [num_blocks, block, Hkv, D] blocks through a page table, against
SDPA's dense [B, Hkv, L, D] copy. Shapes and timing as bench/attn_decode_bench.py.
Needs the cudnn-frontend Python package (`pip install nvidia-cudnn-frontend`).

    python bench/decode_cudnn_paged.py
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "bench")
from attn_decode_bench import BLOCK, gathered_head_major, graph_time_us, make_case  # noqa: E402

from symheap.attention import flash_attn_with_kvcache, kvcache_check  # noqa: E402

CASES = [(1, 1024), (1, 4096), (1, 8192), (1, 16384), (1, 65536), (1, 131072), (4, 1024), (4, 4096),
         (16, 1024), (16, 16384), (128, 1024)]


def cudnn_paged(cudnn, handle, q, k_cache, v_cache, table, seqlens):
    """A callable running cuDNN's SDPA over the paged cache, writing a fresh output."""
    B = q.shape[0]
    q_bhsd = q.permute(0, 2, 1, 3)
    out = torch.full_like(q, float("nan"))
    out_bhsd = out.permute(0, 2, 1, 3)
    k_blocks, v_blocks = k_cache.permute(0, 2, 1, 3), v_cache.permute(0, 2, 1, 3)  # [blocks, Hkv, BLOCK, D]
    pages = table.view(B, 1, table.shape[1], 1)
    len_q = torch.ones((B, 1, 1, 1), dtype=torch.int32, device=q.device)
    len_kv = seqlens.view(B, 1, 1, 1)
    io = cudnn.data_type.BFLOAT16 if q.dtype == torch.bfloat16 else cudnn.data_type.HALF
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    t_q, t_k, t_v = g.tensor_like(q_bhsd), g.tensor_like(k_blocks), g.tensor_like(v_blocks)
    t_pk, t_pv = g.tensor_like(pages), g.tensor_like(pages.clone())
    t_lq, t_lkv = g.tensor_like(len_q), g.tensor_like(len_kv)
    t_o, _ = g.sdpa(name="sdpa", q=t_q, k=t_k, v=t_v, generate_stats=False, attn_scale=q.shape[-1] ** -0.5,
                    use_padding_mask=True, seq_len_q=t_lq, seq_len_kv=t_lkv,
                    paged_attention_k_table=t_pk, paged_attention_v_table=t_pv,
                    paged_attention_max_seq_len_kv=table.shape[1] * BLOCK)
    t_o.set_output(True).set_dim(list(out_bhsd.shape)).set_stride(list(out_bhsd.stride()))
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A])
    g.check_support()
    g.build_plans()
    workspace = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device=q.device)
    pack = {t_q: q_bhsd, t_k: k_blocks, t_v: v_blocks, t_pk: pages, t_pv: pages, t_lq: len_q, t_lkv: len_kv,
            t_o: out_bhsd}

    def run():
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        g.execute(pack, workspace, handle=handle)
        return out
    return run


def main():
    import cudnn
    handle = cudnn.create_handle()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {cudnn.backend_version()}")
    print(f"{'batch':>5} {'cache':>6} | {'ours':>7} {'cuDNN paged':>11} {'SDPA dense':>10} | "
          f"{'ours/paged':>10} {'paged/dense':>11} {'ours/dense':>10} | max|diff| vs SDPA: ours, cuDNN"
          "   (us per call; ratios of speed)")
    for B, L in CASES:
        q, k_cache, v_cache, table, seqlens = make_case(B, L)
        kd, vd = gathered_head_major(k_cache, table), gathered_head_major(v_cache, table)
        qt = q.transpose(1, 2)

        def sdpa():
            return F.scaled_dot_product_attention(qt, kd, vd, enable_gqa=True)

        def ours():
            return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)

        paged = cudnn_paged(cudnn, handle, q, k_cache, v_cache, table, seqlens)
        ref = sdpa().transpose(1, 2).float()
        errs = [(f().float() - ref).abs().max().item() for f in (ours, paged)]
        t = [min(graph_time_us(f) for _ in range(2)) for f in (ours, paged, sdpa)]
        kvcache_check()
        print(f"{B:>5} {L:>6} | {t[0]:7.1f} {t[1]:11.1f} {t[2]:10.1f} | {t[1] / t[0]:9.2f}x {t[2] / t[1]:10.2f}x "
              f"{t[2] / t[0]:9.2f}x | {errs[0]:.1e}, {errs[1]:.1e}")
        del k_cache, v_cache, kd, vd
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
