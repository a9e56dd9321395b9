"""The tools' package (tools/mlperf_tools) and its entry points, one folder per kind of tool."""
