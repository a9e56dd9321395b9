"""Results: MLPerf logs read, scored, packaged, checked and compared.

- `compare`: one run's MLPerf log (`read_run`, `RunLog`) and the side-by-side report of result folders;
- `scoring`: the olympic mean, the RCP window and the choice of runs, with the official tools' code;
- `package_results`: the submission package: build, check with the official checkers, score;
- `replay_run`: a finished run's summary and curves, rebuilt from its logs.

May import: nothing
"""
