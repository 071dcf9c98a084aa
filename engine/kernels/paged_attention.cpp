// Paged attention for CPU over a flat batch of query tokens (decode, prefill and chunked prefill).
//
// Query token j of sequence i (0-based inside its chunk of q_i tokens) sits at position
// ctx_i + j, where ctx_i = seq_len_i - q_i tokens were cached before this step, and attends to
// positions [0, ctx_i + j] of that sequence, read through its block table. K/V caches are laid out
// [num_blocks, num_kv_heads, block_size, head_dim] so one head's rows of one block are contiguous.
//
// Work is split over (sequence, kv head, tile of queries); each item streams the sequence's K/V
// once with an online softmax (per block: scores, running max, rescale, accumulate), reusing every
// loaded K/V row for all the tile's queries and all query heads that share the kv head (GQA).
// Decode rows (one query per sequence) take attend_decode_avx2 instead: a thread's share of the
// batch in two passes, scores over its blocks in physical order, values in each sequence's order
// (over a bf16 cache on CPUs with
// AVX512-BF16 and no AMX, in bf16 dot products: bf16_decode_attention()). The kernels themselves live in
// attention_kernels.h, templated on the cache's element type (cache.kv_cache_dtype); prefill tiles
// over a bf16 cache on those same CPUs take attend_prefill_bf16 (attention_bf16_prefill.h). The
// threads take the tiles costliest first from a shared counter.
// Parallelism is torch's own thread pool (at::parallel_for), so it never fights torch's GEMMs.
// A sliding window (`window` > 0, once some sequence is longer than it) or a logit soft-cap
// (`softcap` > 0) sends every item through attend_item, which takes both; the AVX2 paths above
// are the plain causal ones. Attention sinks (`sinks`, a float32 logit per query head: GPT-OSS)
// take attend_item too; without them (None) every path is as it was.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "attention_kernels.h"
#include "attention_bf16_prefill.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace attention_kernels;

at::Tensor paged_attention(const at::Tensor& query,        // [T, Hq, D] float32
                           const at::Tensor& key_cache,    // [N, Hkv, bs, D] f32/bf16/f16, contiguous
                           const at::Tensor& value_cache,  // [N, Hkv, bs, D] as key_cache
                           const at::Tensor& block_tables, // [B, max_blocks] int32
                           const at::Tensor& query_start,  // [B + 1] int32
                           const at::Tensor& seq_lens,     // [B] int32
                           double scale, int64_t window, double softcap,
                           const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.scalar_type() == at::kFloat, "paged_attention: float32 queries only");
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_attention: key and value caches of different dtypes");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.stride(2) == 1, "query rows must be contiguous in head_dim");
  const auto tables = block_tables.contiguous();
  const auto starts = query_start.contiguous();
  const auto lens = seq_lens.contiguous();
  const int num_heads = query.size(1), head_dim = query.size(2);
  const int num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "heads must be a multiple of kv heads");
  const int group = num_heads / num_kv_heads;
  const int num_seqs = lens.size(0);
  const int max_blocks = tables.size(1);
  auto out = at::empty({query.size(0), num_heads, head_dim}, query.options());

  const int* tp = tables.data_ptr<int>();
  const int* sp = starts.data_ptr<int>();
  const int* lp = lens.data_ptr<int>();
  const bool windowed = window > 0 && num_seqs > 0 && *std::max_element(lp, lp + num_seqs) > window;
  at::Tensor sink_values;
  if (sinks.has_value() && sinks->defined()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                    sinks->size(0) == num_heads,
                "paged_attention: sinks must be float32 [", num_heads, "]");
    sink_values = sinks->contiguous();
  }
  const float* sink_ptr = sink_values.defined() ? sink_values.data_ptr<float>() : nullptr;
  const bool masked = windowed || softcap > 0 || sink_ptr != nullptr;
  const int item_window = windowed ? static_cast<int>(window) : 0;
  const float item_softcap = static_cast<float>(softcap);
  // Work items: (sequence, kv heads, tile of queries). The AVX2 path takes all kv heads of a
  // sequence at once (contiguous block reads); the generic path one head per item.
#ifdef BATCHINFER_AVX2
  const bool all_heads = !masked && head_dim % 8 == 0 && (head_dim == 64 || head_dim == 128);
  const bool decode_path = all_heads && block_size % 8 == 0;
#else
  const bool all_heads = false;
#endif
  struct Item { int seq, kv_head, num_kv, q_begin, q_count; };
  std::vector<Item> items;
  std::vector<int> decode_seqs;  // one query each: attend_decode_avx2 (scores in physical block
                                 // order, values in each sequence's)
  for (int i = 0; i < num_seqs; ++i) {
    const int nq = sp[i + 1] - sp[i];
#ifdef BATCHINFER_AVX2
    if (decode_path && nq == 1) {
      decode_seqs.push_back(i);
      continue;
    }
#endif
    for (int h = 0; h < num_kv_heads; h += all_heads ? num_kv_heads : 1)
      for (int j = 0; j < nq; j += kQueryTile)
        items.push_back({i, h, all_heads ? num_kv_heads : 1, j, std::min(kQueryTile, nq - j)});
  }
  const float* qp = query.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qts = query.stride(0), qhs = query.stride(1);
  const int64_t ots = out.stride(0), ohs = out.stride(1);
  const int64_t block_stride = key_cache.stride(0), head_stride = key_cache.stride(1);
  const float fscale = static_cast<float>(scale);

  // The cache's element type: float32, or bf16 / fp16 widened to float32 on every load.
  auto attend_all = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    const T* kp = key_cache.data_ptr<T>();
    const T* vp = value_cache.data_ptr<T>();
#ifdef BATCHINFER_AVX2
    if (!decode_seqs.empty()) {
      // Contiguous runs of sequences, one per thread, balanced by tokens attended.
      const int parts = std::max(1, std::min<int>(at::get_num_threads(), decode_seqs.size()));
      std::vector<DecodeSeq> dseqs;
      int64_t total = 0;
      for (int i : decode_seqs) {
        dseqs.push_back({qp + sp[i] * qts, op + sp[i] * ots, tp + static_cast<int64_t>(i) * max_blocks, lp[i]});
        total += lp[i];
      }
      std::vector<int> bounds(1, 0);
      int64_t run = 0;
      for (int i = 0; i < static_cast<int>(dseqs.size()); ++i) {
        run += dseqs[i].tokens;
        if (run * parts >= total * static_cast<int64_t>(bounds.size()) && static_cast<int>(bounds.size()) < parts)
          bounds.push_back(i + 1);
      }
      bounds.push_back(dseqs.size());
      at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) {
          const int first = bounds[p], count = bounds[p + 1] - first;
          if (count <= 0) continue;
          if (head_dim == 64)
            attend_decode_avx2<64>(dseqs.data() + first, count, kp, vp, group, block_size, qhs, ohs,
                                   block_stride, fscale, num_kv_heads, head_stride);
          else
            attend_decode_avx2<128>(dseqs.data() + first, count, kp, vp, group, block_size, qhs, ohs,
                                    block_stride, fscale, num_kv_heads, head_stride);
        }
      });
    }
#endif
    if (items.empty()) return;
    // Items differ in cost (a causal tile late in a long prompt reads all of it): the threads
    // take them costliest first from a shared counter instead of in fixed contiguous shares.
    auto cost = [&](const Item& it) {  // keys read: the tile's queries x the context they see
      return static_cast<int64_t>(it.num_kv) * it.q_count *
             (2 * (lp[it.seq] - (sp[it.seq + 1] - sp[it.seq]) + it.q_begin) + it.q_count + 32);
    };
    std::stable_sort(items.begin(), items.end(),
                     [&](const Item& a, const Item& b) { return cost(a) > cost(b); });
    std::atomic<int64_t> next{0};
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), items.size());
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      for (int64_t taken = next++; taken < static_cast<int64_t>(items.size()); taken = next++) {
        const Item& it = items[taken];
        const int nq = sp[it.seq + 1] - sp[it.seq];
        const int ctx = lp[it.seq] - nq + it.q_begin;  // cached tokens before this tile's first query
        const int tok = sp[it.seq] + it.q_begin;
        const float* q = qp + tok * qts;
        float* o = op + tok * ots;
        const int* table = tp + static_cast<int64_t>(it.seq) * max_blocks;
        if (masked) {
          if (head_dim == 64)
            attend_item<64>(q, o, kp, vp, table, it.q_count, ctx, group, head_dim, block_size, qts,
                            qhs, ots, ohs, block_stride, fscale, it.kv_head, head_stride,
                            item_window, item_softcap, sink_ptr);
          else if (head_dim == 128)
            attend_item<128>(q, o, kp, vp, table, it.q_count, ctx, group, head_dim, block_size, qts,
                             qhs, ots, ohs, block_stride, fscale, it.kv_head, head_stride,
                             item_window, item_softcap, sink_ptr);
          else
            attend_item<0>(q, o, kp, vp, table, it.q_count, ctx, group, head_dim, block_size, qts,
                           qhs, ots, ohs, block_stride, fscale, it.kv_head, head_stride,
                           item_window, item_softcap, sink_ptr);
          continue;
        }
#ifdef BATCHINFER_BF16_ATTENTION
        if constexpr (kBf16Dot<T>) {
          if (head_dim == 64 || head_dim == 128) {
            (head_dim == 64 ? attend_prefill_bf16<64> : attend_prefill_bf16<128>)(
                q, o, kp, vp, table, it.q_count, ctx, group, block_size, qts, qhs, ots, ohs,
                block_stride, fscale, it.kv_head, it.num_kv, head_stride);
            continue;
          }
        }
#endif
#ifdef BATCHINFER_AVX2
        if (head_dim == 64) {
          attend_item_avx2<64>(q, o, kp, vp, table, it.q_count, ctx, group, block_size, qts, qhs, ots,
                               ohs, block_stride, fscale, it.kv_head, it.num_kv, head_stride);
          continue;
        }
        if (head_dim == 128) {
          attend_item_avx2<128>(q, o, kp, vp, table, it.q_count, ctx, group, block_size, qts, qhs, ots,
                                ohs, block_stride, fscale, it.kv_head, it.num_kv, head_stride);
          continue;
        }
#endif
        attend_item<0>(q, o, kp, vp, table, it.q_count, ctx, group, head_dim, block_size, qts, qhs,
                       ots, ohs, block_stride, fscale, it.kv_head, head_stride);
      }
    });
  };
  switch (key_cache.scalar_type()) {
    case at::kFloat: attend_all(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: attend_all(static_cast<at::BFloat16*>(nullptr)); break;
    case at::kHalf: attend_all(static_cast<at::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "paged_attention: the KV cache must be float32, bfloat16 or float16, got ",
                         key_cache.scalar_type());
  }
  return out;
}

// How decode rows over a bf16 cache compute: "avx512_bf16" (bf16 dot products: the query and the
// softmax weights rounded to bf16, fp32 sums) or "fp32" (widened to fp32, as every other cache).
std::string bf16_decode_attention() {
#ifdef BATCHINFER_BF16_ATTENTION
  return "avx512_bf16";
#else
  return "fp32";
#endif
}

}  // namespace

TORCH_LIBRARY(batchinfer, m) {
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor query_start, Tensor seq_lens, float scale, int window=0, float softcap=0.0, "
        "Tensor? sinks=None) -> Tensor");
  m.def("bf16_decode_attention() -> str", &bf16_decode_attention);
}

TORCH_LIBRARY_IMPL(batchinfer, CPU, m) { m.impl("paged_attention", &paged_attention); }
