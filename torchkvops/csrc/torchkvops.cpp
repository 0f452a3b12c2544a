// Every torchkvops schema lives in this one TORCH_LIBRARY block. Kernels register against these
// schemas from cpu/*.cpp and cuda/*.cu; fake kernels and autograd are registered in Python (ops.py).
#include <Python.h>
#include <torch/library.h>

extern "C" {
// `import torchkvops._C` only needs a module object: loading the shared library runs the static
// registrations below. No pybind11: every entry point goes through the dispatcher.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(torchkvops, m) {
  // In place: rows [0, batch) hold `batch` prompts' KV at positions [0, num_tokens); afterwards rows
  // [0, batch*repeats) hold them in repeat_interleave order. Rows at dim -4, positions at dim -2.
  m.def("repeat_kv_cache_(Tensor(a!) cache, int batch, int repeats, int num_tokens) -> ()");
  // Functional: cache.repeat_interleave(repeats, dim=-4) as a new contiguous tensor.
  m.def("repeat_kv_cache(Tensor cache, int repeats) -> Tensor");
  // In place: cache[layer, 0, i, :, start[i]:start[i]+q] = key[i] and cache[layer, 1, ...] = value[i] for
  // every i < r, where key and value are [r, kv_heads, q, head_dim] and cache is [layers, 2, rows, kv_heads,
  // max_tokens, head_dim]. `start` is an int64 tensor of 1 element (every row's) or r (one per row), so a
  // compiled decode step never recompiles on it.
  // Taking the whole buffer (not a per-layer view) keeps Inductor from rewriting the buffer around
  // the write.
  m.def("write_kv_(Tensor(a!) cache, Tensor key, Tensor value, int layer, Tensor start) -> ()");
  // In place, by slot (a paged pool, as vLLM's reshape_and_cache writes): cache is [layers, 2, blocks,
  // kv_heads, block_size, head_dim], key and value [r, kv_heads, q, head_dim], slots int64 [r, q] ([r] when
  // q == 1); token t of row i goes to slot s = slots[i][t]: cache[layer, 0, s / block_size, :, s %
  // block_size] = key[i, :, t] (index 1 for value). Slots stay on the device: one launch, no host sync.
  m.def("write_kv_slots_(Tensor(a!) cache, Tensor key, Tensor value, int layer, Tensor slots) -> ()");
  // Functional: merge two partial attentions over disjoint key sets into the attention over their
  // union. out_a, out_b: [..., heads, head_dim] (float32/16, bfloat16; may differ); lse_a, lse_b:
  // [..., heads] float32, natural log. Returns (out in out_a's dtype, lse float32), both contiguous:
  // out = (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b), lse = log(e^lse_a + e^lse_b).
  m.def("merge_attention_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor, Tensor)");
  // Functional: decode attention over paged KV, reading only the keys each row has written. query
  // [rows, heads, head_dim]; key_cache, value_cache [num_blocks, kv_heads, block_size, head_dim] (a pool of
  // blocks, query's dtype); block_tables int32 [rows, max_blocks]: row r's key t lies in block
  // block_tables[r][t / block_size] at slot t % block_size; seq_lens int32 [rows]: row r reads keys
  // [0, seq_lens[r]) (seq_starts int32 [rows]: [seq_starts[r], seq_lens[r])). query_positions int64 [rows, heads]
  // (None: seq_lens - 1): a query sees key t when t <= its position and, with window > 0, position - t < window. Scores
  // scale * q.k, capped by softcap > 0 (softcap * tanh(s / softcap)); heads grouped over kv_heads (heads % kv_heads ==
  // 0). Returns (out [rows, heads, head_dim] in query's dtype, lse float32 [rows, heads], natural log; a row that sees
  // no key: 0 and -inf), so that levels merge with merge_attention_states.
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
      "Tensor? query_positions, float scale, int window, float softcap, Tensor? seq_starts=None) -> (Tensor, Tensor)");
  // Functional: the next token of each row of logits [rows, vocab] -> int64 [rows], by Gumbel-max
  // with noise hashed from (keys[row], step, token): greedy when temperature == 0, else
  // argmax(logits / temperature + noise) over the tokens that top_k (0 = off) and top_p (1 = off)
  // keep. `step` is a 1-element int64 tensor, so a compiled decode step never recompiles on it.
  m.def("sample_tokens(Tensor logits, Tensor keys, Tensor step, float temperature, int top_k, float top_p) -> Tensor");
  // Functional: sample_tokens' tokens, and each one's log-probability under the distribution it was
  // drawn from (float32 [rows]): log_softmax of logits / temperature over the tokens top_k / top_p keep
  // (greedy: of the raw logits). The same tokens as sample_tokens.
  m.def(
      "sample_tokens_with_logprobs(Tensor logits, Tensor keys, Tensor step, float temperature, int top_k, "
      "float top_p) -> (Tensor, Tensor)");
  // Private, CPU only, for the tests: the CUDA kernel's row body (sample_tokens_row.h) run over an
  // emulated 512-thread block (cpu/sample_tokens_emulated.cpp), temperature applied as CUDA applies it
  // (times its float32 reciprocal). Returns (tokens int64 [rows], log-probabilities float32: [rows] when
  // with_logprobs, else [0]). No fake kernel or Python wrapper: tests call it eagerly through
  // torch.ops.torchkvops._sample_tokens_cuda_emulated, never under torch.compile.
  m.def(
      "_sample_tokens_cuda_emulated(Tensor logits, Tensor keys, Tensor step, float temperature, int top_k, "
      "float top_p, bool with_logprobs) -> (Tensor, Tensor)");
}
