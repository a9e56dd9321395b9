"""mlperf_tools.bring_up: bring_up.sh, the numerics check and its bands, the GPU measurement, the image's imports."""
