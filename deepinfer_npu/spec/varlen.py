"""Varlen verification (DSpark varlen, seed §7.2): the step-time curve and the online estimators.

* At start-up the forward time of a decode step is profiled per graph size (total_q tokens): 5 runs, drop the
  largest and smallest, mean. The curve is cached in a file keyed by the model, dtype, backend and sizes
  (``$DEEPINFER_CACHE_DIR`` or ``~/.cache/deepinfer_npu``).
* ``ForwardRuntimeEstimator``: the curve ignores context length, so online a per-token slope of the extra time
  (measured minus curve) is fitted over the last 5000 decode steps as a two-level median (median of per-group
  median pairwise slopes), robust to outliers; the remainder per step is kept as an intercept.
* ``SamplerRuntimeEstimator``: the median of the last 9 sampling times per batch size.

The C++ allocator (``_core.varlen_allocate`` inside ``Scheduler.schedule``) picks total_q maximising expected
tokens / (curve[graph] + slope * graph + sampler_ms). Under ZOS the CPU only has the confidences of step N-2 when
it plans N (they decide total_q, hence the graph); the device re-splits with N-1's (``zos_fixup``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections import defaultdict, deque
from pathlib import Path

import numpy as np
import torch

from deepinfer_npu import envs
from deepinfer_npu.hal.graph_sizes import graph_sizes

logger = logging.getLogger(__name__)

def trimmed_mean(samples: list[float]) -> float:
    """Mean after dropping one largest and one smallest sample (the seed's 5-run rule)."""
    if len(samples) <= 2:
        return float(sum(samples) / len(samples))
    s = sorted(samples)[1:-1]
    return float(sum(s) / len(s))


class ForwardRuntimeEstimator:
    """Online correction of the start-up curve from the last ``window`` decode steps.

    Each step adds ``(graph_size, extra_ms)`` with ``extra_ms = measured - curve[graph_size]``. ``slope()`` is the
    per-token extra time: a two-level median (median over groups of the median pairwise slope between steps of
    different sizes, Theil-Sen style, robust to outliers); ``intercept()`` is the median per-step remainder
    (context-length cost the curve, profiled at a short context, does not see). When the sizes barely vary the
    slope is not identifiable and stays 0, so the remainder lands in the intercept instead of being spread per
    token.
    """

    def __init__(self, window: int = 5000, groups: int = 50) -> None:
        self.window, self.groups = window, groups
        # numpy ring buffers: the estimates run on the host at every decode step; the list-based version took
        # 1.8 ms a step with a full window (pure Python over 5000 samples, twice)
        self._sizes = np.zeros(window, dtype=np.float64)
        self._extra = np.zeros(window, dtype=np.float64)
        self._count = 0  # samples ever added
        self._cached: tuple[int, float, float] | None = None  # (count, slope, intercept)

    def add(self, graph_size: int, extra_ms: float) -> None:
        i = self._count % self.window
        self._sizes[i], self._extra[i] = graph_size, extra_ms
        self._count += 1

    @property
    def samples(self) -> list[tuple[int, float]]:
        """The window's ``(graph_size, extra_ms)`` samples, oldest first."""
        g, e = self._ordered()
        return [(int(a), float(b)) for a, b in zip(g, e)]

    def _ordered(self) -> tuple[np.ndarray, np.ndarray]:
        n = min(self._count, self.window)
        if self._count <= self.window:
            return self._sizes[:n], self._extra[:n]
        k = self._count % self.window
        return np.concatenate((self._sizes[k:], self._sizes[:k])), np.concatenate((self._extra[k:], self._extra[:k]))

    def _estimates(self) -> tuple[float, float]:
        # Recompute when the window moved by 1/512 of its length (every step up to 512 samples): medians over
        # thousands of steps barely move per step, and each computation is ~0.6 ms of host time at 5000 samples.
        n = min(self._count, self.window)
        if self._cached is not None and self._count - self._cached[0] < max(1, n // 512):
            return self._cached[1], self._cached[2]
        g, e = self._ordered()
        b = self._slope(g, e)
        if len(g) < 512:
            c = max(0.0, float(statistics.median((e - b * g).tolist()))) if len(g) else 0.0
        else:
            c = max(0.0, float(np.median(e - b * g)))
        self._cached = (self._count, b, c)
        return b, c

    def _slope(self, g: np.ndarray, e: np.ndarray) -> float:
        n = len(g)
        if n < 4:
            return 0.0
        size = max(2, n // self.groups)
        if n < 512:  # pure Python is faster than numpy's per-call overhead on short windows
            medians = []
            gl, el = g.tolist(), e.tolist()
            for s0 in range(0, n, size):
                gs, es = gl[s0 : s0 + size], el[s0 : s0 + size]
                pair_slopes = [(e2 - e1) / (g2 - g1) for g1, e1, g2, e2 in zip(gs, es, gs[1:], es[1:]) if g2 != g1]
                if pair_slopes:
                    medians.append(statistics.median(pair_slopes))
            return max(0.0, float(statistics.median(medians))) if len(medians) >= 2 else 0.0
        i = np.arange(n - 1)
        pair = ((i // size) == ((i + 1) // size)) & (g[1:] != g[:-1])  # consecutive steps of one group, sizes differ
        if not pair.any():
            return 0.0
        slopes = (e[1:][pair] - e[:-1][pair]) / (g[1:][pair] - g[:-1][pair])
        at = i[pair]
        table = np.full((-(-n // size), size - 1), np.nan)  # [group, pair within the group]
        table[at // size, at % size] = slopes
        table = np.sort(table, axis=1)  # NaN (no pair) sorts last
        count = np.count_nonzero(~np.isnan(table), axis=1)
        table, count = table[count > 0], count[count > 0]
        rows = np.arange(len(count))
        medians = (table[rows, (count - 1) // 2] + table[rows, count // 2]) / 2  # each group's median
        if len(medians) < 2:
            return 0.0
        return max(0.0, float(np.median(medians)))

    def slope(self) -> float:
        return self._estimates()[0]

    def intercept(self) -> float:
        return self._estimates()[1]


class SamplerRuntimeEstimator:
    def __init__(self, history: int = 9) -> None:
        self.by_batch: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=history))

    def add(self, batch_size: int, ms: float) -> None:
        self.by_batch[batch_size].append(ms)

    def estimate(self, batch_size: int) -> float:
        hist = self.by_batch.get(batch_size)
        if hist:
            return float(statistics.median(hist))
        known = [statistics.median(h) for h in self.by_batch.values() if h]
        return float(statistics.median(known)) if known else 0.0


def _cache_dir() -> Path:
    return envs.CACHE_DIR / "varlen"


def profile_step_time_curve(runner, sizes: list[int], num_drafts: int, runs: int = 5, graphs=None) -> list[float]:
    """Forward time (ms) of a decode step of each total_q in ``sizes`` (dummy rows of ``num_drafts + 1`` tokens
    over a short context written to the padding block 0, so no sequence's cache is touched).

    With ``graphs`` (the worker's :class:`DecodeGraphs`), each size is timed as the replay of its captured graph
    (captured here when it is not yet), i.e. exactly what a decode step of that size runs (seed §7.2)."""
    from deepinfer_npu.model_executor.attention_metadata import build_attention_metadata

    q_per_row = num_drafts + 1
    gen = torch.Generator().manual_seed(0)
    curve = []
    for size in sizes:
        rows = -(-size // q_per_row)
        q = np.full(rows, q_per_row, dtype=np.int64)
        q[-1] = size - q_per_row * (rows - 1)
        k = q + 16
        tables = np.zeros((rows, -(-int(k.max()) // runner.block_size)), dtype=np.int64)
        attn = build_attention_metadata(q, k, tables, runner.block_size, runner.device, is_prefill=False)
        ids = torch.randint(0, runner.model_config.vocab_size, (size,), generator=gen).to(runner.device)
        graph_size = graphs.size_for(size, tables.shape[1]) if graphs is not None else None
        if graph_size is not None and graph_size != size:
            graph_size = None  # not a captured size: time it eagerly
        times = []
        for _ in range(runs + (1 if graph_size is not None else 0)):  # a graph's first run captures it
            runner.backend.synchronize()
            t0 = time.perf_counter()
            if graph_size is None or graphs.run(graph_size, ids, attn) is None:
                hidden, _ = runner.forward(ids, attn)
                runner.logits(hidden, None)
            runner.backend.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        curve.append(trimmed_mean(times[-runs:]))
    return curve


class ConfidenceCalibrator:
    """Online per-position, binned calibration of draft confidences (histogram binning).

    For draft position ``j`` and raw-confidence bin ``b`` it tracks, with exponential forgetting, how often a draft
    verified there (all earlier drafts accepted) was accepted; the calibrated confidence is that empirical rate,
    shrunk towards the position's overall rate with ``prior`` pseudo-counts. A calibrated head (DFlash) maps close
    to itself; MTP's confidence (the draft token's probability) is both under-confident and weakly discriminative
    on our reference model, and a plain rescaling made varlen cut drafts that were then accepted.
    """

    def __init__(self, k: int, bins: int = 10, decay: float = 0.999, prior: float = 5.0,
                 min_position_evidence: float = 20.0) -> None:
        self.k, self.bins, self.decay, self.prior = k, bins, decay, prior
        self.min_position_evidence = min_position_evidence
        self.count = np.zeros((k, bins))
        self.hits = np.zeros((k, bins))
        self.last: dict[int, np.ndarray] = {}

    def _bin(self, conf: np.ndarray) -> np.ndarray:
        b = (np.asarray(conf, dtype=np.float64) * self.bins).astype(np.int64)
        return np.minimum(np.maximum(b, 0), self.bins - 1)  # np.clip costs ~10x more on these tiny arrays

    def observe_verify(self, seq_ids: np.ndarray, drafts: np.ndarray, accepted: np.ndarray) -> None:
        """One verify step's outcome per row. Equivalent to decaying then adding row by row (the order rows arrive
        in), vectorized: row i of n is weighted decay^(n-1-i) and the tables decay by decay^n (a per-row Python
        loop cost ~15 us a row, on the host's critical path at every step)."""
        confs, reach, acc = [], [], []
        for sid, d, a in zip(seq_ids.tolist(), drafts.tolist(), accepted.tolist()):
            conf = self.last.get(sid)
            if conf is None or d <= 0:
                continue
            confs.append(conf)
            reach.append(min(d, a + 1, len(conf)))  # positions 0..reached-1 were verified with earlier ones accepted
            acc.append(min(a, d, len(conf)))
        n = len(confs)
        if n == 0:
            return
        width = max(len(c) for c in confs)
        conf_m = np.zeros((n, width))
        for i, c in enumerate(confs):
            conf_m[i, : len(c)] = c
        j = np.arange(width)[None, :]
        weight = np.broadcast_to((self.decay ** np.arange(n - 1, -1, -1, dtype=np.float64))[:, None], (n, width))
        pos = np.broadcast_to(j, (n, width))
        b = self._bin(conf_m)
        self.count *= self.decay**n
        self.hits *= self.decay**n
        seen = j < np.asarray(reach)[:, None]
        hit = j < np.asarray(acc)[:, None]
        np.add.at(self.count, (pos[seen], b[seen]), weight[seen])
        np.add.at(self.hits, (pos[hit], b[hit]), weight[hit])

    def position_rate(self) -> np.ndarray:
        """Empirical conditional acceptance per position (0.5 before any observation)."""
        n = self.count.sum(axis=1)
        return np.where(n > 0, self.hits.sum(axis=1) / np.maximum(n, 1e-9), 0.5)

    def calibrate(self, seq_ids: np.ndarray, probs: np.ndarray) -> np.ndarray:
        k = probs.shape[1]
        b = self._bin(probs)
        pos = np.broadcast_to(np.arange(k), probs.shape)
        n, h = self.count[pos, b], self.hits[pos, b]
        # Shrink towards the position's empirical rate once it rests on enough evidence, towards the drafter's own
        # confidence before that: a few early rejections must not drive a position's estimate (and with it its
        # verification, hence all further evidence) to zero.
        enough = self.count[:k].sum(axis=1)[None, :] >= self.min_position_evidence
        base = np.where(enough, self.position_rate()[:k][None, :], probs)
        out = ((h + self.prior * base) / (n + self.prior)).astype(np.float32)
        rows = probs.astype(np.float64)  # one conversion; each sequence keeps a view of its row
        for sid, row in zip(seq_ids.tolist(), rows):
            self.last[sid] = row
        return np.clip(out, 0.0, 1.0)

    def forget(self, seq_id: int) -> None:
        self.last.pop(seq_id, None)


class VarlenController:
    """Profiles (or loads) the curve, configures the scheduler, and feeds it the online estimates."""

    def __init__(self, engine, sched_cfg) -> None:
        self.engine = engine
        k = engine.config.nextn
        max_tokens = min(sched_cfg.max_num_batched_tokens, sched_cfg.max_num_seqs * (k + 1))
        self.sizes = graph_sizes(max_tokens)  # the sizes the backend captures graphs for
        self.graphs = getattr(getattr(engine, "worker", None), "graphs", None)  # time graph replays when captured
        self.profile_replays = 0  # graph replays spent timing the curve (0 when it came from the cache)
        self.curve = self._load_or_profile(engine.runner, k)
        engine.scheduler.configure_varlen(np.asarray(self.sizes, dtype=np.int32),
                                          np.asarray(self.curve, dtype=np.float64))
        self.forward_est = ForwardRuntimeEstimator()
        self.sampler_est = SamplerRuntimeEstimator()
        self.chosen_total_q: deque[int] = deque(maxlen=100_000)  # recent decode steps' total_q, for reports
        self.calibrator = ConfidenceCalibrator(k)

    def _key(self, runner, k: int) -> str:
        blob = json.dumps({
            "model": runner.model_config.to_dict() if hasattr(runner.model_config, "to_dict")
            else repr(runner.model_config),
            "dtype": str(runner.dtype), "backend": runner.backend.name, "block": runner.block_size,
            "sizes": self.sizes, "k": k, "torch": torch.__version__, "graphs": self.graphs is not None,
        }, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    def _load_or_profile(self, runner, k: int) -> list[float]:
        path = _cache_dir() / f"{self._key(runner, k)}.json"
        if path.exists():
            try:
                data = json.loads(path.read_text())
                if data.get("sizes") == self.sizes:
                    return [float(x) for x in data["ms"]]
            except (OSError, ValueError, KeyError):
                logger.warning("ignoring unreadable varlen curve cache %s", path)
        t0 = time.perf_counter()
        before = self.graphs.graphs.num_replays if self.graphs is not None else 0
        curve = profile_step_time_curve(runner, self.sizes, k, graphs=self.graphs)
        self.profile_replays = (self.graphs.graphs.num_replays - before) if self.graphs is not None else 0
        logger.info("profiled %d graph sizes in %.1f s (%s)", len(self.sizes), time.perf_counter() - t0,
                    "graph replays" if self.graphs is not None else "eager forwards")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # written whole, then renamed: engines in other processes may read the cache at the same time
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"sizes": self.sizes, "ms": curve, "backend": runner.backend.name,
                                       "graphs": self.graphs is not None}))
            os.replace(tmp, path)
        except OSError as e:  # a read-only home must not stop the engine
            logger.warning("could not cache the varlen curve at %s: %s", path, e)
        return curve

    def graph_size(self, total_q: int) -> int:
        for s in self.sizes:
            if s >= total_q:
                return s
        return self.sizes[-1]

    def observe(self, res) -> None:
        """Feed one finished step's timings; push the estimates and fresh confidences to the scheduler."""
        sched = self.engine.scheduler
        if res.num_drafts is not None:
            self.calibrator.observe_verify(res.seq_ids, res.num_drafts, res.num_accepted)
        if res.draft_probs is not None and res.proposing_rows is not None and len(res.proposing_rows):
            ids = res.seq_ids[res.proposing_rows]
            live = np.array([self.engine._by_seq.get(int(s)) is not None for s in ids], dtype=bool)
            if live.any():
                probs = self.calibrator.calibrate(ids[live], res.draft_probs[live])
                sched.set_draft_probs(ids[live].astype(np.int64), np.ascontiguousarray(probs))
        if res.is_prefill or res.num_tokens == 0:
            return
        self.chosen_total_q.append(res.num_tokens)
        g = self.graph_size(res.num_tokens)
        base = self.curve[self.sizes.index(g)]
        self.forward_est.add(g, res.model_ms - base)
        self.sampler_est.add(len(res.seq_ids), res.sample_ms)
        # The allocator's per-step constant is the sampler time plus the curve's per-step remainder.
        sched.set_runtime_estimates(self.forward_est.slope(),
                                    self.sampler_est.estimate(len(res.seq_ids)) + self.forward_est.intercept())
