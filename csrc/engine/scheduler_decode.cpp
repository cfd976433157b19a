// Decode policy (seed §5.3): PROMPTED -> RUNNING, selection from the shortest-output end with a reservation
// of nextn+1 tokens per step (covering the in-flight step under ZOS), preemption from the longest-output end,
// fork copy-on-write, final sort by total length, then drafts per sequence (fixed nextn or the varlen
// allocator).
#include <algorithm>
#include <cstring>

#include "scheduler.hpp"

namespace deepinfer {

// Most tokens the next decode step of `s` may emit (1 + drafts), <= 0 when the sequence cannot grow any more
// (optimistically: every in-flight step is assumed to emit its whole reservation).
int32_t Scheduler::reservation(const Sequence* s) const {
  const int32_t infl = s->inflight_reserve();
  const int32_t rem_len = cfg_.max_model_len - (s->len() + infl);
  const int32_t rem_new = s->max_new_tokens - (s->num_output_tokens() + infl);
  return std::min({cfg_.nextn + 1, rem_len, rem_new});
}

void Scheduler::preempt(Sequence* s, const std::string& reason, ScheduleOutput& out) {
  ++num_preemptions_;
  if (cfg_.stop_preempted_request) {
    finish_seq(s, SeqStatus::FINISHED_PREEMPTED, reason, &out);
    return;
  }
  // Recompute: blocks and slot freed, its tokens so far become the prompt, back to the FRONT of waiting.
  free_resources(s);
  s->num_computed_tokens = 0;
  s->checked = false;
  s->has_draft_probs = false;
  for (auto& st : s->inflight) st.kind = InflightStep::STALE;  // their update() only appends tokens
  set_status(s, SeqStatus::WAITING);
  s->queue = SeqQueue::WAITING;
  waiting_.push_front(s);
}

void Scheduler::schedule_decode(ScheduleOutput& out) {
  // 1. PROMPTED -> RUNNING.
  for (Sequence* s : prompted_) {
    if (is_finished(s->status)) {
      release(s);
      continue;
    }
    set_status(s, SeqStatus::RUNNING);
    s->queue = SeqQueue::RUNNING;
    running_.push_back(s);
  }
  prompted_.clear();

  // 2. Candidates with their needs. Without pressure (all fit the batch limits and the free blocks/slots) the
  // selection order cannot matter, so the sort by output length is skipped.
  const int32_t bs = cfg_.block_size;
  const int32_t limit = std::min({cfg_.max_num_seqs, cfg_.max_num_batched_tokens, max_rows_});
  auto needs = [bs](const Sequence* s, int32_t reserve, int64_t* needed, bool* cow_block) {
    *needed = static_cast<int64_t>(s->len()) + s->inflight_reserve() - 1 + reserve;
    *cow_block = s->needs_cow && !s->block_table.empty() && s->num_computed_tokens % bs != 0;
    return std::max<int64_t>(0, (*needed + bs - 1) / bs - static_cast<int64_t>(s->block_table.size())) +
           (*cow_block ? 1 : 0);
  };
  cands_.clear();
  int64_t sum_blocks = 0, sum_slots = 0;
  size_t keep = 0;
  for (Sequence* s : running_) {
    if (is_finished(s->status)) {
      release(s);
      continue;
    }
    running_[keep++] = s;
    const int32_t r = reservation(s);
    if (r <= 0 || s->has_inflight_prefill()) continue;
    int64_t needed;
    bool cow_block;
    sum_blocks += needs(s, r, &needed, &cow_block);
    sum_slots += s->needs_cow ? 1 : 0;
    cands_.push_back({s->num_output_tokens(), s->arrival, s, r});
  }
  running_.resize(keep);
  const bool pressure = static_cast<int64_t>(cands_.size()) > limit || !kv_.can_allocate(sum_blocks) ||
                        !states_.can_allocate(sum_slots);

  // Admit one candidate: fork copy-on-write (own copy of the state slot and of the last, partially written
  // shared block; the shared sources are released after the whole step is built so they are not reused as
  // copy targets), then blocks up to the reservation.
  auto admit = [&](const Candidate& c) {
    Sequence* s = c.seq;
    int64_t needed;
    bool cow_block;
    needs(s, c.reserve, &needed, &cow_block);
    if (s->needs_cow) {
      const int32_t slot = states_.allocate();
      clone_states_[2 * n_clone_states_] = s->state_slot;
      clone_states_[2 * n_clone_states_ + 1] = slot;
      ++n_clone_states_;
      deferred_slot_frees_.push_back(s->state_slot);
      s->state_slot = slot;  // live_with_slots_ unchanged: one slot replaced by another
      if (cow_block) {
        const int32_t b = kv_.allocate();
        clone_blocks_[2 * n_clone_blocks_] = s->block_table.back();
        clone_blocks_[2 * n_clone_blocks_ + 1] = b;
        ++n_clone_blocks_;
        deferred_block_frees_.push_back(s->block_table.back());
        s->block_table.back() = b;
      }
      s->needs_cow = false;
    }
    while (static_cast<int64_t>(s->block_table.size()) * bs < needed)
      s->block_table.push_back(kv_.allocate());
    selected_.push_back(c);
  };

  // 3. Selection from the shortest-output end, preempting from the longest-output end.
  selected_.clear();
  if (!pressure) {
    for (const Candidate& c : cands_) admit(c);
  } else {
    // Output length descending (ties: later arrival first): the back is the shortest-output end (earliest
    // arrival among equals), the front the longest-output end.
    std::sort(cands_.begin(), cands_.end(), [](const Candidate& a, const Candidate& b) {
      if (a.out_len != b.out_len) return a.out_len > b.out_len;
      return a.arrival > b.arrival;
    });
    int64_t lo = 0, hi = static_cast<int64_t>(cands_.size()) - 1;
    while (hi >= lo && static_cast<int32_t>(selected_.size()) < limit) {
      const Candidate& c = cands_[hi];
      Sequence* s = c.seq;
      int64_t needed;
      bool cow_block;
      const int64_t need_blocks = needs(s, c.reserve, &needed, &cow_block);
      const int32_t need_slots = s->needs_cow ? 1 : 0;
      bool ok = true;
      while (!(kv_.can_allocate(need_blocks) && states_.can_allocate(need_slots))) {
        const bool self = lo >= hi;
        Sequence* victim = self ? s : cands_[lo].seq;
        const std::string reason =
            "preempted: KV cache exhausted while scheduling decode (seq " + std::to_string(s->seq_id) +
            " needed " + std::to_string(need_blocks) + " blocks, " + std::to_string(kv_.num_free()) + " of " +
            std::to_string(kv_.num_allocatable()) + " free" + (need_slots ? ", plus a state slot" : "") + ")";
        preempt(victim, reason, out);
        if (self) {
          ok = false;
          break;
        }
        ++lo;
      }
      if (!ok) break;
      admit(c);
      --hi;
    }
  }
  for (int32_t b : deferred_block_frees_) kv_.free(b);
  for (int32_t slot : deferred_slot_frees_) states_.free(slot);
  deferred_block_frees_.clear();
  deferred_slot_frees_.clear();

  const int32_t n = static_cast<int32_t>(selected_.size());
  // 4. Final order: total length descending (optimistic: committed + in-flight q), ties by arrival. running_
  // is kept in this order, so the next step usually finds its candidates already sorted.
  for (auto& c : selected_) c.out_len = c.seq->len() + c.seq->inflight_q();
  auto by_total = [](const Candidate& a, const Candidate& b) {
    if (a.out_len != b.out_len) return a.out_len > b.out_len;
    return a.arrival < b.arrival;
  };
  if (!std::is_sorted(selected_.begin(), selected_.end(), by_total)) {
    std::sort(selected_.begin(), selected_.end(), by_total);
  }
  {
    const uint64_t stamp = generation_;
    scratch_seqs_.clear();
    for (const Candidate& c : selected_) {
      c.seq->sched_stamp = stamp;
      scratch_seqs_.push_back(c.seq);
    }
    for (Sequence* s : running_) {
      if (s->sched_stamp == stamp) continue;
      if (s->status == SeqStatus::RUNNING) {
        scratch_seqs_.push_back(s);
      } else if (is_finished(s->status)) {
        release(s);  // preempted (finished) this step
      }  // else: preempted for recompute, now owned by waiting_
    }
    running_.swap(scratch_seqs_);
  }
  if (n == 0) return;

  // 5. Drafts per sequence.
  assign_drafts(n);

  // 6. Rows.
  bool identical = n == last_decode_n_;
  for (int32_t row = 0; row < n; ++row) {
    Sequence* s = selected_[row].seq;
    const int32_t d = drafts_[row];
    const int32_t q = 1 + d;
    const int32_t infl_q = s->inflight_q();
    bool prev_inflight = false;
    int32_t remap = -1;
    if (!s->inflight.empty()) {
      const InflightStep& last = s->inflight.back();
      prev_inflight = last.kind == InflightStep::DECODE;
      if (prev_inflight && static_cast<uint64_t>(last.step_id) == last_decode_gen_) remap = last.row;
    }
    write_row(row, s);
    seqlens_q_[row] = q;
    seqlens_k_[row] = s->len() + infl_q - 1 + q;
    num_drafts_[row] = d;
    is_last_chunk_[row] = true;
    prev_remap_[row] = remap;
    identical = identical && remap == row;
    int32_t* in = input_ids_.data() + n_tokens_;
    in[0] = prev_inflight ? -1 : s->tokens.back();
    for (int32_t j = 1; j < q; ++j) in[j] = -1;
    n_tokens_ += q;
    s->inflight.push_back(
        {InflightStep::DECODE, true, q, selected_[row].reserve, static_cast<int64_t>(generation_), row});
  }
  n_rows_ = n;
  out.remap_identical = identical;
  last_decode_gen_ = generation_;
  last_decode_n_ = n;
}

void Scheduler::assign_drafts(int32_t n) {
  const int32_t k = cfg_.nextn;
  int64_t sum_caps = 0;
  for (int32_t i = 0; i < n; ++i) {
    caps_[i] = std::min(k, selected_[i].reserve - 1);
    sum_caps += caps_[i];
    drafts_[i] = 0;
  }
  if (k == 0 || sum_caps == 0) return;
  const int64_t budget = static_cast<int64_t>(cfg_.max_num_batched_tokens) - n;
  if (varlen_) {
    for (int32_t i = 0; i < n; ++i) {
      const Sequence* s = selected_[i].seq;
      float* row = probs_scratch_.data() + static_cast<size_t>(i) * k;
      if (s->has_draft_probs) {
        std::memcpy(row, s->draft_probs.data(), sizeof(float) * k);
      } else {
        std::fill(row, row + k, 1.0f);  // no confidences yet: treat every draft as certain
      }
    }
    allocator_.allocate(probs_scratch_.data(), n, k, caps_.data(), curve_, slope_ms_per_token_, sampler_ms_,
                        cfg_.max_num_batched_tokens, drafts_.data());
    return;
  }
  if (sum_caps <= budget) {
    for (int32_t i = 0; i < n; ++i) drafts_[i] = caps_[i];
    return;
  }
  // Over the token budget: the largest uniform level L with sum(min(cap, L)) <= budget, the rest one by one
  // in the final order.
  int32_t level = 0;
  for (int32_t L = 1; L <= k; ++L) {
    int64_t sum = 0;
    for (int32_t i = 0; i < n; ++i) sum += std::min(caps_[i], L);
    if (sum > budget) break;
    level = L;
  }
  int64_t left = budget;
  for (int32_t i = 0; i < n; ++i) {
    drafts_[i] = std::min(caps_[i], level);
    left -= drafts_[i];
  }
  for (int32_t i = 0; i < n && left > 0; ++i) {
    if (caps_[i] > drafts_[i]) {
      ++drafts_[i];
      --left;
    }
  }
}

}  // namespace deepinfer
