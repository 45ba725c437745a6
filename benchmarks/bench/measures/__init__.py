"""What `tandem bench` measures besides latency: energy (the meters; a
system's idle baseline, windows and joules per token), the peak memory of a
process tree, decode as a share of memory bandwidth."""
