// Sequence: the per-request state the scheduler keeps (docs/interfaces.md §1).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace deepinfer {

enum class SeqStatus : int32_t {
  WAITING = 0,
  PROMPTED = 1,  // prompt fully computed (or forked), not yet in a decode step
  RUNNING = 2,
  FINISHED_STOPPED = 3,
  FINISHED_LENGTH = 4,
  FINISHED_ABORTED = 5,
  FINISHED_PREEMPTED = 6,
  FINISHED_IGNORED = 7,
};
constexpr int kNumSeqStatus = 8;

inline bool is_finished(SeqStatus s) {
  return static_cast<int32_t>(s) >= static_cast<int32_t>(SeqStatus::FINISHED_STOPPED);
}
const char* seq_status_name(SeqStatus s);

enum class StepKind : int32_t { PREFILL = 0, DECODE = 1, EMPTY = 2 };

// A step scheduled for a sequence whose results update() has not applied yet.
struct InflightStep {
  enum Kind : int8_t {
    PREFILL,
    DECODE,
    STALE
  };  // STALE: decode step of a sequence since preempted for recompute
  Kind kind;
  bool last_chunk;  // prefill: this chunk completes the prompt
  int32_t q_len;    // tokens fed in this step (decode: 1 + drafts chosen on the CPU)
  int32_t
      reserve;  // decode: most tokens the step may emit / KV entries it may write (blocks reserved for it)
  int64_t step_id;  // scheduler step counter at scheduling
  int32_t row;      // row in that step's output
};

// Which scheduler list holds the sequence (lists drop finished entries lazily).
enum class SeqQueue : int8_t { NONE, WAITING, PROMPTED, RUNNING };

struct Sequence {
  int64_t seq_id = 0;
  int64_t arrival = 0;            // add/fork order, the tie-breaker of every sort
  std::vector<int32_t> tokens;    // prompt + committed outputs
  int32_t num_prompt_tokens = 0;  // the original prompt (outputs = tokens.size() - num_prompt_tokens)
  int32_t max_new_tokens = 0;
  int32_t num_computed_tokens = 0;  // tokens whose KV is committed in the cache
  std::vector<int32_t> block_table;
  int32_t state_slot = 0;  // 0 = none
  SeqStatus status = SeqStatus::WAITING;
  std::string finish_reason;
  SeqQueue queue = SeqQueue::NONE;
  bool checked = false;                // length/capacity checked at first scheduling
  bool needs_cow = false;              // forked: blocks/slot shared with the parent until first decode step
  std::vector<InflightStep> inflight;  // oldest first
  std::vector<float> draft_probs;      // [nextn] confidences for the varlen allocator
  bool has_draft_probs = false;
  uint64_t sched_stamp = 0;   // generation of the last decode step that selected it
  uint64_t update_stamp = 0;  // duplicate-id detection inside one update() call

  int32_t len() const { return static_cast<int32_t>(tokens.size()); }
  int32_t num_output_tokens() const { return len() - num_prompt_tokens; }
  bool has_inflight_prefill() const {
    for (const auto& s : inflight)
      if (s.kind == InflightStep::PREFILL) return true;
    return false;
  }
  // Sum of decode reservations in flight: the most tokens the in-flight steps can still add.
  int32_t inflight_reserve() const {
    int32_t r = 0;
    for (const auto& s : inflight)
      if (s.kind == InflightStep::DECODE) r += s.reserve;
    return r;
  }
  // Sum of CPU-scheduled q_len of in-flight decode steps (optimistic seqlens_k uses these).
  int32_t inflight_q() const {
    int32_t q = 0;
    for (const auto& s : inflight)
      if (s.kind == InflightStep::DECODE) q += s.q_len;
    return q;
  }
};

}  // namespace deepinfer
