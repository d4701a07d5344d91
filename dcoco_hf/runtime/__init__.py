"""The decoding runtime: attach and tuning, the drafter's `propose`, the speculation engine, the two loops that drive
it (transformers' assisted loop through its adapter, and the batched `speculative_generate`), their caches and
schedules.
"""
