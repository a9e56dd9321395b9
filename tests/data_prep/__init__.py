"""data_prep: each preparation step, verification, the MLCommons reference outputs, text to the trainer."""
