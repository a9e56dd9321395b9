"""mlperf_tools.planning: the planner, the step model's calibration, the recipe finder, the balance simulator."""
