"""The step's small kernels, each where its module's ``reason`` accepts the step, else the reference op on CUDA
tensors (sync-free): ``spec_verify`` (row arg-max + one accept kernel: all-greedy steps, and temperature rows
without drafts, no logprobs, top-k / top-p, penalties, min-p or logit bias; bans are masked into the logits first), ``zos_fixup`` (the
seqlens_k correction and the varlen re-split in one launch), ``decode_inputs`` (one launch for the ~45 small torch
ops of the reference)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from deepinfer_npu.hal.types import KernelWarmupPlan

from .base import OpImpl, kernel_module, meta, ref


class StepKernels(OpImpl):
    KERNELS = ("spec_verify", "zos_fixup", "decode_inputs")
    PRIMARY = {name: name for name in KERNELS}
    PLANNED = {
        "spec_verify": "kernels_cuda.spec_verify (split arg-max + accept) for greedy steps and temperature rows "
        "without drafts, no logprobs / top-k / top-p (bans masked in first); else the reference op on CUDA tensors (sync-free)",
        "zos_fixup": "kernels_cuda.zos_fixup (seqlens_k correction, varlen re-split) in one launch; else the "
        "reference op on CUDA tensors (sync-free)",
        "decode_inputs": "kernels_cuda.decode_inputs (one launch) where its reason accepts the step; else the "
        "reference's torch ops (sync-free)",
    }

    def spec_verify(self, logits, draft_next, row_of_token, j_of_token, num_rows: int, max_q: int, t,
                    ban_mask=None):
        if t.needs_processing:  # logit bias / penalties / min_p: the reference's torch ops (sync-free)
            mod, path = None, "reference (logit bias / penalties / min_p)"
        else:
            # bans (min_tokens, structured output) are the reference's first step: masking the logits here
            # leaves the kernel exactly the reference's work on them
            masked = logits if ban_mask is None else logits.masked_fill(ban_mask, float("-inf"))
            mod, path = self.checked("spec_verify", masked, masked, draft_next, row_of_token, j_of_token,
                                     num_rows, max_q, t, None)
        if mod is None:
            self.note("spec_verify", path, False)
            return ref("spec_verify").spec_verify(logits, draft_next, row_of_token, j_of_token, num_rows, max_q, t,
                                                  ban_mask)
        kind = "greedy" if t.all_greedy else "greedy / temperature rows without drafts, seeded"
        self.note("spec_verify", f"kernels_cuda.spec_verify ({kind})", True)
        emitted, num_emitted, accepted, target = mod.spec_verify(
            masked, draft_next, row_of_token, j_of_token, num_rows, max_q, t, num_sms=self.ks.sms(logits.device)
        )
        return ref("spec_verify").VerifyOutput(emitted=emitted, num_emitted=num_emitted, accepted=accepted,
                                               target_tokens=target, logprobs=None)

    def zos_fixup(self, seqlens_q, seqlens_k, optimistic, slots, correction, draft_probs=None, caps=None):
        mod, path = self.checked("zos_fixup", seqlens_k, seqlens_q, seqlens_k, optimistic, slots, correction,
                                 draft_probs, caps)
        if mod is None:
            self.note("zos_fixup", path, False)
            return ref("zos").zos_fixup(seqlens_q, seqlens_k, optimistic, slots, correction, draft_probs, caps)
        kind = "correction + re-split" if draft_probs is not None and caps is not None else "correction"
        self.note("zos_fixup", f"kernels_cuda.zos_fixup ({kind})", True)
        return mod.zos_fixup(seqlens_q, seqlens_k, optimistic, slots, correction, draft_probs, caps)

    def decode_inputs(self, seqlens_q, seqlens_k, block_tables, state_slots, first_ids, last_token, drafts,
                      block_size: int, num_tokens: int):
        args = (seqlens_q, seqlens_k, block_tables, state_slots, first_ids, last_token, drafts)
        mod, path = self.checked("decode_inputs", seqlens_q, *args, block_size, num_tokens)
        if mod is None:
            self.note("decode_inputs", path, False)
            return ref("step_inputs").decode_inputs(*args, block_size, num_tokens)
        self.note("decode_inputs", "kernels_cuda.decode_inputs (one launch)", True)
        return mod.decode_inputs(*args, block_size, num_tokens, check=False)  # reason() just passed

    # ---- warm-up -------------------------------------------------------------------------------------------
    def warmup_configs(self, plan: KernelWarmupPlan, num_sms: int) -> dict[str, list[tuple]]:
        """``spec_verify``: the greedy arg-max, the noise arg-max (temperature rows without drafts: every prefill's
        sampled rows, and decode without speculation) and the accept kernel, where ``reason`` accepts them (the
        worker samples every step through it); ``zos_fixup``: the correction (every decode step) and, with
        re-splitting, the re-split for k at each launch shape of 1 .. max_num_seqs rows; ``decode_inputs``: one
        build for the page size (every size dynamic)."""
        out = {}
        if self.wants("spec_verify"):
            out["spec_verify"] = _spec_verify_configs(plan)
        if self.wants("zos_fixup"):
            out["zos_fixup"] = _zos_fixup_configs(plan)
        if self.wants("decode_inputs"):
            out["decode_inputs"] = [(plan.block_size, kernel_module("decode_inputs").THREADS)]
        return out


def _spec_verify_configs(plan: KernelWarmupPlan) -> list[tuple]:
    sv = kernel_module("spec_verify")
    v = plan.vocab_size

    def ok(greedy: bool, rows: int, max_q: int) -> bool:
        t = SimpleNamespace(all_greedy=greedy, need_top_k=False, need_top_p=False, max_num_logprobs=None)
        n = rows * max_q
        return sv.reason(meta(n, v, dtype=torch.float32), meta(n), meta(n), meta(n), rows, max_q, t) is None

    items = []
    if ok(True, 1, 1) or ok(True, 1, plan.num_speculative_tokens + 1):
        items += [("argmax", (v, False)), ("accept", ())]
    if ok(False, 1, 1):
        items += [("argmax", (v, True)), ("accept", ())]
    return list(dict.fromkeys(items))


def _zos_fixup_configs(plan: KernelWarmupPlan) -> list[tuple]:
    zf = kernel_module("zos_fixup")
    k, slots = plan.num_speculative_tokens, plan.max_num_seqs + 1
    i32 = torch.int32

    def ok(rows: int, resplit: bool) -> bool:
        extra = (meta(slots, k, dtype=torch.float32), meta(rows)) if resplit else ()
        return zf.reason(meta(rows, dtype=i32), meta(rows, dtype=i32), meta(rows, dtype=torch.bool), meta(rows),
                         meta(slots), *extra) is None

    items = [("correct", ())] if ok(1, False) else []
    if plan.varlen and k:
        items += [("resplit", (k, *zf.resplit_launch(b))) for b in range(1, plan.max_num_seqs + 1) if ok(b, True)]
    return list(dict.fromkeys(items))
