"""The test system's own tools.

- `mutants` and `mutant_list`: mutation testing of the newest modules (docs/TESTING.md);
- `kill_soak`: a run killed at random moments and resumed must end bitwise like one left alone;
- `check_layering`: imports flow one way, in the packages, the tools and the benchmarks.

May import: nothing
"""
