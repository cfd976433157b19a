// Scheduler: request lifetime, update(), the prefill vote, invariants. See scheduler.hpp.
#include "scheduler.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace deepinfer {

namespace {
constexpr size_t kFinishedMemory = 1 << 16;  // finished ids whose status get_seq_status still reports

std::string id_str(int64_t id) { return std::to_string(id); }
}  // namespace

const char* seq_status_name(SeqStatus s) {
  switch (s) {
    case SeqStatus::WAITING:
      return "WAITING";
    case SeqStatus::PROMPTED:
      return "PROMPTED";
    case SeqStatus::RUNNING:
      return "RUNNING";
    case SeqStatus::FINISHED_STOPPED:
      return "FINISHED_STOPPED";
    case SeqStatus::FINISHED_LENGTH:
      return "FINISHED_LENGTH";
    case SeqStatus::FINISHED_ABORTED:
      return "FINISHED_ABORTED";
    case SeqStatus::FINISHED_PREEMPTED:
      return "FINISHED_PREEMPTED";
    case SeqStatus::FINISHED_IGNORED:
      return "FINISHED_IGNORED";
  }
  return "?";
}

static SchedulerConfig validated(const SchedulerConfig& cfg) {
  cfg.validate();
  return cfg;
}

Scheduler::Scheduler(const SchedulerConfig& cfg)
    : cfg_(validated(cfg)), kv_(cfg.num_kv_blocks), states_(cfg.num_state_slots()) {
  const int32_t B = cfg_.max_num_batched_tokens;
  max_rows_ = std::min(std::max(cfg_.max_num_seqs, cfg_.effective_max_num_prompts()), B);
  max_tokens_ = B;
  width_ = cfg_.max_blocks_per_seq();
  seq_ids_.assign(max_rows_, 0);
  seqlens_q_.assign(max_rows_, 0);
  seqlens_k_.assign(max_rows_, 0);
  num_drafts_.assign(max_rows_, 0);
  is_last_chunk_.reset(new bool[max_rows_]());
  input_ids_.assign(max_tokens_, 0);
  block_tables_.assign(static_cast<size_t>(max_rows_) * width_, 0);
  row_fill_.assign(max_rows_, 0);
  state_slots_.assign(max_rows_, 0);
  clone_blocks_.assign(2 * static_cast<size_t>(max_rows_), 0);
  clone_states_.assign(2 * static_cast<size_t>(max_rows_), 0);
  zero_states_.assign(max_rows_, 0);
  prev_remap_.assign(max_rows_, -1);
  cands_.reserve(max_rows_);
  selected_.reserve(max_rows_);
  caps_.assign(max_rows_, 0);
  drafts_.assign(max_rows_, 0);
  probs_scratch_.assign(static_cast<size_t>(max_rows_) * std::max(cfg_.nextn, 1), 1.0f);
}

Scheduler::~Scheduler() = default;

// ---------------------------------------------------------------- sequence lifetime

Sequence* Scheduler::new_seq() {
  Sequence* s;
  if (!free_seqs_.empty()) {
    s = free_seqs_.back();
    free_seqs_.pop_back();
  } else {
    pool_.push_back(std::make_unique<Sequence>());
    s = pool_.back().get();
  }
  s->tokens.clear();
  s->block_table.clear();
  s->inflight.clear();
  s->draft_probs.clear();
  s->finish_reason.clear();
  s->num_prompt_tokens = s->max_new_tokens = s->num_computed_tokens = 0;
  s->state_slot = 0;
  s->status = SeqStatus::WAITING;
  s->queue = SeqQueue::NONE;
  s->checked = s->needs_cow = s->has_draft_probs = false;
  s->update_stamp = 0;
  s->sched_stamp = 0;
  s->arrival = next_arrival_++;
  return s;
}

void Scheduler::release(Sequence* s) {
  s->queue = SeqQueue::NONE;
  free_seqs_.push_back(s);
}

void Scheduler::set_status(Sequence* s, SeqStatus st) {
  if (!is_finished(s->status)) --count_[static_cast<int>(s->status)];
  s->status = st;
  if (!is_finished(st)) ++count_[static_cast<int>(st)];
}

void Scheduler::assign_slot(Sequence* s, int32_t slot) {
  if (s->state_slot == 0 && slot != 0) ++live_with_slots_;
  s->state_slot = slot;
}

void Scheduler::clear_slot(Sequence* s) {
  if (s->state_slot != 0) {
    states_.free(s->state_slot);
    --live_with_slots_;
  }
  s->state_slot = 0;
}

void Scheduler::free_resources(Sequence* s) {
  for (int32_t b : s->block_table) kv_.free(b);
  s->block_table.clear();
  clear_slot(s);
  s->needs_cow = false;
}

void Scheduler::remember_finished(int64_t id, SeqStatus st) {
  if (finished_status_.emplace(id, st).second) {
    finished_order_.push_back(id);
  } else {
    finished_status_[id] = st;
  }
  while (finished_order_.size() > kFinishedMemory) {
    finished_status_.erase(finished_order_.front());
    finished_order_.pop_front();
  }
}

void Scheduler::finish_seq(Sequence* s, SeqStatus st, const std::string& reason, ScheduleOutput* out) {
  free_resources(s);
  s->inflight.clear();
  s->has_draft_probs = false;
  set_status(s, st);
  s->finish_reason = reason;
  by_id_.erase(s->seq_id);
  remember_finished(s->seq_id, st);
  if (out) out->finished.push_back({s->seq_id, st, reason});
  if (s->queue == SeqQueue::NONE) release(s);  // otherwise the list holding it releases it lazily
}

Sequence* Scheduler::find_live(int64_t id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second;
}

Sequence* Scheduler::waiting_head() {
  while (!waiting_.empty() && is_finished(waiting_.front()->status)) {
    release(waiting_.front());
    waiting_.pop_front();
  }
  return waiting_.empty() ? nullptr : waiting_.front();
}

// ---------------------------------------------------------------- public API

void Scheduler::add_seq(int64_t seq_id, const int32_t* prompt, int64_t prompt_len, int64_t max_new_tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  if (by_id_.count(seq_id))
    throw std::invalid_argument("add_seq: seq_id " + id_str(seq_id) + " is already in use");
  if (prompt_len < 1)
    throw std::invalid_argument("add_seq: prompt_token_ids is empty (seq_id " + id_str(seq_id) + ")");
  if (prompt_len > INT32_MAX / 2) throw std::invalid_argument("add_seq: prompt_token_ids is too long");
  if (max_new_tokens < 1 || max_new_tokens > INT32_MAX / 2) {
    throw std::invalid_argument("add_seq: max_new_tokens must be >= 1 (got " +
                                std::to_string(max_new_tokens) + ", seq_id " + id_str(seq_id) + ")");
  }
  Sequence* s = new_seq();
  s->seq_id = seq_id;
  s->tokens.assign(prompt, prompt + prompt_len);
  s->num_prompt_tokens = static_cast<int32_t>(prompt_len);
  s->max_new_tokens = static_cast<int32_t>(max_new_tokens);
  s->status = SeqStatus::FINISHED_ABORTED;  // so set_status counts the transition
  set_status(s, SeqStatus::WAITING);
  s->queue = SeqQueue::WAITING;
  waiting_.push_back(s);
  by_id_.emplace(seq_id, s);
  finished_status_.erase(seq_id);
}

void Scheduler::fork_seq(int64_t parent_id, int64_t child_id, int64_t max_new_tokens, int32_t last_token) {
  if (max_new_tokens == 0 || max_new_tokens < -1 || max_new_tokens > INT32_MAX / 2) {
    throw std::invalid_argument("fork_seq: max_new_tokens must be >= 1, or -1 for the parent's (got " +
                                std::to_string(max_new_tokens) + ")");
  }
  std::lock_guard<std::mutex> lock(mu_);
  Sequence* p = find_live(parent_id);
  if (!p) throw std::invalid_argument("fork_seq: parent " + id_str(parent_id) + " is unknown or finished");
  if (p->status != SeqStatus::PROMPTED && p->status != SeqStatus::RUNNING) {
    throw std::invalid_argument("fork_seq: parent " + id_str(parent_id) +
                                " must be PROMPTED or RUNNING (it is " + seq_status_name(p->status) + ")");
  }
  if (by_id_.count(child_id))
    throw std::invalid_argument("fork_seq: child id " + id_str(child_id) + " is already in use");
  // last_token >= 0: the child's own last output token (a sample of its own at the parent's prompt end, n > 1).
  // Only a token not yet in the KV cache can be replaced: the parent must not have computed its last token.
  if (last_token >= 0 && (p->len() <= p->num_prompt_tokens || p->num_computed_tokens >= p->len())) {
    throw std::invalid_argument("fork_seq: last_token needs a parent whose last token is an output token not "
                                "yet computed (parent " + id_str(parent_id) + ")");
  }
  Sequence* c = new_seq();
  c->seq_id = child_id;
  c->tokens = p->tokens;
  if (last_token >= 0) c->tokens.back() = last_token;
  c->num_prompt_tokens = p->num_prompt_tokens;
  // The child's own generation limit (counted from the same prompt); -1 keeps the parent's.
  c->max_new_tokens = max_new_tokens == -1 ? p->max_new_tokens : max_new_tokens;
  c->num_computed_tokens = p->num_computed_tokens;
  const int32_t bs = cfg_.block_size;
  const size_t shared = static_cast<size_t>((c->num_computed_tokens + bs - 1) / bs);
  c->block_table.assign(p->block_table.begin(),
                        p->block_table.begin() + std::min(shared, p->block_table.size()));
  for (int32_t b : c->block_table) kv_.pin(b);
  states_.pin(p->state_slot);
  assign_slot(c, p->state_slot);
  c->needs_cow = true;
  c->checked = true;
  c->draft_probs = p->draft_probs;
  c->has_draft_probs = p->has_draft_probs;
  c->status = SeqStatus::FINISHED_ABORTED;
  set_status(c, SeqStatus::PROMPTED);
  c->queue = SeqQueue::PROMPTED;
  prompted_.push_back(c);
  by_id_.emplace(child_id, c);
  finished_status_.erase(child_id);
}

bool Scheduler::abort(int64_t seq_id) {
  std::lock_guard<std::mutex> lock(mu_);
  Sequence* s = find_live(seq_id);
  if (!s) return false;
  finish_seq(s, SeqStatus::FINISHED_ABORTED, "aborted", nullptr);
  return true;
}

bool Scheduler::finish(int64_t seq_id, SeqStatus status) {
  if (status != SeqStatus::FINISHED_STOPPED && status != SeqStatus::FINISHED_LENGTH) {
    throw std::invalid_argument(
        std::string("finish: status must be FINISHED_STOPPED or FINISHED_LENGTH (got ") +
        seq_status_name(status) + "); use abort() to abort");
  }
  std::lock_guard<std::mutex> lock(mu_);
  Sequence* s = find_live(seq_id);
  if (!s) return false;
  finish_seq(s, status, status == SeqStatus::FINISHED_STOPPED ? "stopped" : "length", nullptr);
  return true;
}

int32_t Scheduler::prefill_vote() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!head_schedulable()) return 0;
  if (count_[static_cast<int>(SeqStatus::PROMPTED)] + count_[static_cast<int>(SeqStatus::RUNNING)] == 0)
    return -1;
  if (kv_.usage() > cfg_.prefill_kv_usage_threshold) return 0;
  const int64_t since = decode_steps_ - attempt_origin_;
  if (since % cfg_.prefill_any_attempt_interval == 0) return -1;
  if (since % cfg_.prefill_attempt_interval == 0) return 1;
  return 0;
}

void Scheduler::restart_attempt_points() {
  std::lock_guard<std::mutex> lock(mu_);
  attempt_origin_ = decode_steps_;
}

ScheduleOutput Scheduler::schedule(bool do_prefill) {
  std::lock_guard<std::mutex> lock(mu_);
  ++generation_;
  ScheduleOutput out;
  if (do_prefill) {
    begin_output(out, StepKind::PREFILL);
    schedule_prefill(out);
  } else {
    ++decode_steps_;
    begin_output(out, StepKind::DECODE);
    schedule_decode(out);
  }
  out.num_seqs = n_rows_;
  out.num_tokens = n_tokens_;
  out.num_clone_blocks = n_clone_blocks_;
  out.num_clone_states = n_clone_states_;
  out.num_zero_states = n_zero_states_;
  if (!do_prefill && n_rows_ == 0) out.kind = StepKind::EMPTY;
  return out;
}

void Scheduler::begin_output(ScheduleOutput& out, StepKind kind) {
  out.kind = kind;
  out.generation = generation_;
  out.max_blocks_per_seq = width_;
  out.seq_ids = seq_ids_.data();
  out.seqlens_q = seqlens_q_.data();
  out.seqlens_k = seqlens_k_.data();
  out.num_drafts = num_drafts_.data();
  out.is_last_chunk = is_last_chunk_.get();
  out.input_ids = input_ids_.data();
  out.block_tables = block_tables_.data();
  out.state_slots = state_slots_.data();
  out.clone_blocks = clone_blocks_.data();
  out.clone_states = clone_states_.data();
  out.zero_states = zero_states_.data();
  out.prev_remap = prev_remap_.data();
  n_rows_ = n_tokens_ = n_clone_blocks_ = n_clone_states_ = n_zero_states_ = 0;
}

void Scheduler::write_row(int32_t row, const Sequence* s) {
  seq_ids_[row] = s->seq_id;
  state_slots_[row] = s->state_slot;
  int32_t* dst = block_tables_.data() + static_cast<size_t>(row) * width_;
  const int32_t nb = static_cast<int32_t>(s->block_table.size());
  std::memcpy(dst, s->block_table.data(), sizeof(int32_t) * nb);
  if (row_fill_[row] > nb) std::memset(dst + nb, 0, sizeof(int32_t) * (row_fill_[row] - nb));
  row_fill_[row] = nb;
}

void Scheduler::update(const int64_t* seq_ids, const int32_t* num_new_tokens, int64_t n,
                       const int32_t* new_token_ids, int64_t num_token_ids) {
  std::lock_guard<std::mutex> lock(mu_);
  // Pass 1: validate everything, so a bad call changes nothing.
  int64_t total = 0;
  ++update_epoch_;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t cnt = num_new_tokens[i];
    if (cnt < 0) {
      throw std::invalid_argument("update: num_new_tokens[" + std::to_string(i) + "] is negative (" +
                                  std::to_string(cnt) + ")");
    }
    total += cnt;
    Sequence* s = find_live(seq_ids[i]);
    if (!s) continue;  // finished while its step was in flight
    if (s->update_stamp == update_epoch_) {
      throw std::invalid_argument("update: seq_id " + id_str(seq_ids[i]) + " appears twice");
    }
    s->update_stamp = update_epoch_;
    if (s->inflight.empty()) {
      throw std::invalid_argument("update: seq_id " + id_str(seq_ids[i]) + " has no step in flight");
    }
    const InflightStep& st = s->inflight.front();
    if (st.kind == InflightStep::PREFILL) {
      const int32_t want = st.last_chunk ? 1 : 0;
      if (cnt != want) {
        throw std::invalid_argument(
            "update: seq_id " + id_str(seq_ids[i]) + " ran a prefill chunk " +
            (st.last_chunk ? "that completes the prompt" : "that does not complete the prompt") +
            ", so num_new_tokens must be " + std::to_string(want) + " (got " + std::to_string(cnt) + ")");
      }
    } else if (cnt < 1 || cnt > st.reserve) {
      throw std::invalid_argument("update: seq_id " + id_str(seq_ids[i]) +
                                  " ran a decode step that can emit 1.." + std::to_string(st.reserve) +
                                  " tokens (got num_new_tokens=" + std::to_string(cnt) + ")");
    }
  }
  if (total != num_token_ids) {
    throw std::invalid_argument("update: new_token_ids has " + std::to_string(num_token_ids) +
                                " entries but num_new_tokens sums to " + std::to_string(total));
  }
  // Pass 2: apply.
  int64_t off = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t cnt = num_new_tokens[i];
    const int32_t* toks = new_token_ids + off;
    off += cnt;
    Sequence* s = find_live(seq_ids[i]);
    if (!s) continue;
    const InflightStep st = s->inflight.front();
    s->inflight.erase(s->inflight.begin());
    s->tokens.insert(s->tokens.end(), toks, toks + cnt);
    switch (st.kind) {
      case InflightStep::PREFILL:
        s->num_computed_tokens += st.q_len;
        if (st.last_chunk) {
          set_status(s, SeqStatus::PROMPTED);
          s->queue = SeqQueue::PROMPTED;
          prompted_.push_back(s);
        }
        break;
      case InflightStep::DECODE:
        s->num_computed_tokens = s->len() - 1;
        break;
      case InflightStep::STALE:
        break;  // preempted for recompute: the tokens become part of the prompt to recompute
    }
  }
}

void Scheduler::set_draft_probs(const int64_t* seq_ids, int64_t n, const float* probs, int64_t k) {
  std::lock_guard<std::mutex> lock(mu_);
  if (k != cfg_.nextn) {
    throw std::invalid_argument("set_draft_probs: probs must have nextn=" + std::to_string(cfg_.nextn) +
                                " columns (got " + std::to_string(k) + ")");
  }
  for (int64_t i = 0; i < n; ++i) {
    Sequence* s = find_live(seq_ids[i]);
    if (!s) continue;
    s->draft_probs.assign(probs + i * k, probs + (i + 1) * k);
    s->has_draft_probs = true;
  }
}

void Scheduler::configure_varlen(const VarlenCurve& curve) {
  const std::string problem = curve.validate();
  if (!problem.empty()) throw std::invalid_argument("configure_varlen: " + problem);
  std::lock_guard<std::mutex> lock(mu_);
  curve_ = curve;
  varlen_ = cfg_.nextn > 0;
}

void Scheduler::set_runtime_estimates(double slope_ms_per_token, double sampler_ms) {
  if (!(std::isfinite(slope_ms_per_token) && slope_ms_per_token >= 0)) {
    throw std::invalid_argument("set_runtime_estimates: slope_ms_per_token must be finite and >= 0");
  }
  if (!(std::isfinite(sampler_ms) && sampler_ms >= 0)) {
    throw std::invalid_argument("set_runtime_estimates: sampler_ms must be finite and >= 0");
  }
  std::lock_guard<std::mutex> lock(mu_);
  slope_ms_per_token_ = slope_ms_per_token;
  sampler_ms_ = sampler_ms;
}

SeqStatus Scheduler::get_seq_status(int64_t seq_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (Sequence* s = find_live(seq_id)) return s->status;
  auto it = finished_status_.find(seq_id);
  if (it != finished_status_.end()) return it->second;
  throw SeqNotFound("get_seq_status: unknown seq_id " + id_str(seq_id));
}

SeqInfo Scheduler::seq_info(int64_t seq_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  Sequence* s = find_live(seq_id);
  if (!s) throw SeqNotFound("seq_info: seq_id " + id_str(seq_id) + " is unknown or finished");
  return SeqInfo{s->seq_id,
                 s->tokens,
                 s->num_prompt_tokens,
                 s->max_new_tokens,
                 s->num_computed_tokens,
                 s->block_table,
                 s->state_slot,
                 s->status,
                 s->finish_reason,
                 static_cast<int32_t>(s->inflight.size()),
                 s->needs_cow};
}

int32_t Scheduler::num_waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return count_[static_cast<int>(SeqStatus::WAITING)];
}

int32_t Scheduler::num_running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return count_[static_cast<int>(SeqStatus::PROMPTED)] + count_[static_cast<int>(SeqStatus::RUNNING)];
}

double Scheduler::kv_usage() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kv_.usage();
}

bool Scheduler::has_unfinished() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !by_id_.empty();
}

int64_t Scheduler::num_preemptions() const {
  std::lock_guard<std::mutex> lock(mu_);
  return num_preemptions_;
}

int64_t Scheduler::num_decode_steps() const {
  std::lock_guard<std::mutex> lock(mu_);
  return decode_steps_;
}

bool Scheduler::varlen_enabled() const {
  std::lock_guard<std::mutex> lock(mu_);
  return varlen_;
}

uint64_t Scheduler::generation() const {
  std::lock_guard<std::mutex> lock(mu_);
  return generation_;
}

// ---------------------------------------------------------------- invariants

void Scheduler::check_invariants() const {
  std::lock_guard<std::mutex> lock(mu_);
  auto fail = [](const std::string& what) { throw std::runtime_error("check_invariants: " + what); };
  for (const BlockManager* m : {&kv_, &states_}) {
    const std::string p = m->check();
    const char* name = m == &kv_ ? "kv_block_manager: " : "state_manager: ";
    if (!p.empty()) fail(name + p);
  }
  if (!deferred_block_frees_.empty() || !deferred_slot_frees_.empty())
    fail("deferred frees pending between steps");
  std::vector<int32_t> hold_b(kv_.num_blocks(), 0), hold_s(states_.num_blocks(), 0);
  int32_t counts[kNumSeqStatus] = {};
  int32_t with_slots = 0;
  const int32_t bs = cfg_.block_size;
  for (const auto& [id, s] : by_id_) {
    const std::string sid = "seq " + id_str(id) + ": ";
    if (is_finished(s->status)) fail(sid + "finished but still live");
    ++counts[static_cast<int>(s->status)];
    for (int32_t b : s->block_table) {
      if (b <= 0 || b >= kv_.num_blocks()) fail(sid + "holds invalid block " + std::to_string(b));
      ++hold_b[b];
    }
    if (s->state_slot != 0) {
      if (s->state_slot < 0 || s->state_slot >= states_.num_blocks()) fail(sid + "holds invalid state slot");
      ++hold_s[s->state_slot];
      ++with_slots;
    }
    if ((s->status == SeqStatus::PROMPTED || s->status == SeqStatus::RUNNING) && s->state_slot == 0) {
      fail(sid + "is " + seq_status_name(s->status) + " without a state slot");
    }
    if (static_cast<int32_t>(s->block_table.size()) > width_)
      fail(sid + "block table wider than max_blocks_per_seq");
    if (!s->block_table.empty()) {
      int64_t need = s->num_computed_tokens;
      for (const auto& st : s->inflight) {
        if (st.kind == InflightStep::PREFILL)
          need += st.q_len;
        else if (st.kind == InflightStep::DECODE)
          need += st.reserve;
      }
      // Committed KV plus in-flight writes; a decode step's reservation counts from len - 1.
      const int64_t blocks_needed = (need + bs - 1) / bs;
      if (static_cast<int64_t>(s->block_table.size()) < blocks_needed) {
        fail(sid + "holds " + std::to_string(s->block_table.size()) + " blocks but needs " +
             std::to_string(blocks_needed) + " for " + std::to_string(need) + " KV tokens");
      }
    }
    if (s->num_computed_tokens > s->len()) fail(sid + "num_computed_tokens > len(tokens)");
    if (s->checked && s->len() > cfg_.max_model_len + 1) fail(sid + "longer than max_model_len + 1");
  }
  for (int32_t b = 0; b < kv_.num_blocks(); ++b) {
    if (hold_b[b] != kv_.ref_count(b)) {
      fail("block " + std::to_string(b) + " has ref count " + std::to_string(kv_.ref_count(b)) + " but " +
           std::to_string(hold_b[b]) + " holders");
    }
  }
  for (int32_t b = 0; b < states_.num_blocks(); ++b) {
    if (hold_s[b] != states_.ref_count(b)) {
      fail("state slot " + std::to_string(b) + " has ref count " + std::to_string(states_.ref_count(b)) +
           " but " + std::to_string(hold_s[b]) + " holders");
    }
  }
  if (with_slots != live_with_slots_) fail("live_with_slots counter out of sync");
  for (int i = 0; i < kNumSeqStatus; ++i) {
    if (counts[i] != count_[i])
      fail(std::string("status counter out of sync for ") + seq_status_name(SeqStatus(i)));
  }
  auto check_list_entry = [&](const Sequence* s, SeqQueue q, const char* list) {
    if (s->queue != q) fail(std::string("a sequence in ") + list + " has the wrong queue tag");
    if (is_finished(s->status) && (!s->block_table.empty() || s->state_slot != 0 || !s->inflight.empty())) {
      fail("finished seq " + id_str(s->seq_id) + " still holds resources");
    }
  };
  for (const Sequence* s : waiting_) check_list_entry(s, SeqQueue::WAITING, "waiting");
  for (const Sequence* s : prompted_) check_list_entry(s, SeqQueue::PROMPTED, "prompted");
  for (const Sequence* s : running_) check_list_entry(s, SeqQueue::RUNNING, "running");
}

}  // namespace deepinfer
