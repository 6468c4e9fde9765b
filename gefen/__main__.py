"""`python -m gefen`: prints gefen.show_config() (version, build, CPU kernels, threads,
torch), what a bug report needs."""

from gefen import show_config

show_config()
