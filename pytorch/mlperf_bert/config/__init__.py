"""The run's settings: the typed config tree, its flags and the launcher's variable names.

Owns: `settings.py` (one frozen dataclass per component, validation from the values alone,
each flag's default, choices and help), `cli.py` (argparse generated from that tree, MLPerf
flag names), `flag_variables.py` (which config variable of `run_and_time.sh` set a flag,
so error lines name it), `closed_division.py` (the closed-division rules a config shows,
one table, also read by tools/package_results.py) and `batch_size.py` (the global batch size of
a config or a config file's variables, one count for the trainer and the tools).

May import: runtime/
"""
