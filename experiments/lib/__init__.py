"""Modules the scripts in experiments/ share (not scripts themselves).

  cli          run(main): absl's app.run with one-line errors for bad input; quiet JAX start-up;
               the --progress flag and progress bars
  timing       device timing (median per call, kernel profiles), copy bandwidth, device_info, write_json
  step_timing  a speculative step and its parts, and a baseline decode step, timed as decode runs them
  roofline     the byte model of decode and speculative steps (docs/reference.md 4)
  train_flags  the flags and `loop.fit` settings train_target.py and train_draft.py share

A script run as `python experiments/<script>.py` (from any folder) finds this package because
Python puts the script's folder first on sys.path; tests put experiments/ there themselves.
"""
