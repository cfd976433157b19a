// Scheduler: sequences, the two block managers and the NORMAL-engine policy (seed §5, DESIGN §4,
// docs/interfaces.md §1). Policy code is split by phase: scheduler.cpp (requests, update, vote, invariants),
// scheduler_prefill.cpp (FIFO prefill with chunking), scheduler_decode.cpp (decode selection, preemption,
// drafts).
//
// Thread safety: every public method takes the scheduler's mutex, so schedule() can run without the GIL while
// other Python threads call abort()/add_seq().
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "block_manager.hpp"
#include "schedule_output.hpp"
#include "scheduler_config.hpp"
#include "sequence.hpp"
#include "varlen_allocator.hpp"

namespace deepinfer {

// An id that is not a live (or, for get_seq_status, recently finished) sequence. KeyError in Python.
struct SeqNotFound : std::out_of_range {
  using std::out_of_range::out_of_range;
};

// A snapshot of one sequence (tests, debugging).
struct SeqInfo {
  int64_t seq_id;
  std::vector<int32_t> tokens;
  int32_t num_prompt_tokens;
  int32_t max_new_tokens;
  int32_t num_computed_tokens;
  std::vector<int32_t> block_table;
  int32_t state_slot;
  SeqStatus status;
  std::string finish_reason;
  int32_t num_inflight;
  bool needs_cow;
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerConfig& cfg);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  void add_seq(int64_t seq_id, const int32_t* prompt, int64_t prompt_len, int64_t max_new_tokens);
  void fork_seq(int64_t parent_id, int64_t child_id, int64_t max_new_tokens = -1, int32_t last_token = -1);
  bool abort(int64_t seq_id);
  bool finish(int64_t seq_id, SeqStatus status);
  int32_t prefill_vote();
  // Attempt points count decode steps from here on (the step loop calls it when no sequence runs anywhere in its
  // group, so a burst of requests after an idle engine prefills at once instead of waiting for the next point).
  void restart_attempt_points();
  ScheduleOutput schedule(bool do_prefill);
  void update(const int64_t* seq_ids, const int32_t* num_new_tokens, int64_t n, const int32_t* new_token_ids,
              int64_t num_token_ids);
  void set_draft_probs(const int64_t* seq_ids, int64_t n, const float* probs, int64_t k);
  void configure_varlen(const VarlenCurve& curve);
  void set_runtime_estimates(double slope_ms_per_token, double sampler_ms);

  SeqStatus get_seq_status(int64_t seq_id) const;
  SeqInfo seq_info(int64_t seq_id) const;
  int32_t num_waiting() const;
  int32_t num_running() const;  // PROMPTED + RUNNING
  double kv_usage() const;
  bool has_unfinished() const;
  int64_t num_preemptions() const;
  int64_t num_decode_steps() const;
  bool varlen_enabled() const;
  uint64_t generation() const;
  const SchedulerConfig& config() const { return cfg_; }
  const BlockManager& kv_block_manager() const { return kv_; }
  const BlockManager& state_manager() const { return states_; }
  // Throws std::runtime_error describing the first violated invariant.
  void check_invariants() const;

 private:
  struct Candidate {
    int32_t out_len;
    int64_t arrival;
    Sequence* seq;
    int32_t reserve;
  };

  // --- sequence lifetime (scheduler.cpp)
  Sequence* new_seq();
  void release(Sequence* s);
  void set_status(Sequence* s, SeqStatus st);
  void free_resources(Sequence* s);
  void finish_seq(Sequence* s, SeqStatus st, const std::string& reason, ScheduleOutput* out);
  void remember_finished(int64_t id, SeqStatus st);
  Sequence* find_live(int64_t id) const;
  Sequence* waiting_head();
  void assign_slot(Sequence* s, int32_t slot);
  void clear_slot(Sequence* s);

  // --- prefill (scheduler_prefill.cpp)
  void schedule_prefill(ScheduleOutput& out);
  std::string capacity_problem(const Sequence* s) const;
  int32_t first_chunk_len(const Sequence* s, int32_t budget) const;
  bool head_schedulable();

  // --- decode (scheduler_decode.cpp)
  void schedule_decode(ScheduleOutput& out);
  int32_t reservation(const Sequence* s) const;
  void preempt(Sequence* s, const std::string& reason, ScheduleOutput& out);
  void assign_drafts(int32_t n);

  // --- output rows
  void write_row(int32_t row, const Sequence* s);
  void begin_output(ScheduleOutput& out, StepKind kind);

  SchedulerConfig cfg_;
  BlockManager kv_;
  BlockManager states_;
  mutable std::mutex mu_;

  std::vector<std::unique_ptr<Sequence>> pool_;
  std::vector<Sequence*> free_seqs_;
  std::unordered_map<int64_t, Sequence*> by_id_;  // live (unfinished) sequences
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> prompted_;
  std::vector<Sequence*> running_;
  std::unordered_map<int64_t, SeqStatus> finished_status_;  // the last kFinishedMemory finished ids
  std::deque<int64_t> finished_order_;
  int32_t count_[kNumSeqStatus] = {};
  int32_t live_with_slots_ = 0;
  int64_t next_arrival_ = 0;
  int64_t num_preemptions_ = 0;
  int64_t decode_steps_ = 0;
  int64_t attempt_origin_ = 0;  // decode_steps_ at the last restart_attempt_points()
  uint64_t generation_ = 0;
  uint64_t update_epoch_ = 0;

  // varlen
  bool varlen_ = false;
  VarlenCurve curve_;
  double slope_ms_per_token_ = 0.0;
  double sampler_ms_ = 0.0;
  VarlenAllocator allocator_;

  // step scratch
  std::vector<Candidate> cands_;
  std::vector<Candidate> selected_;
  std::vector<Sequence*> scratch_seqs_;
  std::vector<int32_t> caps_;
  std::vector<int32_t> drafts_;
  std::vector<float> probs_scratch_;
  std::vector<int32_t> deferred_block_frees_;
  std::vector<int32_t> deferred_slot_frees_;

  // output buffers: sized once, never reallocated (views handed to Python stay valid memory)
  int32_t max_rows_ = 0;
  int32_t max_tokens_ = 0;
  int32_t width_ = 0;  // max_blocks_per_seq
  std::vector<int64_t> seq_ids_;
  std::vector<int32_t> seqlens_q_;
  std::vector<int32_t> seqlens_k_;
  std::vector<int32_t> num_drafts_;
  std::unique_ptr<bool[]> is_last_chunk_;
  std::vector<int32_t> input_ids_;
  std::vector<int32_t> block_tables_;
  std::vector<int32_t> row_fill_;
  std::vector<int32_t> state_slots_;
  std::vector<int32_t> clone_blocks_;
  std::vector<int32_t> clone_states_;
  std::vector<int32_t> zero_states_;
  std::vector<int32_t> prev_remap_;
  uint64_t last_decode_gen_ = 0;  // generation of the latest non-empty decode step
  int32_t last_decode_n_ = 0;
  // counters of the output being built
  int32_t n_rows_ = 0;
  int32_t n_tokens_ = 0;
  int32_t n_clone_blocks_ = 0;
  int32_t n_clone_states_ = 0;
  int32_t n_zero_states_ = 0;
};

}  // namespace deepinfer
