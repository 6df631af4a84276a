"""The model runner: host batch preparation, the compiled step executables, warm-up."""
