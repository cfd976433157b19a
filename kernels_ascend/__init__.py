"""TileLang kernels for Ascend (950 first): the small device ops with no torch_npu fused equivalent.

One file per kernel, same shape as kernels_cuda/: a factory building the TileLang program, a torch reference
(the contract of backends/cpu where one exists), ``ci_lower()`` (lowers every program to AscendC source with
``tilelang.lower(..., target="ascend")`` — no CANN needed) and ``check()`` (the same program compiled for the
host C target and compared with the reference on random inputs). None has been compiled by bisheng or run on
an NPU yet.

Use: ``backends/ascend/tilelang_ascend.py`` runs ``zos_seqlens_k`` + ``zos_seqlens_q`` (HAL ``zos_fixup``),
``spec_verify_greedy`` / ``rejection_accept`` with ``sample_pieces`` (HAL ``spec_verify``: the argmax, the hash-RNG
noise, temperature and Gumbel-max race) and ``gating_topk`` (HAL ``moe_gating_topk`` for configurations outside
``npu_moe_gating_top_k``'s limits) when its start-up probe finds tilelang, the CANN bisheng JIT path and an NPU;
otherwise the torch composition runs and ``--list-ops`` says why.
"""
