#include "scheduler_config.hpp"

#include <cmath>
#include <sstream>
#include <stdexcept>

namespace deepinfer {
namespace {

template <typename T>
void require(bool ok, const char* name, T value, const std::string& limit) {
  if (!ok) {
    std::ostringstream os;
    os << "SchedulerConfig." << name << " must be " << limit << " (got " << value << ")";
    throw std::invalid_argument(os.str());
  }
}

}  // namespace

void SchedulerConfig::validate() const {
  require(max_num_seqs >= 1, "max_num_seqs", max_num_seqs, ">= 1");
  require(max_num_batched_tokens >= 1, "max_num_batched_tokens", max_num_batched_tokens, ">= 1");
  require(max_model_len >= 1, "max_model_len", max_model_len, ">= 1 (it is required)");
  require(block_size >= 1, "block_size", block_size, ">= 1");
  require(num_kv_blocks >= 2, "num_kv_blocks", num_kv_blocks, ">= 2 (it is required; block 0 is reserved)");
  require(std::isfinite(state_slot_ratio) && state_slot_ratio > 0, "state_slot_ratio", state_slot_ratio,
          "> 0");
  require(std::floor(max_num_seqs * state_slot_ratio) >= 1.0 && max_num_seqs * state_slot_ratio < 2.0e9,
          "state_slot_ratio", state_slot_ratio,
          "such that floor(max_num_seqs * state_slot_ratio) is in [1, 2e9] (max_num_seqs=" +
              std::to_string(max_num_seqs) + ")");
  require(nextn >= 0 && nextn <= 64, "nextn", nextn, "in [0, 64]");
  require(max_num_prompts >= 0, "max_num_prompts", max_num_prompts, ">= 0 (0 = max_num_seqs)");
  require(prefill_max_sum_seqlen_k >= 0, "prefill_max_sum_seqlen_k", prefill_max_sum_seqlen_k,
          ">= 0 (0 = unlimited)");
  require(prefill_attempt_interval >= 1, "prefill_attempt_interval", prefill_attempt_interval, ">= 1");
  require(prefill_any_attempt_interval >= 1, "prefill_any_attempt_interval", prefill_any_attempt_interval,
          ">= 1");
  require(std::isfinite(prefill_kv_usage_threshold) && prefill_kv_usage_threshold > 0 &&
              prefill_kv_usage_threshold <= 1.0,
          "prefill_kv_usage_threshold", prefill_kv_usage_threshold, "in (0, 1]");
  require(chunk_alignment >= 1 && chunk_alignment <= max_num_batched_tokens, "chunk_alignment",
          chunk_alignment, "in [1, max_num_batched_tokens=" + std::to_string(max_num_batched_tokens) + "]");
}

int32_t SchedulerConfig::num_state_slots() const {
  return static_cast<int32_t>(std::floor(max_num_seqs * state_slot_ratio)) + 1;
}

int32_t SchedulerConfig::max_blocks_per_seq() const { return (max_model_len + block_size - 1) / block_size; }

std::string SchedulerConfig::repr() const {
  std::ostringstream os;
  os << "SchedulerConfig(max_num_seqs=" << max_num_seqs
     << ", max_num_batched_tokens=" << max_num_batched_tokens << ", max_model_len=" << max_model_len
     << ", block_size=" << block_size << ", num_kv_blocks=" << num_kv_blocks
     << ", state_slot_ratio=" << state_slot_ratio << ", nextn=" << nextn
     << ", max_num_prompts=" << max_num_prompts << ", prefill_max_sum_seqlen_k=" << prefill_max_sum_seqlen_k
     << ", prefill_attempt_interval=" << prefill_attempt_interval
     << ", prefill_any_attempt_interval=" << prefill_any_attempt_interval
     << ", prefill_kv_usage_threshold=" << prefill_kv_usage_threshold
     << ", stop_preempted_request=" << (stop_preempted_request ? "True" : "False")
     << ", enable_chunked_prefill=" << (enable_chunked_prefill ? "True" : "False")
     << ", chunk_alignment=" << chunk_alignment << ")";
  return os.str();
}

}  // namespace deepinfer
