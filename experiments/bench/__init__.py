"""Benchmarks behind `specrl bench`: each prints its rows as it measures and saves JSON.

  common    the shared harness: arms timed in turns, the step profiler, setup, saving
  generate  plain generation tokens/s per batch size
  speed     speculative decoding against plain, on the embedded engine or vLLM
  profile   where a plain and a chain-speculative engine step spend their time
  overlap   what online draft training adds to the RL step, sequential and overlapped
"""
