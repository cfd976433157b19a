// Python bindings of the engine core: deepinfer_npu._core. This file only registers types and functions;
// argument validation and buffer views live in py_boundary.hpp, the logic in the per-concept sources.
// Bad arguments raise TypeError/ValueError naming the function and the argument.
#include "py_boundary.hpp"

PYBIND11_MODULE(_core, m) {
  m.doc() =
      "deepinfer_npu engine core (C++): BlockManager, SchedulerConfig, Scheduler, ScheduleOutput, "
      "prepare_zos_inputs, varlen_allocate. Contract: docs/interfaces.md section 1.";

  py::register_exception<SeqNotFound>(m, "SeqNotFoundError", PyExc_KeyError);

  py::enum_<SeqStatus>(m, "SeqStatus", "Sequence status; FINISHED_* are terminal.")
      .value("WAITING", SeqStatus::WAITING)
      .value("PROMPTED", SeqStatus::PROMPTED)
      .value("RUNNING", SeqStatus::RUNNING)
      .value("FINISHED_STOPPED", SeqStatus::FINISHED_STOPPED)
      .value("FINISHED_LENGTH", SeqStatus::FINISHED_LENGTH)
      .value("FINISHED_ABORTED", SeqStatus::FINISHED_ABORTED)
      .value("FINISHED_PREEMPTED", SeqStatus::FINISHED_PREEMPTED)
      .value("FINISHED_IGNORED", SeqStatus::FINISHED_IGNORED);

  py::enum_<StepKind>(m, "StepKind",
                      "PREFILL (schedule(True), possibly with 0 sequences), DECODE, EMPTY (schedule(False) "
                      "found nothing to decode).")
      .value("PREFILL", StepKind::PREFILL)
      .value("DECODE", StepKind::DECODE)
      .value("EMPTY", StepKind::EMPTY);

  // ---------------------------------------------------------------- BlockManager
  py::class_<BlockManager>(
      m, "BlockManager",
      "Fixed pool of ids with ref counts; id 0 reserved. Free list = array-backed doubly "
      "linked list: allocate() pops the head, an id whose ref count reaches 0 goes to the tail.")
      .def(py::init<int32_t>(), py::arg("num_blocks"))
      .def("allocate", &BlockManager::allocate,
           "Head of the free list, ref count 1; RuntimeError if none is free.")
      .def("free", &BlockManager::free, py::arg("b"),
           "Drop one reference; ValueError on id 0 / an id not held.")
      .def("pin", &BlockManager::pin, py::arg("b"), "Add a reference to a held id (fork sharing).")
      .def("ref_count", &BlockManager::ref_count, py::arg("b"))
      .def_property_readonly("num_blocks", &BlockManager::num_blocks)
      .def_property_readonly("num_free", &BlockManager::num_free)
      .def_property_readonly("num_allocatable", &BlockManager::num_allocatable)
      .def("usage", &BlockManager::usage, "1 - num_free / num_allocatable")
      .def("can_allocate", &BlockManager::can_allocate, py::arg("n"))
      .def("free_list", &BlockManager::free_list, "Free ids head -> tail.")
      .def("check", &BlockManager::check,
           "'' when the free list and ref counts are consistent, else the problem.");

  py::class_<BlockManagerView>(m, "BlockManagerView", "Read-only view of a scheduler's BlockManager (tests).")
      .def_property_readonly("num_blocks", [](const BlockManagerView& v) { return v.m->num_blocks(); })
      .def_property_readonly("num_free", [](const BlockManagerView& v) { return v.m->num_free(); })
      .def_property_readonly("num_allocatable",
                             [](const BlockManagerView& v) { return v.m->num_allocatable(); })
      .def("usage", [](const BlockManagerView& v) { return v.m->usage(); })
      .def(
          "can_allocate", [](const BlockManagerView& v, int64_t n) { return v.m->can_allocate(n); },
          py::arg("n"))
      .def(
          "ref_count", [](const BlockManagerView& v, int32_t b) { return v.m->ref_count(b); }, py::arg("b"))
      .def("free_list", [](const BlockManagerView& v) { return v.m->free_list(); });

  // ---------------------------------------------------------------- SchedulerConfig
  py::class_<SchedulerConfig> cfg(
      m, "SchedulerConfig",
      "Scheduler arguments (docs/interfaces.md). max_model_len and num_kv_blocks are "
      "required; validate() raises ValueError naming the parameter and the limit.");
  cfg.def(
      py::init([](int32_t max_num_seqs, int32_t max_num_batched_tokens, int32_t max_model_len,
                  int32_t block_size, int32_t num_kv_blocks, double state_slot_ratio, int32_t nextn,
                  int32_t max_num_prompts, int64_t prefill_max_sum_seqlen_k, int32_t prefill_attempt_interval,
                  int32_t prefill_any_attempt_interval, double prefill_kv_usage_threshold,
                  bool stop_preempted_request, bool enable_chunked_prefill, int32_t chunk_alignment) {
        SchedulerConfig c;
        c.max_num_seqs = max_num_seqs;
        c.max_num_batched_tokens = max_num_batched_tokens;
        c.max_model_len = max_model_len;
        c.block_size = block_size;
        c.num_kv_blocks = num_kv_blocks;
        c.state_slot_ratio = state_slot_ratio;
        c.nextn = nextn;
        c.max_num_prompts = max_num_prompts;
        c.prefill_max_sum_seqlen_k = prefill_max_sum_seqlen_k;
        c.prefill_attempt_interval = prefill_attempt_interval;
        c.prefill_any_attempt_interval = prefill_any_attempt_interval;
        c.prefill_kv_usage_threshold = prefill_kv_usage_threshold;
        c.stop_preempted_request = stop_preempted_request;
        c.enable_chunked_prefill = enable_chunked_prefill;
        c.chunk_alignment = chunk_alignment;
        return c;
      }),
      py::kw_only(), py::arg("max_num_seqs") = 256, py::arg("max_num_batched_tokens") = 8192,
      py::arg("max_model_len") = 0, py::arg("block_size") = 64, py::arg("num_kv_blocks") = 0,
      py::arg("state_slot_ratio") = 1.2, py::arg("nextn") = 0, py::arg("max_num_prompts") = 0,
      py::arg("prefill_max_sum_seqlen_k") = 0, py::arg("prefill_attempt_interval") = 70,
      py::arg("prefill_any_attempt_interval") = 100, py::arg("prefill_kv_usage_threshold") = 0.9,
      py::arg("stop_preempted_request") = true, py::arg("enable_chunked_prefill") = true,
      py::arg("chunk_alignment") = 1);
#define CFG_FIELD(name) cfg.def_readwrite(#name, &SchedulerConfig::name)
  CFG_FIELD(max_num_seqs);
  CFG_FIELD(max_num_batched_tokens);
  CFG_FIELD(max_model_len);
  CFG_FIELD(block_size);
  CFG_FIELD(num_kv_blocks);
  CFG_FIELD(state_slot_ratio);
  CFG_FIELD(nextn);
  CFG_FIELD(max_num_prompts);
  CFG_FIELD(prefill_max_sum_seqlen_k);
  CFG_FIELD(prefill_attempt_interval);
  CFG_FIELD(prefill_any_attempt_interval);
  CFG_FIELD(prefill_kv_usage_threshold);
  CFG_FIELD(stop_preempted_request);
  CFG_FIELD(enable_chunked_prefill);
  CFG_FIELD(chunk_alignment);
#undef CFG_FIELD
  cfg.def("validate", &SchedulerConfig::validate)
      .def_property_readonly("num_state_slots", &SchedulerConfig::num_state_slots,
                             "floor(max_num_seqs * state_slot_ratio) + 1 (slot 0 is a dummy)")
      .def_property_readonly("max_blocks_per_seq", &SchedulerConfig::max_blocks_per_seq,
                             "ceil(max_model_len / block_size): the width of ScheduleOutput.block_tables")
      .def("__repr__", &SchedulerConfig::repr);

  // ---------------------------------------------------------------- ScheduleOutput
  py::class_<PyScheduleOutput>(
      m, "ScheduleOutput",
      "One step from Scheduler.schedule(). The array fields are read-only numpy views over buffers owned by "
      "the "
      "C++ scheduler: they are valid until the next schedule() call, which overwrites them (accessing a "
      "field of "
      "a stale output raises ValueError; arrays taken earlier silently change). Copy what you keep. Fields: "
      "kind, num_seqs, num_tokens, seq_ids int64[n], seqlens_q int32[n], seqlens_k int32[n], num_drafts "
      "int32[n], "
      "is_last_chunk bool[n], input_ids int32[num_tokens] (-1 = filled on device), block_tables int32[n, "
      "max_blocks_per_seq] (0-padded), state_slots int32[n], clone_blocks int32[c, 2], clone_states "
      "int32[c2, 2], "
      "zero_states int32[z], prev_remap int32[n], remap_identical, finished list[(seq_id, SeqStatus, "
      "reason)].")
      .def_property_readonly("kind", [](const PyScheduleOutput& w) { return w.out.kind; })
      .def_property_readonly("num_seqs", [](const PyScheduleOutput& w) { return w.out.num_seqs; })
      .def_property_readonly("num_tokens", [](const PyScheduleOutput& w) { return w.out.num_tokens; })
      .def_property_readonly("max_blocks_per_seq",
                             [](const PyScheduleOutput& w) { return w.out.max_blocks_per_seq; })
      .def_property_readonly("remap_identical",
                             [](const PyScheduleOutput& w) { return w.out.remap_identical; })
      .def_property_readonly(
          "is_stale", [](const PyScheduleOutput& w) { return w.sched->generation() != w.out.generation; })
      .def_property_readonly("seq_ids", OUT_VIEW(seq_ids, int64_t, o.num_seqs))
      .def_property_readonly("seqlens_q", OUT_VIEW(seqlens_q, int32_t, o.num_seqs))
      .def_property_readonly("seqlens_k", OUT_VIEW(seqlens_k, int32_t, o.num_seqs))
      .def_property_readonly("num_drafts", OUT_VIEW(num_drafts, int32_t, o.num_seqs))
      .def_property_readonly("is_last_chunk", OUT_VIEW(is_last_chunk, bool, o.num_seqs))
      .def_property_readonly("input_ids", OUT_VIEW(input_ids, int32_t, o.num_tokens))
      .def_property_readonly("block_tables",
                             OUT_VIEW(block_tables, int32_t, o.num_seqs, o.max_blocks_per_seq))
      .def_property_readonly("state_slots", OUT_VIEW(state_slots, int32_t, o.num_seqs))
      .def_property_readonly("clone_blocks", OUT_VIEW(clone_blocks, int32_t, o.num_clone_blocks, 2))
      .def_property_readonly("clone_states", OUT_VIEW(clone_states, int32_t, o.num_clone_states, 2))
      .def_property_readonly("zero_states", OUT_VIEW(zero_states, int32_t, o.num_zero_states))
      .def_property_readonly("prev_remap", OUT_VIEW(prev_remap, int32_t, o.num_seqs))
      .def_property_readonly("finished",
                             [](const PyScheduleOutput& w) {
                               py::list l;
                               for (const auto& f : w.out.finished)
                                 l.append(py::make_tuple(f.seq_id, f.status, f.reason));
                               return l;
                             })
      .def("__repr__", [](const PyScheduleOutput& w) {
        const char* k = w.out.kind == StepKind::PREFILL  ? "PREFILL"
                        : w.out.kind == StepKind::DECODE ? "DECODE"
                                                         : "EMPTY";
        return std::string("ScheduleOutput(kind=") + k + ", num_seqs=" + std::to_string(w.out.num_seqs) +
               ", num_tokens=" + std::to_string(w.out.num_tokens) +
               ", finished=" + std::to_string(w.out.finished.size()) + ")";
      });

  // ---------------------------------------------------------------- Scheduler
  py::class_<Scheduler>(
      m, "Scheduler",
      "Sequences, the KV BlockManager and the state-slot BlockManager, and the NORMAL-engine "
      "policy (docs/interfaces.md section 1). Thread-safe; schedule() releases the GIL.")
      .def(py::init<const SchedulerConfig&>(), py::arg("config"))
      .def(
          "add_seq",
          [](Scheduler& s, int64_t seq_id, const py::object& prompt_token_ids, int64_t max_new_tokens) {
            auto ids = int_array<int32_t>(prompt_token_ids, 1, "add_seq", "prompt_token_ids", 0, kMaxToken);
            s.add_seq(seq_id, ids.data(), ids.size(), max_new_tokens);
          },
          py::arg("seq_id"), py::arg("prompt_token_ids"), py::arg("max_new_tokens"),
          "Queue a request (WAITING, FIFO). max_new_tokens bounds reservations only; Python decides when it "
          "finishes (finish()).")
      .def("fork_seq", &Scheduler::fork_seq, py::arg("parent_id"), py::arg("child_id"),
           py::arg("max_new_tokens") = -1, py::arg("last_token") = -1,
           "Child shares the parent's blocks and state slot (pinned), PROMPTED; copy-on-write (last partial "
           "block and the slot) happens in the child's first decode step (clone_blocks / clone_states). "
           "max_new_tokens: the child's limit counted from the prompt (-1: the parent's). last_token >= 0 replaces "
           "the child's last token (its own first sample when forked right after the parent's prefill, n > 1); "
           "the parent's last token must not be computed yet.")
      .def("abort", &Scheduler::abort, py::arg("seq_id"),
           "Abort in any state (including in flight); frees at once. False if unknown or already finished.")
      .def("finish", &Scheduler::finish, py::arg("seq_id"), py::arg("status"),
           "FINISHED_STOPPED / FINISHED_LENGTH decided by Python; frees. False if unknown or already "
           "finished.")
      .def("prefill_vote", &Scheduler::prefill_vote,
           "-1: force prefill (ANY point and wants it, or nothing runs and the waiting head is schedulable); "
           "1: ALL point and wants it; 0: otherwise. All-reduce MIN across DP ranks, then schedule(global != "
           "0).")
      .def("restart_attempt_points", &Scheduler::restart_attempt_points,
           "Count attempt points from the current decode step (call when no sequence runs in the whole DP group: "
           "every rank restarts together).")
      .def(
          "schedule",
          [](py::object self, bool do_prefill) {
            Scheduler& s = self.cast<Scheduler&>();
            PyScheduleOutput w;
            {
              py::gil_scoped_release release;
              w.out = s.schedule(do_prefill);
            }
            w.sched = &s;
            w.owner = self;
            return w;
          },
          py::arg("do_prefill"),
          "Schedule one step (all prefill or all decode) without holding the GIL. The returned arrays are "
          "views "
          "over C++ buffers, valid until the next schedule().")
      .def(
          "update",
          [](Scheduler& s, const py::object& seq_ids, const py::object& num_new_tokens,
             const py::object& new_token_ids) {
            auto ids = int_array<int64_t>(seq_ids, 1, "update", "seq_ids");
            auto cnt = int_array<int32_t>(num_new_tokens, 1, "update", "num_new_tokens", 0, kMaxToken);
            auto toks = int_array<int32_t>(new_token_ids, 1, "update", "new_token_ids", 0, kMaxToken);
            if (cnt.size() != ids.size()) {
              throw py::value_error("update: num_new_tokens has " + std::to_string(cnt.size()) +
                                    " entries but seq_ids has " + std::to_string(ids.size()));
            }
            s.update(ids.data(), cnt.data(), ids.size(), toks.data(), toks.size());
          },
          py::arg("seq_ids"), py::arg("num_new_tokens"), py::arg("new_token_ids"),
          "Apply a step's results: prefill chunk 1 token for the last chunk else 0; decode a+1 tokens. "
          "Unknown or "
          "finished ids are ignored.")
      .def(
          "set_draft_probs",
          [](Scheduler& s, const py::object& seq_ids, const py::object& probs) {
            auto ids = int_array<int64_t>(seq_ids, 1, "set_draft_probs", "seq_ids");
            auto p = float_array<float>(probs, 2, "set_draft_probs", "probs", 0.0, 1.0);
            if (p.shape(0) != ids.size()) {
              throw py::value_error("set_draft_probs: probs has " + std::to_string(p.shape(0)) +
                                    " rows but seq_ids has " + std::to_string(ids.size()));
            }
            s.set_draft_probs(ids.data(), ids.size(), p.data(), p.shape(1));
          },
          py::arg("seq_ids"), py::arg("probs"), "Per-draft acceptance probabilities [n, nextn] for varlen.")
      .def(
          "configure_varlen",
          [](Scheduler& s, const py::object& graph_sizes, const py::object& step_ms) {
            s.configure_varlen(make_curve(graph_sizes, step_ms, "configure_varlen"));
          },
          py::arg("graph_sizes"), py::arg("step_ms"), "Enable varlen verification (when nextn > 0).")
      .def("set_runtime_estimates", &Scheduler::set_runtime_estimates, py::arg("slope_ms_per_token"),
           py::arg("sampler_ms"))
      .def("get_seq_status", &Scheduler::get_seq_status, py::arg("seq_id"),
           "Status of a live or recently finished id; KeyError if unknown.")
      .def(
          "seq_info", [](const Scheduler& s, int64_t id) { return seq_info_dict(s.seq_info(id)); },
          py::arg("seq_id"), "Snapshot dict of a live sequence (tests, debugging).")
      .def_property_readonly("num_waiting", &Scheduler::num_waiting)
      .def_property_readonly("num_running", &Scheduler::num_running, "PROMPTED + RUNNING")
      .def_property_readonly("num_preemptions", &Scheduler::num_preemptions)
      .def_property_readonly("num_decode_steps", &Scheduler::num_decode_steps)
      .def_property_readonly("varlen_enabled", &Scheduler::varlen_enabled)
      .def_property_readonly("config", &Scheduler::config)
      .def_property_readonly("max_blocks_per_seq",
                             [](const Scheduler& s) { return s.config().max_blocks_per_seq(); })
      .def("kv_usage", &Scheduler::kv_usage)
      .def("has_unfinished", &Scheduler::has_unfinished)
      .def_property_readonly("kv_block_manager",
                             [](py::object self) {
                               return BlockManagerView{&self.cast<const Scheduler&>().kv_block_manager(),
                                                       self};
                             })
      .def_property_readonly("state_manager",
                             [](py::object self) {
                               return BlockManagerView{&self.cast<const Scheduler&>().state_manager(), self};
                             })
      .def("check_invariants", &Scheduler::check_invariants,
           "Raises RuntimeError naming the first violation.");

  // ---------------------------------------------------------------- free functions
  m.def(
      "prepare_zos_inputs",
      [](const py::object& prev_ids, const py::object& cur_ids) {
        auto p = int_array<int64_t>(prev_ids, 1, "prepare_zos_inputs", "prev_ids");
        auto c = int_array<int64_t>(cur_ids, 1, "prepare_zos_inputs", "cur_ids");
        py::array_t<int32_t> remap(c.size());
        const bool identical =
            prepare_zos_inputs(p.data(), p.size(), c.data(), c.size(), remap.mutable_data());
        return py::make_tuple(remap, identical);
      },
      py::arg("prev_ids"), py::arg("cur_ids"),
      "(remap int32[n], identical): row of each cur id in prev_ids or -1; identical = same list (fast "
      "path).");

  m.def(
      "varlen_allocate",
      [](const py::object& probs, const py::object& graph_sizes, const py::object& step_ms,
         double slope_ms_per_token, double sampler_ms, int32_t max_total_q) {
        auto p = float_array<float>(probs, 2, "varlen_allocate", "probs", 0.0, 1.0);
        VarlenCurve curve = make_curve(graph_sizes, step_ms, "varlen_allocate");
        if (!(std::isfinite(slope_ms_per_token) && slope_ms_per_token >= 0))
          throw py::value_error("varlen_allocate: slope_ms_per_token must be finite and >= 0");
        if (!(std::isfinite(sampler_ms) && sampler_ms >= 0))
          throw py::value_error("varlen_allocate: sampler_ms must be finite and >= 0");
        if (max_total_q < 0)
          throw py::value_error("varlen_allocate: max_total_q must be >= 0 (0 = no extra cap)");
        const auto n = static_cast<int32_t>(p.shape(0));
        const auto k = static_cast<int32_t>(p.shape(1));
        py::array_t<int32_t> drafts(n);
        VarlenAllocator alloc;
        const int32_t total_q = alloc.allocate(p.data(), n, k, nullptr, curve, slope_ms_per_token, sampler_ms,
                                               max_total_q, drafts.mutable_data());
        return py::make_tuple(total_q, drafts);
      },
      py::arg("probs"), py::arg("graph_sizes"), py::arg("step_ms"), py::arg("slope_ms_per_token") = 0.0,
      py::arg("sampler_ms") = 0.0, py::arg("max_total_q") = 0,
      "Pure varlen allocator (seed 7.2): (total_q, drafts int32[n]); each request verifies a prefix of its "
      "drafts. Ties: equal cumulative probabilities ordered by draft position then request; equal scores "
      "keep the "
      "smaller total_q. total_q <= largest graph size (and <= max_total_q when > 0).");
}
