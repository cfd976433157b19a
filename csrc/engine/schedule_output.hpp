// ScheduleOutput: what one schedule() call produced (docs/interfaces.md §1, "ScheduleOutput").
//
// The array fields are not copied: they point into buffers owned by the Scheduler, sized once at construction
// for the largest possible step and never reallocated. The contents are overwritten by the next schedule();
// the Python binding exposes them as numpy views and refuses access through a stale output (generation
// check).
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "sequence.hpp"

namespace deepinfer {

struct FinishedEntry {
  int64_t seq_id;
  SeqStatus status;
  std::string reason;
};

struct ScheduleOutput {
  StepKind kind = StepKind::EMPTY;
  int32_t num_seqs = 0;
  int32_t num_tokens = 0;
  int32_t num_clone_blocks = 0;
  int32_t num_clone_states = 0;
  int32_t num_zero_states = 0;
  int32_t max_blocks_per_seq = 0;
  bool remap_identical = false;
  uint64_t generation = 0;  // the scheduler's schedule() counter when this output was made

  // Views into the scheduler's buffers (valid until the next schedule()).
  const int64_t* seq_ids = nullptr;
  const int32_t* seqlens_q = nullptr;
  const int32_t* seqlens_k = nullptr;
  const int32_t* num_drafts = nullptr;
  const bool* is_last_chunk = nullptr;
  const int32_t* input_ids = nullptr;
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq]
  const int32_t* state_slots = nullptr;
  const int32_t* clone_blocks = nullptr;  // [num_clone_blocks, 2]
  const int32_t* clone_states = nullptr;  // [num_clone_states, 2]
  const int32_t* zero_states = nullptr;
  const int32_t* prev_remap = nullptr;

  std::vector<FinishedEntry> finished;  // ignored / preempted during this schedule() (owned copy)
};

}  // namespace deepinfer
