// SchedulerConfig: the engine arguments the C++ core needs (docs/interfaces.md §1). validate() throws
// std::invalid_argument (ValueError in Python) naming the parameter, its value and the limit it violates.
#pragma once

#include <cstdint>
#include <string>

namespace deepinfer {

struct SchedulerConfig {
  int32_t max_num_seqs = 256;             // decode batch: at most this many sequences per step
  int32_t max_num_batched_tokens = 8192;  // tokens per step (prefill chunk budget, decode total_q budget)
  int32_t max_model_len = 0;              // required: prompt + outputs never exceed it
  int32_t block_size = 64;                // tokens per KV block
  int32_t num_kv_blocks = 0;              // required: KV pool size including the reserved block 0
  double state_slot_ratio = 1.2;          // num_state_slots = floor(max_num_seqs * ratio) + 1
  int32_t nextn = 0;            // max drafts verified per sequence per decode step (0 = no speculation)
  int32_t max_num_prompts = 0;  // prefill sequences per step (0 = max_num_seqs)
  int64_t prefill_max_sum_seqlen_k = 0;        // sum of seqlens_k per prefill step (0 = unlimited)
  int32_t prefill_attempt_interval = 70;       // ALL attempt point every this many decode steps
  int32_t prefill_any_attempt_interval = 100;  // ANY attempt point every this many decode steps
  double prefill_kv_usage_threshold = 0.9;     // "wants prefill" only while KV usage <= this
  bool stop_preempted_request = true;          // preemption finishes the request (FINISHED_PREEMPTED)
  bool enable_chunked_prefill = true;
  int32_t chunk_alignment = 1;  // chunk ends (except the prompt end) are multiples of this (CP hook)

  void validate() const;
  int32_t num_state_slots() const;  // floor(max_num_seqs * state_slot_ratio) + 1 (slot 0 is a dummy)
  int32_t effective_max_num_prompts() const { return max_num_prompts > 0 ? max_num_prompts : max_num_seqs; }
  int32_t max_blocks_per_seq() const;  // ceil(max_model_len / block_size): width of the block table
  std::string repr() const;
};

}  // namespace deepinfer
