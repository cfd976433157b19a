// Prefill policy (seed §5.2): FIFO over the waiting queue, length/capacity check on first scheduling, budgets
// (max_num_batched_tokens, max_num_prompts, prefill_max_sum_seqlen_k), chunking with an alignment hook, and a
// chunked request alone in its step.
#include <algorithm>
#include <cstring>

#include "scheduler.hpp"

namespace deepinfer {

std::string Scheduler::capacity_problem(const Sequence* s) const {
  const int32_t len = s->len();
  if (len > cfg_.max_model_len) {
    return "prompt of " + std::to_string(len) +
           " tokens exceeds max_model_len=" + std::to_string(cfg_.max_model_len);
  }
  const int64_t blocks = (static_cast<int64_t>(len) + cfg_.block_size - 1) / cfg_.block_size;
  if (blocks > kv_.num_allocatable()) {
    return "prompt of " + std::to_string(len) + " tokens needs " + std::to_string(blocks) +
           " KV blocks (block_size=" + std::to_string(cfg_.block_size) +
           ") but the whole KV pool has only num_kv_blocks-1=" + std::to_string(kv_.num_allocatable());
  }
  if (!cfg_.enable_chunked_prefill && len > cfg_.max_num_batched_tokens) {
    return "prompt of " + std::to_string(len) +
           " tokens exceeds max_num_batched_tokens=" + std::to_string(cfg_.max_num_batched_tokens) +
           " and enable_chunked_prefill is False";
  }
  return "";
}

// Length of the next chunk of `s` given `budget` tokens (0 = nothing fits). A chunk that does not complete
// the prompt ends on a multiple of chunk_alignment.
int32_t Scheduler::first_chunk_len(const Sequence* s, int32_t budget) const {
  const int32_t nc = s->num_computed_tokens;
  const int32_t remaining = s->len() - nc;
  if (remaining <= budget) return remaining;
  if (!cfg_.enable_chunked_prefill) return 0;
  const int64_t end = (static_cast<int64_t>(nc) + budget) / cfg_.chunk_alignment * cfg_.chunk_alignment;
  return end > nc ? static_cast<int32_t>(end - nc) : 0;
}

// "Waiting head schedulable": a prefill step now would make progress on the head (schedule it, or report it
// as ignored) given free blocks and state slots.
bool Scheduler::head_schedulable() {
  Sequence* s = waiting_head();
  if (!s) return false;
  if (!s->inflight.empty()) return false;
  if (!s->checked && !capacity_problem(s).empty()) return true;  // it will be reported as ignored
  const int32_t chunk = first_chunk_len(s, cfg_.max_num_batched_tokens);
  if (chunk <= 0) return false;
  const int64_t need_tokens = static_cast<int64_t>(s->num_computed_tokens) + chunk;
  const int64_t need_blocks = std::max<int64_t>(
      0, (need_tokens + cfg_.block_size - 1) / cfg_.block_size - (int64_t)s->block_table.size());
  if (!kv_.can_allocate(need_blocks)) return false;
  if (s->state_slot == 0 && (!states_.can_allocate(1) || live_with_slots_ >= cfg_.max_num_seqs)) return false;
  return true;
}

void Scheduler::schedule_prefill(ScheduleOutput& out) {
  const int32_t B = cfg_.max_num_batched_tokens;
  const int32_t max_prompts = std::min(cfg_.effective_max_num_prompts(), max_rows_);
  const int64_t max_sum_k = cfg_.prefill_max_sum_seqlen_k;
  const int32_t bs = cfg_.block_size;
  int64_t sum_k = 0;
  waiting_head();
  size_t idx = 0;  // entries before idx are consumed (scheduled for their last chunk, ignored or dead)
  while (idx < waiting_.size()) {
    Sequence* s = waiting_[idx];
    if (is_finished(s->status)) {  // aborted while waiting
      ++idx;
      continue;
    }
    if (!s->inflight.empty()) break;  // previous chunk or a stale decode step not applied yet; keep FIFO
    if (!s->checked) {
      const std::string problem = capacity_problem(s);
      if (!problem.empty()) {
        s->queue = SeqQueue::WAITING;  // released below with the consumed prefix
        finish_seq(s, SeqStatus::FINISHED_IGNORED, problem, &out);
        ++idx;
        continue;
      }
      s->checked = true;
    }
    if (n_rows_ >= max_prompts) break;
    const int32_t nc = s->num_computed_tokens;
    const int32_t remaining = s->len() - nc;
    const int32_t chunk = first_chunk_len(s, B - n_tokens_);
    if (chunk <= 0) break;
    const bool last = chunk == remaining;
    if (!last && n_rows_ > 0) break;  // a chunked request runs alone in its step
    const int64_t seqlen_k = static_cast<int64_t>(nc) + chunk;
    if (max_sum_k > 0 && n_rows_ > 0 && sum_k + seqlen_k > max_sum_k)
      break;  // the first one is always admitted
    const int64_t need_blocks =
        std::max<int64_t>(0, (seqlen_k + bs - 1) / bs - static_cast<int64_t>(s->block_table.size()));
    const bool need_slot = s->state_slot == 0;
    if (!kv_.can_allocate(need_blocks)) break;
    if (need_slot && (!states_.can_allocate(1) || live_with_slots_ >= cfg_.max_num_seqs)) break;
    // Blocks and state slot are allocated jointly: both checks passed above.
    for (int64_t i = 0; i < need_blocks; ++i) s->block_table.push_back(kv_.allocate());
    if (need_slot) {
      assign_slot(s, states_.allocate());
      zero_states_[n_zero_states_++] = s->state_slot;
    }
    const int32_t row = n_rows_++;
    write_row(row, s);
    seqlens_q_[row] = chunk;
    seqlens_k_[row] = static_cast<int32_t>(seqlen_k);
    num_drafts_[row] = 0;
    is_last_chunk_[row] = last;
    prev_remap_[row] = -1;
    std::memcpy(input_ids_.data() + n_tokens_, s->tokens.data() + nc, sizeof(int32_t) * chunk);
    n_tokens_ += chunk;
    sum_k += seqlen_k;
    s->inflight.push_back({InflightStep::PREFILL, last, chunk, 0, static_cast<int64_t>(generation_), row});
    if (!last) break;  // stays at the head for its next chunk; nothing joins a chunked request
    ++idx;
  }
  for (size_t i = 0; i < idx; ++i) {
    Sequence* s = waiting_.front();
    waiting_.pop_front();
    if (is_finished(s->status)) {
      release(s);
    } else {
      s->queue = SeqQueue::NONE;  // prefill in flight; update() moves it to PROMPTED
    }
  }
}

}  // namespace deepinfer
