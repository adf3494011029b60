"""Modules the scripts in experiments/ share (not scripts themselves).

  cli          run(main): absl's app.run with one-line errors for bad input; quiet JAX start-up;
               the --progress flag and progress bars
  timing       device timing (median per call, kernel profiles), copy bandwidth, device_info, write_json
  step_timing  a speculative step and its parts, and a baseline decode step, timed as decode runs them
               (the run context, `spec.loop.init_state`'s state); --preset / --layers of the benchmarks
  roofline     the byte model of decode and speculative steps (docs/reference.md 4)
  kernel_bench what the kernel benchmarks share (bench_moe, bench_attention, bench_spec_ops, bench_gemv):
               --only / --out / --copy_bytes, the run over sections, KernelPolicy A/Bs, profiles
  torch_attention  torch's SDPA and flex_attention beside bench_attention.py (GPU only)
  reduce_timing the fused sum + add + RMSNorm timed alone (bench_reduce_norm.py, bench_tp.py)
  train_flags  the flags and `loop.fit` settings train_target.py and train_draft.py share

A script run as `python experiments/<script>.py` (from any folder) finds this package because
Python puts the script's folder first on sys.path; tests put experiments/ there themselves.
"""
