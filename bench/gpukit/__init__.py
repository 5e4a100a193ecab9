"""The GPU check kit's cases (bench/gpu_check.py runs each in its own process).

- common.py: the case context (device, 1-rank process group, sizes), the model shapes the
  planner fits, plans built for the shape actually run, engines, timed steps;
- events.py: a profiler window's events as timeline records (raw Kineto events, or its Chrome trace);
- profile.py: a short torch.profiler window -> GPU time by category, the clock during it
  (clocks.py), the compute stream's idle gaps and the GEMMs' TFLOP/s per shape
  (timeline.py);
- hostbound.py: whether the host was late for each idle gap, the host's issue time per step;
- allocator.py: the caching allocator over a window (retries, device frees, expandable
  segments);
- idle.py: the JSON's `idle` summary and printed lines from the finished cases;
- cases.py: environment, eager / compiled throughput, FP8, offload, checkpoint;
- hf_case.py: the same shape in a plain Hugging Face `LlamaForCausalLM` loop;
- cli_cases.py: the `meshtron` command as a user runs it (exit code, last stderr lines);
- wheels.py: the modules a GPU image may lack, found before any case starts.
"""
