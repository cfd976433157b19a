// BlockManager: a fixed pool of ids (paged-KV blocks or per-sequence state slots) with reference counts.
//
// Id 0 is reserved: it is never handed out; block tables use it as the "empty" entry and CUDA-graph padding
// rows point at it. Free ids live in an array-backed doubly linked list threaded through `next_`/`prev_` with
// a sentinel at index `num_blocks`: allocate() pops the head, an id whose reference count drops to 0 is
// appended at the tail. Every operation is O(1). No hashing, no prefix index (seed §5.4): sharing happens
// only through fork (pin).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace deepinfer {

class BlockManager {
 public:
  explicit BlockManager(int32_t num_blocks);

  // Takes the head of the free list with reference count 1. Throws std::runtime_error when none is free.
  int32_t allocate();
  // Drops one reference; at 0 the id is appended to the tail of the free list. Throws std::invalid_argument
  // for id 0, an out-of-range id or an id that is not held.
  void free(int32_t b);
  // Adds a reference to a held id (fork sharing). Throws std::invalid_argument if the id is not held.
  void pin(int32_t b);

  int32_t ref_count(int32_t b) const;
  int32_t num_blocks() const { return num_blocks_; }
  int32_t num_free() const { return num_free_; }
  int32_t num_allocatable() const { return num_blocks_ - 1; }
  bool can_allocate(int64_t n) const { return n <= num_free_; }
  // 1 - num_free / num_allocatable.
  double usage() const;
  // Free ids from head to tail (tests, debugging).
  std::vector<int32_t> free_list() const;
  // Sum of all reference counts.
  int64_t total_refs() const;
  // Walks the free list and checks it against the reference counts; returns an empty string or the first
  // problem.
  std::string check() const;

 private:
  void check_id(int32_t b, const char* what) const;
  void link_tail(int32_t b);
  void unlink(int32_t b);

  int32_t num_blocks_;
  int32_t sentinel_;
  int32_t num_free_;
  std::vector<int32_t> next_;
  std::vector<int32_t> prev_;
  std::vector<int32_t> ref_;
};

}  // namespace deepinfer
