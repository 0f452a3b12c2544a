"""The benchmark harness: what `torchkvops bench`, `bench-op`, `bench-train` and `bench-turns` measure, and how.

  matrix   the A/B matrix behind `bench`: every case, its modes interleaved (start reading here)
  cases    the modes, the cases and their run order, synthetic prompts, settings, record fields
  runners  one call of a mode, timed
  metrics  the bytes per decode step, the copy_ roofline, peak memory, traces
  stats    summaries, the median-total iteration's stages, token agreement
  world    the data-parallel processes, and how their records become one
  report   the table, the plot and the JSON document
  lengths  response length profiles (--length-profile)
  mismatch `bench --mismatch`: the rollout's log-probabilities against a trainer's forward
  op       the repeat_kv_cache_ bandwidth table behind `bench-op`, and time_methods (interleaved timing
           of several callables, used by the operator benchmarks in benchmarks/)
  train    plain against shared-prefix forward + backward, behind `bench-train`
  turns    multi-turn rollouts, KV kept against re-prefilled, behind `bench-turns`

It uses the library (torchkvops.rollout, ...) and never the command line (torchkvops.cli), which parses
and checks the arguments and calls in here. A new benchmark mode goes in cases.py and runners.py; a
new standalone benchmark script goes in benchmarks/ and times with op.time_methods or the one clock, torchkvops.rollout.profiling.Clock.
Nothing here imports torch at import time.
"""
