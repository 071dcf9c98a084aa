"""`batchinfer profile`'s machinery: a measured cost model (profiler.py -> profile_table.py),
hardware presets with a roofline cost model (hardware.py), and a discrete-event simulator that runs
the strategies' real schedulers on simulated executors (simulator.py, executor.py)."""
