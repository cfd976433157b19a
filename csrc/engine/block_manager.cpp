#include "block_manager.hpp"

#include <stdexcept>
#include <string>

namespace deepinfer {

BlockManager::BlockManager(int32_t num_blocks)
    : num_blocks_(num_blocks), sentinel_(num_blocks), num_free_(0) {
  if (num_blocks < 2) {
    throw std::invalid_argument("BlockManager: num_blocks must be >= 2 (id 0 is reserved), got " +
                                std::to_string(num_blocks));
  }
  next_.assign(num_blocks + 1, -1);
  prev_.assign(num_blocks + 1, -1);
  ref_.assign(num_blocks, 0);
  next_[sentinel_] = sentinel_;
  prev_[sentinel_] = sentinel_;
  ref_[0] = 0;
  for (int32_t b = 1; b < num_blocks; ++b) link_tail(b);
}

void BlockManager::link_tail(int32_t b) {
  const int32_t tail = prev_[sentinel_];
  next_[tail] = b;
  prev_[b] = tail;
  next_[b] = sentinel_;
  prev_[sentinel_] = b;
  ++num_free_;
}

void BlockManager::unlink(int32_t b) {
  next_[prev_[b]] = next_[b];
  prev_[next_[b]] = prev_[b];
  next_[b] = -1;
  prev_[b] = -1;
  --num_free_;
}

void BlockManager::check_id(int32_t b, const char* what) const {
  if (b <= 0 || b >= num_blocks_) {
    throw std::invalid_argument(
        std::string("BlockManager.") + what + ": id " + std::to_string(b) +
        (b == 0 ? " is reserved" : " is out of range [1, " + std::to_string(num_blocks_) + ")"));
  }
  if (ref_[b] <= 0) {
    throw std::invalid_argument(std::string("BlockManager.") + what + ": id " + std::to_string(b) +
                                " is not held");
  }
}

int32_t BlockManager::allocate() {
  const int32_t b = next_[sentinel_];
  if (b == sentinel_) {
    throw std::runtime_error("BlockManager.allocate: no free id (pool of " +
                             std::to_string(num_allocatable()) + " is exhausted)");
  }
  unlink(b);
  ref_[b] = 1;
  return b;
}

void BlockManager::free(int32_t b) {
  check_id(b, "free");
  if (--ref_[b] == 0) link_tail(b);
}

void BlockManager::pin(int32_t b) {
  check_id(b, "pin");
  ++ref_[b];
}

int32_t BlockManager::ref_count(int32_t b) const {
  if (b < 0 || b >= num_blocks_) {
    throw std::invalid_argument("BlockManager.ref_count: id " + std::to_string(b) + " is out of range [0, " +
                                std::to_string(num_blocks_) + ")");
  }
  return ref_[b];
}

double BlockManager::usage() const {
  return 1.0 - static_cast<double>(num_free_) / static_cast<double>(num_allocatable());
}

std::vector<int32_t> BlockManager::free_list() const {
  std::vector<int32_t> out;
  out.reserve(num_free_);
  for (int32_t b = next_[sentinel_]; b != sentinel_; b = next_[b]) out.push_back(b);
  return out;
}

int64_t BlockManager::total_refs() const {
  int64_t s = 0;
  for (int32_t r : ref_) s += r;
  return s;
}

std::string BlockManager::check() const {
  if (ref_[0] != 0) return "id 0 has a reference";
  std::vector<char> seen(num_blocks_, 0);
  int32_t count = 0;
  int32_t prev = sentinel_;
  for (int32_t b = next_[sentinel_]; b != sentinel_; b = next_[b]) {
    if (b <= 0 || b >= num_blocks_) return "free list holds invalid id " + std::to_string(b);
    if (seen[b]) return "free list has a cycle at id " + std::to_string(b);
    if (prev_[b] != prev) return "free list back link broken at id " + std::to_string(b);
    if (ref_[b] != 0) return "free id " + std::to_string(b) + " has ref count " + std::to_string(ref_[b]);
    seen[b] = 1;
    prev = b;
    ++count;
  }
  if (prev_[sentinel_] != prev) return "free list tail link broken";
  if (count != num_free_)
    return "num_free " + std::to_string(num_free_) + " != list length " + std::to_string(count);
  for (int32_t b = 1; b < num_blocks_; ++b) {
    if (!seen[b] && ref_[b] <= 0) return "id " + std::to_string(b) + " is neither free nor referenced";
  }
  return "";
}

}  // namespace deepinfer
